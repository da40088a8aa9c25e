"""RL rows: prompt/answer pairs checked, their prompts measured as the rollouts will render
them (engine/data/prompts.py), and split into train / held-out."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DataSettings

from edgetune.engine.data import prompts
from edgetune.engine.data.files import (
    CHUNK_ROWS,
    Progress,
    ValidationReport,
    eval_source,
    format_for,
    iter_rows,
    length_stats,
    messages_cell,
    read_rows,
    split_rows,
    text_cell,
)

DROP_LONG_PROMPT = "prompt longer than max_seq_len"


@dataclass
class RLData:
    train: list[dict]  # {"prompt": str | list[messages], "answer": str, **extra columns}
    eval: list[dict]
    report: ValidationReport


def rl_rows(rows: list[dict], fmt: str, ds: DataSettings, file: str, first: int = 1) -> list[dict]:
    """Every row checked (a DataError names the first bad one, counting from row `first`)
    and kept as written: {"prompt": text or messages, "answer": text, **extra columns}."""
    if fmt != "rl":
        raise DataError(f"RL needs rows with 'prompt' and 'answer' (found columns {sorted(rows[0])}, "
                        f"format '{fmt}')", file=file)
    out = []
    for n, row in enumerate(rows, start=first):
        if "answer" not in row or row["answer"] is None:
            raise DataError(f"missing 'answer' (columns: {sorted(row)})", file=file, row=n)
        answer = text_cell(row, "answer", file, n)
        if not answer.strip():
            raise DataError("'answer' is empty", file=file, row=n)
        # Prompts stay as written; the rollouts add data.system_prompt when they render.
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            prompt = messages_cell(prompt, "prompt", file, n)
        else:
            prompt = text_cell(row, "prompt", file, n)
            if not prompt.strip():
                raise DataError("'prompt' is empty", file=file, row=n)
        out.append({**row, "prompt": prompt, "answer": answer})
    return out


def _prompt_lengths(rows: list[dict], tokenizer, system_prompt: str, file: str, first: int = 1) -> list[int]:
    """Prompt lengths as the rollouts will see them: in tokens, rendered by
    engine/data/prompts.py as the rollouts render them; in characters without a tokenizer."""
    if tokenizer is None:
        return [len(p) if isinstance(p, str) else sum(len(m["content"]) for m in p)
                for p in (r["prompt"] for r in rows)]
    texts = []
    for n, r in enumerate(rows, start=first):
        try:
            texts.append(prompts.prompt_text(tokenizer, r["prompt"], system_prompt))
        except Exception as e:  # jinja raises its own errors for conversations a template refuses
            raise DataError(f"the tokenizer's chat template cannot render this prompt: {e}",
                            file=file, row=n) from None
    return [len(ids) for ids in prompts.encode(tokenizer, texts, special=not prompts.has_template(tokenizer))]


def _drop_long_prompts(rows: list[dict], tokenizer, ds: DataSettings, file: str,
                       dropped: dict, first: int = 1) -> list[tuple[dict, int]]:
    """(row, prompt length) pairs; with a tokenizer, prompts over max_seq_len are dropped
    (cutting a question makes it unanswerable, so `overlong: truncate` drops them too)."""
    out = []
    for r, n in zip(rows, _prompt_lengths(rows, tokenizer, ds.system_prompt, file, first)):
        if tokenizer is not None and n > ds.max_seq_len:
            dropped[DROP_LONG_PROMPT] = dropped.get(DROP_LONG_PROMPT, 0) + 1
            continue
        out.append((r, n))
    return out


def _checked(path: str, ds: DataSettings, tokenizer, dropped: dict, max_rows: int = 0,
             progress: Progress | None = None, lengths_only: bool = False) -> tuple[list[tuple[dict, int]], str, int]:
    """(row, prompt length) pairs of a file read CHUNK_ROWS rows at a time (`lengths_only`:
    (None, prompt length)), its format, and the count of rows read."""
    rows = iter_rows(path, max_rows, progress)
    first = next(rows)
    fmt = format_for([first], ds, path)
    out: list[tuple[dict, int]] = []
    total = 0
    rows = itertools.chain([first], rows)
    while chunk := list(itertools.islice(rows, CHUNK_ROWS)):
        kept = _drop_long_prompts(rl_rows(chunk, fmt, ds, path, total + 1), tokenizer, ds, path, dropped, total + 1)
        out += [(None, n) for _, n in kept] if lengths_only else kept
        total += len(chunk)
        if progress is not None:
            progress.rows(total)
    if progress is not None:
        progress.rows(total, final=True)
    return out, fmt, total


def load_rl(ds: DataSettings, seed: int, tokenizer=None, progress=None, lengths_only: bool = False) -> RLData:
    """Read and check prompt/answer rows; split train/eval. With a tokenizer, prompt lengths
    are in tokens as the rollouts will see them (chat template + generation prompt) and
    prompts longer than max_seq_len are dropped; without one, lengths are in characters.
    `progress(rows, bytes_read, bytes_total)` hears how far a long file got (Progress).
    `lengths_only`: a check (`edgetune data`): the rows themselves are not kept (None in
    train and eval), so memory stays small whatever the file's size."""
    dropped: dict[str, int] = {}
    train, fmt, total = _checked(ds.path, ds, tokenizer, dropped, ds.max_rows, Progress(progress), lengths_only)
    eval_file = eval_source(ds)
    if eval_file:
        evals, _, n_eval = _checked(eval_file, ds, tokenizer, dropped, lengths_only=lengths_only)
        total += n_eval
    else:
        train, evals = split_rows(train, ds.eval_fraction, seed)
    if not train:
        raise DataError(f"no prompts left to train on ({total} rows read, "
                        f"{sum(dropped.values())} longer than max_seq_len={ds.max_seq_len})", file=ds.path)
    lengths, hist = length_stats([n for _, n in train + evals])
    train, evals = [r for r, _ in train], [r for r, _ in evals]
    report = ValidationReport(
        file=ds.path, format=fmt, rows_total=total, rows_kept=len(train) + len(evals), dropped=dropped,
        token_lengths=lengths, histogram=hist, train_rows=len(train), eval_rows=len(evals),
        eval_file=eval_file,
        length_unit="tokens" if tokenizer is not None else "characters",
    )
    return RLData(train, evals, report)


