"""User data -> validated token rows (SFT) or prompt/answer rows (RL), with a report.

Files are read with the `datasets` library (CSV, Parquet, a folder saved with
`Dataset.save_to_disk`), except JSON/JSONL, which are parsed row by row with `json`:
Arrow's schema unification would change values (an int answer next to a float one
becomes "5.0", keys missing in some rows appear as None) and its errors name no line.
CSV cells are read as strings for the same reason (pandas turns an int column with one
empty cell into floats). Embedded sets ("embedded:arith-sft", "embedded:arith-rl") live
in engine/assets. Every row is checked before any training starts: a bad row is a
one-line `DataError` naming the file, the row (1-based: the n-th row, which is the
line of a JSONL file without blank lines and the n-th data row of a CSV; a malformed
JSON line is named by its line) and the problem.

Formats (detected from the columns, or forced with `data.format`):

    messages            {"messages": [{"role", "content"}, ...]}
    alpaca              {"instruction", "input"?, "output"}
    prompt_completion   {"prompt", "completion"}         (prompt may be a list of messages)
    text                {"text"}                          every token is a target
    rl                  {"prompt", "answer", ...extra}    extra columns reach the reward

SFT masking: only the content of assistant turns (and the end-of-turn token that closes
each) is a target; everything else has label -100. The boundaries come from rendering
prefixes of the conversation with the tokenizer's own chat template
(`add_generation_prompt=True` for the prompt side) and checking that each prefix's
tokens are a prefix of the whole conversation's tokens. This costs 2 extra renders and
tokenizations per assistant turn, but it works for any template without knowing its
markup, and a template that breaks the prefix property is reported instead of silently
training on the wrong tokens. All rows are rendered first and their texts tokenized in
a few large batches (per-row calls were 6x slower). Measured here (2-core CPU shared
with other jobs, SmolLM2 tokenizer): 3,500 one-turn rows in 0.8 s; 1,000 rows of 4
user/assistant exchanges in 2.8 s (rendering grows with turns squared).

Memory: all rows are held as Python lists of ints (about 30 bytes per token), which is
fine for the datasets a one-GPU fine-tune uses (up to a few million tokens); `collate`
pads per batch to the batch's longest row, not to max_seq_len, so short batches stay
cheap, and the padding rows it leaves are exactly the zero-gradient rows SEBP skips.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import prompts
from .errors import DataError
from .settings import EMBEDDED_RL_DATA, EMBEDDED_SFT_DATA, DataSettings

ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED = {
    EMBEDDED_SFT_DATA: ASSETS / "arith_sft.jsonl",
    EMBEDDED_RL_DATA: ASSETS / "arith_rl_train.jsonl",
}
# The held-out pairs of an embedded set: used as its eval split unless the user gives
# data.eval_path (a fractional split of 70 pairs would test on trained questions' kin).
EMBEDDED_EVAL = {EMBEDDED_RL_DATA: ASSETS / "arith_rl_eval.jsonl"}

FORMATS = ("messages", "alpaca", "prompt_completion", "text", "rl")
EXPECTED_COLUMNS = {
    "messages": "messages",
    "alpaca": "instruction, input (optional), output",
    "prompt_completion": "prompt, completion",
    "text": "text",
    "rl": "prompt, answer",
}
IGNORE = -100
DROP_LONG = "longer than max_seq_len"
DROP_NO_TARGET = "no target tokens left after truncation"
DROP_LONG_PROMPT = "prompt longer than max_seq_len"


# --------------------------------------------------------------------------- results


@dataclass
class ValidationReport:
    """What was read and what became of it; JSON-serialisable via dataclasses.asdict."""

    file: str
    format: str
    rows_total: int
    rows_kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    token_lengths: dict = field(default_factory=dict)  # min, mean, p50, p95, max
    histogram: dict = field(default_factory=dict)  # {"edges": [...], "counts": [...]}
    train_rows: int = 0
    eval_rows: int = 0
    eval_file: str = ""  # "" = split off the main file with eval_fraction
    length_unit: str = "tokens"  # RL without a tokenizer measures prompts in characters

    def summary(self) -> str:
        lines = [
            f"{self.file} ({self.format}): {self.rows_kept} of {self.rows_total} rows kept"
            f" -> {self.train_rows} train, {self.eval_rows} eval"
            + (f" (eval from {self.eval_file})" if self.eval_file else "")
        ]
        for reason, n in self.dropped.items():
            lines.append(f"  dropped {n}: {reason}")
        if self.truncated:
            lines.append(f"  truncated {self.truncated} (the end was cut to max_seq_len)")
        t = self.token_lengths
        if t:
            lines.append(
                f"  {self.length_unit}: min {t['min']}, mean {t['mean']:.1f}, p50 {t['p50']},"
                f" p95 {t['p95']}, max {t['max']}"
            )
        return "\n".join(lines)


@dataclass
class SFTExample:
    input_ids: list[int]
    labels: list[int]  # IGNORE (-100) on everything that is not a target


@dataclass
class SFTData:
    train: list[SFTExample]
    eval: list[SFTExample]
    report: ValidationReport


@dataclass
class RLData:
    train: list[dict]  # {"prompt": str | list[messages], "answer": str, **extra columns}
    eval: list[dict]
    report: ValidationReport


# --------------------------------------------------------------------------- reading


def resolve_data_path(path: str) -> str:
    """An embedded name or a user path -> an existing file or folder."""
    if not path:
        raise DataError("no data path given (data.path)")
    if path.startswith("embedded:"):
        if path not in EMBEDDED:
            raise DataError(f"unknown embedded dataset '{path}' (known: {', '.join(EMBEDDED)})")
        p = EMBEDDED[path]
        if not p.is_file():
            raise DataError("embedded dataset file is missing; run engine/assets/make_embedded.py", file=str(p))
        return str(p)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError("file not found", file=path)
    if p.is_file() and not os.access(p, os.R_OK):
        raise DataError("file is not readable (permissions)", file=path)
    return str(p)


def _kind(p: Path) -> str:
    if p.is_dir():
        return "saved"
    name = p.name.lower()
    for suffix, kind in ((".jsonl", "json"), (".ndjson", "json"), (".json", "json"), (".csv", "csv"),
                         (".tsv", "csv"), (".parquet", "parquet"), (".pq", "parquet")):
        if name.endswith(suffix) or name.endswith(suffix + ".gz"):
            return kind
    raise DataError("unknown file type (expected .jsonl, .json, .csv, .parquet or a saved dataset folder)",
                    file=str(p))


def _json_rows_by_hand(p: Path, shown: str) -> list[dict]:
    """Parse JSON(L) ourselves: to name the malformed line, and for files whose rows
    `datasets` cannot unify into one Arrow schema (e.g. an int answer here, a string there)."""
    name = p.name.lower().removesuffix(".gz")
    try:
        raw = gzip.decompress(p.read_bytes()) if p.name.lower().endswith(".gz") else p.read_bytes()
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not data
    except (OSError, EOFError) as e:
        if isinstance(e, PermissionError):
            raise
        raise DataError(f"cannot read: {e}", file=shown) from None
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 text ({e.reason} at byte {e.start})", file=shown) from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"malformed JSON at line {e.lineno}: {e.msg}", file=shown, row=e.lineno) from None
        except RecursionError:
            raise DataError(_TOO_DEEP, file=shown) from None
        rows = data
    elif stripped.startswith("{") and not name.endswith((".jsonl", ".ndjson")) and _single_json(text):
        data = json.loads(text)
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:  # {"data": [rows]}
            rows = lists[0]
        elif data and len(lists) == len(data) and len({len(v) for v in lists}) == 1:  # {"col": [...], ...}
            rows = [dict(zip(data, values)) for values in zip(*lists)]
        else:
            rows = [data]
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON on line {n}: {e.msg} (column {e.colno})", file=shown, row=n) from None
            except RecursionError:
                raise DataError(_TOO_DEEP, file=shown, row=n) from None
    for i, r in enumerate(rows, start=1):
        if not isinstance(r, dict):
            raise DataError(f"expected a JSON object per row, got {type(r).__name__}", file=shown, row=i)
    return rows


_TOO_DEEP = "JSON nested too deeply to read (thousands of levels of [ or {)"


def _single_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False
    except RecursionError:  # then read line by line, which names the row
        return False


def _csv_string_features(p: Path, delimiter: str, shown: str):
    """Every CSV column as a string (see module docstring), named from the header row."""
    import csv

    import datasets

    opener = gzip.open if p.name.lower().endswith(".gz") else open
    try:
        with opener(p, "rt", encoding="utf-8-sig", newline="") as f:  # a leading byte-order mark is not a column name
            header = next(csv.reader(f, delimiter=delimiter), [])
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 text ({e.reason} at byte {e.start})", file=shown) from None
    if not header:
        raise DataError("the dataset is empty (no header row)", file=shown)
    return datasets.Features({name: datasets.Value("string") for name in header})


def read_rows(path: str, max_rows: int = 0) -> list[dict]:
    """Raw rows of a file/folder (or embedded name), as plain Python dicts."""
    shown = path
    p = Path(resolve_data_path(path))
    kind = _kind(p)
    if p.is_file() and p.stat().st_size == 0:
        raise DataError("the dataset is empty (the file has 0 bytes)", file=shown)
    if kind == "json":
        try:
            rows = _json_rows_by_hand(p, shown)
        except PermissionError:
            raise DataError("file is not readable (permissions)", file=shown) from None
        if not rows:
            raise DataError("the dataset is empty (no rows)", file=shown)
        return rows[:max_rows] if max_rows else rows
    import datasets

    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    try:
        if kind == "saved":
            try:
                ds = datasets.load_from_disk(str(p))
            except FileNotFoundError:
                raise DataError("a folder must be a dataset saved with Dataset.save_to_disk", file=shown) from None
            if isinstance(ds, datasets.DatasetDict):
                if not ds:
                    raise DataError("the saved dataset has no splits", file=shown)
                ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        else:
            extra = {}
            if kind == "csv":
                delimiter = "\t" if p.name.lower().endswith((".tsv", ".tsv.gz")) else ","
                # keep_default_na=False: an empty cell is "", and answers like "NA" or "None"
                # stay text instead of becoming missing values.
                extra = {"delimiter": delimiter, "features": _csv_string_features(p, delimiter, shown),
                         "keep_default_na": False}
            try:
                ds = datasets.load_dataset(kind, data_files=str(p), split="train", **extra)
            except PermissionError:
                raise
            except Exception as e:
                raise DataError(f"cannot read as {kind}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                                file=shown) from None
    except PermissionError:
        raise DataError("file is not readable (permissions)", file=shown) from None
    if len(ds) == 0:
        raise DataError("the dataset is empty (no rows)", file=shown)
    if max_rows:
        ds = ds.select(range(min(max_rows, len(ds))))
    return ds.to_list()


def detect_format(rows: list[dict], path: str) -> str:
    """Which of FORMATS the rows are in, from the columns of the first row."""
    if not rows:
        raise DataError("the dataset is empty (no rows)", file=path)
    cols = set(rows[0])
    if "messages" in cols:
        return "messages"
    if {"instruction", "output"} <= cols:
        return "alpaca"
    if {"prompt", "answer"} <= cols:
        return "rl"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    if "text" in cols:
        return "text"
    expected = "; ".join(f"{k}: {v}" for k, v in EXPECTED_COLUMNS.items())
    raise DataError(f"unknown columns {sorted(cols)}; expected one of ({expected})", file=path)


def preview(path: str, fmt: str = "auto", n: int = 20) -> tuple[list[dict], str]:
    """First rows and the detected (or given) format, for the UI's table."""
    rows = read_rows(path, max_rows=n)
    return rows, detect_format(rows, path) if fmt == "auto" else fmt


