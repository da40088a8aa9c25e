"""RL rows: prompt/answer pairs checked, their prompts measured as the rollouts will render
them (engine/prompts.py), and split into train / held-out."""

from __future__ import annotations

from dataclasses import dataclass

from . import prompts
from .data_files import ValidationReport, eval_source, format_for, length_stats, messages_cell, read_rows, \
    split_rows, text_cell
from .errors import DataError
from .settings import DataSettings

DROP_LONG_PROMPT = "prompt longer than max_seq_len"


@dataclass
class RLData:
    train: list[dict]  # {"prompt": str | list[messages], "answer": str, **extra columns}
    eval: list[dict]
    report: ValidationReport


def rl_rows(rows: list[dict], fmt: str, ds: DataSettings, file: str) -> list[dict]:
    """Every row checked (a DataError names the first bad one) and kept as written:
    {"prompt": text or messages, "answer": text, **extra columns}."""
    if fmt != "rl":
        raise DataError(f"RL needs rows with 'prompt' and 'answer' (found columns {sorted(rows[0])}, "
                        f"format '{fmt}')", file=file)
    out = []
    for n, row in enumerate(rows, start=1):
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


def _prompt_lengths(rows: list[dict], tokenizer, system_prompt: str, file: str) -> list[int]:
    """Prompt lengths as the rollouts will see them: in tokens, rendered by
    engine/prompts.py as the rollouts render them; in characters without a tokenizer."""
    if tokenizer is None:
        return [len(p) if isinstance(p, str) else sum(len(m["content"]) for m in p)
                for p in (r["prompt"] for r in rows)]
    texts = []
    for n, r in enumerate(rows, start=1):
        try:
            texts.append(prompts.prompt_text(tokenizer, r["prompt"], system_prompt))
        except Exception as e:  # jinja raises its own errors for conversations a template refuses
            raise DataError(f"the tokenizer's chat template cannot render this prompt: {e}",
                            file=file, row=n) from None
    return [len(ids) for ids in prompts.encode(tokenizer, texts, special=not prompts.has_template(tokenizer))]


def _drop_long_prompts(rows: list[dict], tokenizer, ds: DataSettings, file: str,
                       dropped: dict) -> list[tuple[dict, int]]:
    """(row, prompt length) pairs; with a tokenizer, prompts over max_seq_len are dropped
    (cutting a question makes it unanswerable, so `overlong: truncate` drops them too)."""
    out = []
    for r, n in zip(rows, _prompt_lengths(rows, tokenizer, ds.system_prompt, file)):
        if tokenizer is not None and n > ds.max_seq_len:
            dropped[DROP_LONG_PROMPT] = dropped.get(DROP_LONG_PROMPT, 0) + 1
            continue
        out.append((r, n))
    return out


def load_rl(ds: DataSettings, seed: int, tokenizer=None) -> RLData:
    """Read and check prompt/answer rows; split train/eval. With a tokenizer, prompt lengths
    are in tokens as the rollouts will see them (chat template + generation prompt) and
    prompts longer than max_seq_len are dropped; without one, lengths are in characters."""
    rows = read_rows(ds.path, ds.max_rows)
    fmt = format_for(rows, ds, ds.path)
    dropped: dict[str, int] = {}
    train = _drop_long_prompts(rl_rows(rows, fmt, ds, ds.path), tokenizer, ds, ds.path, dropped)
    total = len(rows)
    eval_file = eval_source(ds)
    if eval_file:
        eval_rows = read_rows(eval_file)
        evals = rl_rows(eval_rows, format_for(eval_rows, ds, eval_file), ds, eval_file)
        evals = _drop_long_prompts(evals, tokenizer, ds, eval_file, dropped)
        total += len(eval_rows)
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