TASK_FORMATS = ("rl", "messages", "prompt_completion")  # what a task file of graded prompts may hold


def task_rows(path: str, ds: DataSettings) -> list[dict]:
    """The prompts of a task file, each with the answer it is graded against: rows of
    prompt + answer (or prompt + completion), or chat rows whose last turn is the
    assistant's answer and whose earlier turns are the prompt. Every row is checked; a bad
    one is a DataError naming the file and the row."""
    rows = read_rows(path)
    fmt = format_for(rows, ds, path)
    if fmt not in TASK_FORMATS:
        raise DataError(f"a task file needs rows of prompt + answer, prompt + completion or chat messages "
                        f"(found columns {sorted(rows[0])}, format '{fmt}')", file=path)
    if fmt == "rl":
        return rl_rows(rows, fmt, ds, path)
    out = []
    for n, row in enumerate(rows, start=1):
        if fmt == "prompt_completion":
            out += rl_rows([{**row, "answer": row.get("completion")}], "rl", ds, path, n)
            continue
        msgs = messages_cell(row.get("messages"), "messages", path, n)
        if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"].strip():
            raise DataError("the last message must be the assistant's answer (role 'assistant', not empty)",
                            file=path, row=n)
        if not any(m["role"] == "user" for m in msgs[:-1]):
            raise DataError("no user message before the answer", file=path, row=n)
        out.append({**row, "prompt": msgs[:-1], "answer": msgs[-1]["content"]})
    return out