# --------------------------------------------------------------------------- row checks


def _text(row: dict, col: str, file: str, n: int, required: bool = True) -> str:
    """A column as a string; numbers (CSV, JSON) become their text."""
    if col not in row or row[col] is None:
        if required:
            raise DataError(f"missing '{col}' (columns: {sorted(row)})", file=file, row=n)
        return ""
    v = row[col]
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise DataError(f"'{col}' must be a string, got {type(v).__name__}", file=file, row=n)
    return v if isinstance(v, str) else str(v)


def _messages(value: Any, col: str, file: str, n: int) -> list[dict]:
    if not isinstance(value, list):
        raise DataError(f"'{col}' must be a list of {{role, content}}, got {type(value).__name__}", file=file, row=n)
    if not value:
        raise DataError(f"'{col}' is an empty list", file=file, row=n)
    out = []
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"'{col}' item {i} must be {{\"role\": str, \"content\": str}}, got {m!r:.80}",
                            file=file, row=n)
        # Arrow fills keys missing in some rows with None; templates test for presence.
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _conversation(row: dict, fmt: str, file: str, n: int, system_prompt: str) -> list[dict] | None:
    """A row as a conversation (None for `text` rows)."""
    if fmt == "text":
        return None
    if fmt == "messages":
        msgs = _messages(row.get("messages"), "messages", file, n)
    elif fmt == "alpaca":
        instruction = _text(row, "instruction", file, n)
        inp = _text(row, "input", file, n, required=False)
        user = f"{instruction}\n\n{inp}" if inp.strip() else instruction
        msgs = [{"role": "user", "content": user},
                {"role": "assistant", "content": _text(row, "output", file, n)}]
    elif fmt in ("prompt_completion", "rl"):
        # SFT on rl rows trains on the bare answer as the completion.
        target_col = "completion" if fmt == "prompt_completion" else "answer"
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            msgs = _messages(prompt, "prompt", file, n)
        else:
            msgs = [{"role": "user", "content": _text(row, "prompt", file, n)}]
        completion = row.get(target_col)
        if isinstance(completion, list):
            msgs += _messages(completion, target_col, file, n)
        else:
            msgs.append({"role": "assistant", "content": _text(row, target_col, file, n)})
    else:
        raise DataError(f"unknown format '{fmt}' (known: {', '.join(FORMATS)})", file=file)
    msgs = prompts.with_system(msgs, system_prompt)
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistant:
        raise DataError("no assistant turn: nothing to learn from", file=file, row=n)
    if assistant[0] == 0:
        raise DataError("the conversation starts with an assistant turn; it needs a user turn first",
                        file=file, row=n)
    if not any(msgs[i]["content"].strip() for i in assistant):
        raise DataError("the target (assistant reply / output / completion) is empty", file=file, row=n)
    return msgs[: assistant[-1] + 1]  # turns after the last reply teach nothing


