"""Preference pairs: rows of a prompt and two replies, the chosen one preferred.

A row is `{"prompt": ..., "chosen": ..., "rejected": ...}` or `{"messages": [...], "chosen":
..., "rejected": ...}`: the prompt a string (one user turn) or chat messages ending with the
user's turn, each reply a string, one assistant message or a list of assistant turns. Each
reply becomes the conversation `prompt + reply`, tokenised and labelled exactly as an SFT row
(engine/data/sft.py: the prompt masked, the reply and its end-of-turn token the targets), so a
pair is two SFT rows that share their prompt. A pair is checked as a whole: a bad reply, a
reply identical to the other (the pair says nothing) or a prompt without a user turn is a
one-line error naming the row; a pair whose longer conversation exceeds data.max_seq_len is
dropped and counted (cutting one reply would compare a cut reply with a whole one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DataSettings

from edgetune.engine.data.files import (
    Progress,
    ValidationReport,
    eval_source,
    format_for,
    iter_rows,
    length_stats,
    split_rows,
)
from edgetune.engine.data.sft import SFTExample, tokenize_rows

DROP_LONG_PAIR = "longer than data.max_seq_len"


@dataclass
class PairExample:
    chosen: SFTExample
    rejected: SFTExample


@dataclass
class PairData:
    train: list[PairExample]
    eval: list[PairExample]
    report: ValidationReport


def _reply(value, which: str, file: str, n: int) -> list[dict]:
    """A reply as assistant turns."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"'{which}' is empty", file=file, row=n)
        return [{"role": "assistant", "content": value}]
    turns = [value] if isinstance(value, dict) else value
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, dict) and t.get("role") == "assistant" and isinstance(t.get("content"), str) for t in turns):
        raise DataError(f"'{which}' must be a string or assistant messages ({{\"role\": \"assistant\", "
                        f"\"content\": ...}})", file=file, row=n)
    if not any(t["content"].strip() for t in turns):
        raise DataError(f"'{which}' is empty", file=file, row=n)
    return [{"role": "assistant", "content": t["content"]} for t in turns]


def _prompt(row: dict, file: str, n: int) -> list[dict]:
    value = row.get("messages", row.get("prompt"))
    if value is None:
        raise DataError("no 'prompt' or 'messages' column: a pair needs the prompt both replies answer",
                        file=file, row=n)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        if not value.strip():
            raise DataError("the prompt is empty", file=file, row=n)
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise DataError("the prompt must be a string or a list of chat messages", file=file, row=n)
    if value[-1].get("role") != "user":
        raise DataError("the prompt's messages must end with the user's turn the replies answer", file=file, row=n)
    return list(value)


def pair_conversations(row: dict, file: str, n: int) -> tuple[list[dict], list[dict]]:
    """(prompt + chosen, prompt + rejected) as chat messages; DataError for a bad row."""
    if not isinstance(row, dict):
        raise DataError("a row must be an object with prompt, chosen and rejected", file=file, row=n)
    for col in ("chosen", "rejected"):
        if row.get(col) is None:
            raise DataError(f"no '{col}' reply", file=file, row=n)
    prompt = _prompt(row, file, n)
    chosen, rejected = _reply(row["chosen"], "chosen", file, n), _reply(row["rejected"], "rejected", file, n)
    if chosen == rejected:
        raise DataError("'chosen' and 'rejected' are the same reply: the pair prefers nothing", file=file, row=n)
    return prompt + chosen, prompt + rejected


def tokenize_pairs(rows, tok, ds: DataSettings, file: str, stats: dict,
                   progress: Progress | None = None, lengths_only: bool = False) -> list[PairExample]:
    """Check every pair and label both of its conversations as SFT rows (`lengths_only`:
    keep the pair's length, the longer of the two, instead)."""
    whole = dataclasses.replace(ds, max_seq_len=2**31 - 1)  # lengths are judged per pair below
    out = []
    for n, row in enumerate(rows, start=1):
        stats["total"] += 1
        chosen, rejected = pair_conversations(row, file, n)
        inner = {"total": 0, "dropped": {}, "truncated": 0}
        try:
            c, r = tokenize_rows([{"messages": chosen}, {"messages": rejected}], "messages", tok, whole, file, inner)
        except DataError as e:  # the row number of this file, not of the pair's two conversations
            raise DataError(e.problem, file=file, row=n) from None
        if max(len(c.input_ids), len(r.input_ids)) > ds.max_seq_len:
            stats["dropped"][DROP_LONG_PAIR] = stats["dropped"].get(DROP_LONG_PAIR, 0) + 1
            continue
        out.append(max(len(c.input_ids), len(r.input_ids)) if lengths_only else PairExample(c, r))
        if progress is not None and n % 256 == 0:
            progress.rows(stats["total"])
    if progress is not None:
        progress.rows(stats["total"], final=True)
    return out


def _rows(path: str, ds: DataSettings, max_rows: int = 0, progress: Progress | None = None):
    import itertools

    rows = iter_rows(path, max_rows, progress)
    first = next(rows)
    fmt = format_for([first], ds, path)
    if fmt != "pairs":
        raise DataError(f"these rows are {fmt} rows; preference tuning needs pairs (columns: prompt or messages, "
                        "chosen, rejected)", file=path)
    return itertools.chain([first], rows)


def load_pairs(ds: DataSettings, tokenizer, seed: int, progress=None, lengths_only: bool = False) -> PairData:
    """Read, check and tokenize preference pairs; split train / held-out; report.
    `lengths_only`: a check (`edgetune data`): train and eval hold each pair's length, not
    its tokens, so memory stays small whatever the file's size."""
    reading = Progress(progress)
    stats = {"total": 0, "dropped": {}, "truncated": 0}
    examples = tokenize_pairs(_rows(ds.path, ds, ds.max_rows, reading), tokenizer, ds, ds.path, stats, reading,
                              lengths_only)
    eval_file = eval_source(ds)
    if eval_file:
        train, evals = examples, tokenize_pairs(_rows(eval_file, ds), tokenizer, ds, eval_file, stats,
                                                lengths_only=lengths_only)
    else:
        train, evals = split_rows(examples, ds.eval_fraction, seed)
    if not train:
        dropped = ", ".join(f"{k} {r}" for r, k in stats["dropped"].items()) or "none kept"
        raise DataError(f"no pairs left to train on after checking {stats['total']} ({dropped})", file=ds.path)
    lengths, hist = length_stats([p if lengths_only else max(len(p.chosen.input_ids), len(p.rejected.input_ids))
                                  for p in train + evals])
    report = ValidationReport(
        file=ds.path, format="pairs", rows_total=stats["total"], rows_kept=len(train) + len(evals),
        dropped=stats["dropped"], truncated=0, token_lengths=lengths, histogram=hist,
        train_rows=len(train), eval_rows=len(evals), eval_file=eval_file,
    )
    return PairData(train, evals, report)