# --------------------------------------------------------------------------- tokenizing


def _encode(tok, texts: list[str], special: bool = False) -> list[list[int]]:
    """Token ids of many texts (engine/prompts.encode: batched calls). `special=False`
    because templates write their own BOS/markup."""
    return prompts.encode(tok, texts, special)


def _render(tok, msgs, generation_prompt: bool, file: str, n: int) -> str:
    try:
        return prompts.apply_template(tok, msgs, generation_prompt)
    except Exception as e:  # jinja raises its own errors for conversations a template refuses
        raise DataError(f"the tokenizer's chat template cannot render this conversation: {e}",
                        file=file, row=n) from None


def _chat_texts(tok, msgs: list[dict], file: str, n: int) -> list[str]:
    """The whole conversation, then for each assistant turn: the text before its reply
    (with the generation prompt) and the text through its reply."""
    texts = [_render(tok, msgs, False, file, n)]
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            texts += [_render(tok, msgs[:i], True, file, n), _render(tok, msgs[: i + 1], False, file, n)]
    return texts


def _chat_labels(tok, msgs: list[dict], ids: list[list[int]], file: str, n: int) -> tuple[list[int], list[int]]:
    """Tokens and labels from `_chat_texts`' token ids; see module docstring."""
    full = ids[0]
    labels = [IGNORE] * len(full)
    eos = tok.eos_token_id
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    for k, i in enumerate(turns):
        before, through = ids[1 + 2 * k], ids[2 + 2 * k]
        if full[: len(before)] != before or full[: len(through)] != through:
            raise DataError(
                f"the tokenizer's chat template does not render turn {i + 1} as a prefix of the whole "
                "conversation, so the prompt cannot be masked exactly; use a tokenizer with a "
                "prefix-consistent template or data.format=text",
                file=file, row=n,
            )
        start, end = len(before), len(through)
        # Keep the end-of-turn token as a target (the model must learn to stop), but not
        # the template's separator after it (e.g. the "\n" after <|im_end|>).
        span = full[start:end]
        if eos is not None and eos in span:
            end = start + len(span) - span[::-1].index(eos)
        labels[start:end] = full[start:end]
    return full, labels


def _plain_texts(msgs: list[dict], sep: str) -> list[str]:
    """No chat template: each turn's text; `sep` follows each non-assistant turn: "" for
    prompt/completion rows (the user's own text decides the join, as base-model data
    does), "\n" for rows that come as turns."""
    return [m["content"] if m["role"] == "assistant" else m["content"] + sep for m in msgs]


def _plain_labels(tok, msgs: list[dict], ids: list[list[int]], lead: list[int]) -> tuple[list[int], list[int]]:
    """lead + prompt + completion + eos; only the completion (and its eos) is a target."""
    tokens, labels = list(lead), [IGNORE] * len(lead)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for m, t in zip(msgs, ids):
        if m["role"] == "assistant":
            tokens += t + eos
            labels += t + eos
        else:
            tokens += t
            labels += [IGNORE] * len(t)
    return tokens, labels


def _text_labels(tok, ids: list[int]) -> tuple[list[int], list[int]]:
    # `ids` carry the tokenizer's own BOS, if it adds one. End with eos so the model
    # learns to stop (unless the tokenizer already added it).
    if tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
        ids = ids + [tok.eos_token_id]
    return ids, list(ids)


def _tokenize_rows(rows, fmt, tok, ds: DataSettings, file: str, stats: dict) -> list[SFTExample]:
    """Check every row and render its texts, tokenize all texts at once, then label."""
    chat = prompts.has_template(tok)
    sep = "" if fmt in ("prompt_completion", "rl") else "\n"
    # Whatever the tokenizer itself puts first (a BOS for Llama-like ones, nothing for many).
    lead = [t for t in tok("")["input_ids"] if t != tok.eos_token_id]
    prepared = []  # (row number, conversation or None for text rows, texts)
    for n, row in enumerate(rows, start=1):
        if fmt == "text":
            text = _text(row, "text", file, n)
            if not text.strip():
                raise DataError("'text' is empty", file=file, row=n)
            prepared.append((n, None, [text]))
        else:
            # without a chat template there is no place for a system prompt (engine/prompts.py)
            msgs = _conversation(row, fmt, file, n, ds.system_prompt if chat else "")
            prepared.append((n, msgs, _chat_texts(tok, msgs, file, n) if chat else _plain_texts(msgs, sep)))
    # A row's last "through" prefix is usually its whole text: encode each text once.
    unique = list(dict.fromkeys(t for _, _, texts in prepared for t in texts))
    encoded = dict(zip(unique, _encode(tok, unique, special=fmt == "text")))
    del unique

    out = []
    for n, msgs, texts in prepared:
        stats["total"] += 1
        ids = [encoded[t] for t in texts]
        if msgs is None:
            ids, labels = _text_labels(tok, ids[0])
        elif chat:
            ids, labels = _chat_labels(tok, msgs, ids, file, n)
        else:
            ids, labels = _plain_labels(tok, msgs, ids, lead)
        if all(x == IGNORE for x in labels):
            raise DataError("no target tokens (the target is empty after tokenizing)", file=file, row=n)
        if len(ids) > ds.max_seq_len:
            if ds.overlong == "drop":
                stats["dropped"][DROP_LONG] = stats["dropped"].get(DROP_LONG, 0) + 1
                continue
            ids, labels = ids[: ds.max_seq_len], labels[: ds.max_seq_len]
            # Only positions 1.. are predicted (labels shift by one inside the model).
            if all(x == IGNORE for x in labels[1:]):
                stats["dropped"][DROP_NO_TARGET] = stats["dropped"].get(DROP_NO_TARGET, 0) + 1
                continue
            stats["truncated"] += 1
        out.append(SFTExample(ids, labels))
    return out


# --------------------------------------------------------------------------- split + report


def _split(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Seeded held-out share; at least one eval row when asked for and possible.
    Both halves keep file order (the training loop shuffles)."""
    n = len(items)
    if eval_fraction <= 0 or n < 2:
        return list(items), []
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    held = set(random.Random(seed).sample(range(n), n_eval))
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def _length_stats(lengths: list[int], bins: int = 20) -> tuple[dict, dict]:
    import numpy as np

    if not lengths:
        return {}, {"edges": [], "counts": []}
    a = np.asarray(lengths)
    stats = {
        "min": int(a.min()),
        "mean": float(a.mean()),
        "p50": int(np.percentile(a, 50, method="nearest")),
        "p95": int(np.percentile(a, 95, method="nearest")),
        "max": int(a.max()),
    }
    counts, edges = np.histogram(a, bins=min(bins, max(1, int(a.max() - a.min()) + 1)))
    return stats, {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def _eval_source(ds: DataSettings) -> str:
    if ds.eval_path:
        return ds.eval_path
    return str(EMBEDDED_EVAL[ds.path]) if ds.path in EMBEDDED_EVAL else ""


def _format_for(rows: list[dict], ds: DataSettings, file: str) -> str:
    if ds.format != "auto":
        if ds.format not in FORMATS:
            raise DataError(f"unknown format '{ds.format}' (known: {', '.join(FORMATS)})", file=file)
        return ds.format
    return detect_format(rows, file)


# --------------------------------------------------------------------------- public loaders


def load_sft(ds: DataSettings, tokenizer, seed: int) -> SFTData:
    """Read, check and tokenize SFT data; split train/eval; report what happened."""
    rows = read_rows(ds.path, ds.max_rows)
    fmt = _format_for(rows, ds, ds.path)
    stats = {"total": 0, "dropped": {}, "truncated": 0}
    examples = _tokenize_rows(rows, fmt, tokenizer, ds, ds.path, stats)
    eval_file = _eval_source(ds)
    if eval_file:
        eval_rows = read_rows(eval_file)
        eval_fmt = _format_for(eval_rows, ds, eval_file)
        train, evals = examples, _tokenize_rows(eval_rows, eval_fmt, tokenizer, ds, eval_file, stats)
    else:
        train, evals = _split(examples, ds.eval_fraction, seed)
    if not train:
        raise DataError(f"no rows left to train on after checking {stats['total']} "
                        f"({', '.join(f'{n} {r}' for r, n in stats['dropped'].items())})", file=ds.path)
    lengths, hist = _length_stats([len(e.input_ids) for e in train + evals])
    report = ValidationReport(
        file=ds.path, format=fmt, rows_total=stats["total"], rows_kept=len(train) + len(evals),
        dropped=stats["dropped"], truncated=stats["truncated"], token_lengths=lengths, histogram=hist,
        train_rows=len(train), eval_rows=len(evals), eval_file=eval_file,
    )
    return SFTData(train, evals, report)


def _rl_rows(rows: list[dict], fmt: str, ds: DataSettings, file: str) -> list[dict]:
    if fmt != "rl":
        raise DataError(f"RL needs rows with 'prompt' and 'answer' (found columns {sorted(rows[0])}, "
                        f"format '{fmt}')", file=file)
    out = []
    for n, row in enumerate(rows, start=1):
        if "answer" not in row or row["answer"] is None:
            raise DataError(f"missing 'answer' (columns: {sorted(row)})", file=file, row=n)
        answer = _text(row, "answer", file, n)
        if not answer.strip():
            raise DataError("'answer' is empty", file=file, row=n)
        # Prompts stay as written; the rollouts add data.system_prompt when they render.
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            prompt = _messages(prompt, "prompt", file, n)
        else:
            prompt = _text(row, "prompt", file, n)
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
    fmt = _format_for(rows, ds, ds.path)
    dropped: dict[str, int] = {}
    train = _drop_long_prompts(_rl_rows(rows, fmt, ds, ds.path), tokenizer, ds, ds.path, dropped)
    total = len(rows)
    eval_file = _eval_source(ds)
    if eval_file:
        eval_rows = read_rows(eval_file)
        evals = _rl_rows(eval_rows, _format_for(eval_rows, ds, eval_file), ds, eval_file)
        evals = _drop_long_prompts(evals, tokenizer, ds, eval_file, dropped)
        total += len(eval_rows)
    else:
        train, evals = _split(train, ds.eval_fraction, seed)
    if not train:
        raise DataError(f"no prompts left to train on ({total} rows read, "
                        f"{sum(dropped.values())} longer than max_seq_len={ds.max_seq_len})", file=ds.path)
    lengths, hist = _length_stats([n for _, n in train + evals])
    train, evals = [r for r, _ in train], [r for r, _ in evals]
    report = ValidationReport(
        file=ds.path, format=fmt, rows_total=total, rows_kept=len(train) + len(evals), dropped=dropped,
        token_lengths=lengths, histogram=hist, train_rows=len(train), eval_rows=len(evals),
        eval_file=eval_file,
        length_unit="tokens" if tokenizer is not None else "characters",
    )
    return RLData(train, evals, report)


def collate(examples: list[SFTExample], pad_id: int) -> dict:
    """Right-pad to the batch's longest row; padding gets attention 0 and label -100."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        labels[i, :n] = torch.tensor(e.labels, dtype=torch.long)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def report_dict(report: ValidationReport) -> dict:
    return dataclasses.asdict(report)
