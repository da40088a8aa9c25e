"""Reading data files: formats, encodings, row errors, and the report of what was read.

Files are read with the `datasets` library (CSV, Parquet, a folder saved with
`Dataset.save_to_disk`), except JSON/JSONL, which are parsed row by row with `json`:
Arrow's schema unification would change values (an int answer next to a float one
becomes "5.0", keys missing in some rows appear as None) and its errors name no line.
CSV cells are read as strings for the same reason (pandas turns an int column with one
empty cell into floats). Embedded sets ("embedded:arith-sft", "embedded:arith-rl") live
in engine/data/assets. Every row is checked before any training starts: a bad row is a
one-line `DataError` naming the file, the row (1-based: the n-th row, which is the
line of a JSONL file without blank lines and the n-th data row of a CSV; a malformed
JSON line is named by its line) and the problem.

What becomes of the rows: engine/data/sft.py (token rows with masked prompts) and
engine/data/rl.py (prompt/answer rows); engine/data/__init__.py gathers the three.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgetune.engine.core.errors import DataError, reason_line
from edgetune.engine.core.settings import EMBEDDED_PAIRS_DATA, EMBEDDED_RL_DATA, EMBEDDED_SFT_DATA, DataSettings

ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED = {
    EMBEDDED_SFT_DATA: ASSETS / "arith_sft.jsonl",
    EMBEDDED_RL_DATA: ASSETS / "arith_rl_train.jsonl",
    EMBEDDED_PAIRS_DATA: ASSETS / "arith_pairs.jsonl",
}
# The held-out pairs of an embedded set: used as its eval split unless the user gives
# data.eval_path (a fractional split of 70 pairs would test on trained questions' kin).
EMBEDDED_EVAL = {EMBEDDED_RL_DATA: ASSETS / "arith_rl_eval.jsonl",
                 EMBEDDED_PAIRS_DATA: ASSETS / "arith_pairs_eval.jsonl"}

# The longest JSONL line read. A training row is at most a few max_seq_len of text (tens
# of kB); a line far beyond that is a file that is not row data (a dump, a binary), and
# reading it whole would hold all of it in memory before any check could say so.
MAX_LINE_BYTES = 8 * 2**20
# Rows rendered and tokenised together: large enough for the fast tokenizer's batching,
# small enough that the texts and token lists of one chunk are a few MB, whatever the
# file's length (engine/data/sft.py).
CHUNK_ROWS = 2048
# How often a long data check reports how far it got (Progress).
PROGRESS_EVERY_S = 1.0

# Documents (engine/data/documents.py): read as text and cut into token chunks for SFT.
DOCUMENT_TYPES = (".txt", ".md", ".markdown", ".rst", ".pdf", ".docx", ".html", ".htm")
# The files of a folder saved with `datasets` (Dataset / DatasetDict.save_to_disk): a folder
# with none of them is a folder of documents.
SAVED_MARKS = ("dataset_info.json", "state.json", "dataset_dict.json")

FORMATS = ("messages", "alpaca", "prompt_completion", "text", "rl", "pairs")
EXPECTED_COLUMNS = {
    "messages": "messages",
    "alpaca": "instruction, input (optional), output",
    "prompt_completion": "prompt, completion",
    "text": "text",
    "rl": "prompt, answer",
    "pairs": "prompt or messages, chosen, rejected",
}


# --------------------------------------------------------------------------- the report


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
    # Documents only: each file's {file, kind, chars, pages, chunks, tokens, split, dropped,
    # problem, notes}, and what the folder held that was not read.
    documents: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def summary(self) -> str:
        unit = "chunks" if self.documents else "rows"
        lines = [
            f"{self.file} ({self.format}): {self.rows_kept} of {self.rows_total} {unit} kept"
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
        if self.documents:
            lines.append(documents_table(self.documents))
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def documents_table(entries: list[dict]) -> str:
    """One line per file: what was read of it, or why nothing was."""
    width = min(48, max(len(e["file"]) for e in entries))
    out = [f"  {'file':{width}}  {'pages':>5}  {'chars':>9}  {'chunks':>6}  {'tokens':>8}  split"]
    for e in entries:
        pages = str(e["pages"]) if e["pages"] else "-"
        what = e["problem"] or e["split"]
        extra = [f"{n} dropped: {why}" for why, n in e["dropped"].items()] + list(e["notes"])
        out.append(f"  {e['file']:{width}}  {pages:>5}  {e['chars']:>9,}  {e['chunks']:>6}  {e['tokens']:>8,}  {what}"
                   + (f" ({'; '.join(extra)})" if extra else ""))
    return "\n".join(out)


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
    if not p.is_dir() and not p.is_file():
        raise DataError("not a regular file (a device, pipe or socket); give a data file or folder", file=path)
    if p.is_file() and not os.access(p, os.R_OK):
        raise DataError("file is not readable (permissions)", file=path)
    return str(p)


def is_documents(path: str, include: str = "") -> bool:
    """Whether `path` is documents (engine/data/documents.py) rather than rows: a document
    file (DOCUMENT_TYPES, or a name `include`'s comma-separated globs match), or a folder
    that is not a saved dataset."""
    import fnmatch

    if not path or path.startswith("embedded:"):
        return False
    p = Path(path).expanduser()
    if p.is_dir():
        return not any((p / mark).is_file() for mark in SAVED_MARKS)
    return p.name.lower().endswith(DOCUMENT_TYPES) or any(
        fnmatch.fnmatch(p.name, g.strip()) for g in include.split(",") if g.strip())


def _kind(p: Path) -> str:
    if p.is_dir():
        return "saved"
    name = p.name.lower()
    for suffix, kind in ((".jsonl", "json"), (".ndjson", "json"), (".json", "json"), (".csv", "csv"),
                         (".tsv", "csv"), (".parquet", "parquet"), (".pq", "parquet")):
        if name.endswith(suffix) or name.endswith(suffix + ".gz"):
            return kind
    if name.endswith(DOCUMENT_TYPES):
        raise DataError("unknown file type for rows: a document trains with SFT only (continued pretraining); "
                        "this method needs rows (.jsonl, .json, .csv, .parquet)", file=str(p))
    raise DataError("unknown file type (expected .jsonl, .json, .csv, .parquet, a saved dataset folder, or for "
                    "SFT documents: " + " ".join(DOCUMENT_TYPES) + " or a folder of them)", file=str(p))


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
            if len(line) > MAX_LINE_BYTES:
                raise DataError(_too_long(), file=shown, row=n)
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON on line {n}: {_json_problem(e, line)}", file=shown, row=n) from None
            except RecursionError:
                raise DataError(_TOO_DEEP, file=shown, row=n) from None
    for i, r in enumerate(rows, start=1):
        if not isinstance(r, dict):
            raise DataError(f"expected a JSON object per row, got {type(r).__name__}", file=shown, row=i)
    return rows


_TOO_DEEP = "JSON nested too deeply to read (thousands of levels of [ or {)"


def _json_problem(e: json.JSONDecodeError, line: str) -> str:
    """What is wrong with one line of JSON: a line that ends before its object does (a file
    cut short, a row split over two lines) is said so, not as the parser's next expectation."""
    if e.msg.startswith("Unterminated string") or e.pos >= len(line.rstrip()):
        return "the line ends before its JSON object does (cut short, or a row split over lines?)"
    return f"{e.msg} (column {e.colno})"


def _too_long() -> str:
    return (f"the line is longer than {MAX_LINE_BYTES / 2**20:g} MiB, the limit for one row "
            "(is this a file of JSON rows?)")


class Progress:
    """How far a long data check got: `callback(rows, bytes_read, bytes_total)` at most every
    PROGRESS_EVERY_S seconds, and at the end (`final`) when it reported before: a check
    that takes less than that says nothing. The bytes are those of a JSONL file read line
    by line (on disk: compressed for .gz); 0 when the file is read whole."""

    def __init__(self, callback=None):
        self.callback = callback
        self.read = self.total = 0
        self._last = time.monotonic()
        self._reported = False

    def rows(self, n: int, final: bool = False) -> None:
        now = time.monotonic()
        if self.callback is not None and (self._reported if final else now - self._last >= PROGRESS_EVERY_S):
            self._last, self._reported = now, True
            self.callback(n, self.read, self.total)


def _is_jsonl(p: Path) -> bool:
    """A .jsonl / .ndjson file of rows, not one JSON document (a [ ... ] array)."""
    name = p.name.lower().removesuffix(".gz")
    if not name.endswith((".jsonl", ".ndjson")):
        return False
    opener = gzip.open if p.name.lower().endswith(".gz") else open
    try:
        with opener(p, "rb") as f:
            for _ in range(16):  # the first MiB: a file that is blank that far is read line by line
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                head = chunk.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()
                if head:
                    return not head.startswith(b"[")
    except (OSError, EOFError):
        return True  # the line reader names the problem
    return True


def _jsonl_rows(p: Path, shown: str, progress: Progress):
    """The rows of a JSONL file, one line in memory at a time; a row is numbered by its line."""
    try:
        raw = open(p, "rb")
    except PermissionError:
        raise DataError("file is not readable (permissions)", file=shown) from None
    progress.total = os.fstat(raw.fileno()).st_size
    f = gzip.GzipFile(fileobj=raw, mode="rb") if p.name.lower().endswith(".gz") else raw
    with raw, f:
        n = kept = 0
        while True:
            try:
                line = f.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError) as e:  # a damaged or cut-off .gz
                raise DataError(f"cannot read: {e}", file=shown, row=n + 1) from None
            if not line:
                return
            n += 1
            progress.read = raw.tell()
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                raise DataError(_too_long(), file=shown, row=n)
            try:
                text = line.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark is not data
            except UnicodeDecodeError as e:
                raise DataError(f"not UTF-8 text ({e.reason} at byte {e.start} of the line)", file=shown,
                                row=n) from None
            if not text.strip():
                progress.rows(kept)  # a long run of blank lines says how far it got too
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON on line {n}: {_json_problem(e, text)}", file=shown,
                                row=n) from None
            except RecursionError:
                raise DataError(_TOO_DEEP, file=shown, row=n) from None
            if not isinstance(row, dict):
                raise DataError(f"expected a JSON object per row, got {type(row).__name__}", file=shown, row=n)
            kept += 1
            yield row


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
    return list(iter_rows(path, max_rows))


def iter_rows(path: str, max_rows: int = 0, progress: Progress | None = None):
    """The raw rows one at a time: a JSONL file is read line by line (bounded memory, and
    `progress` learns how far), any other file whole."""
    shown = path
    p = Path(resolve_data_path(path))
    kind = _kind(p)
    if p.is_file() and p.stat().st_size == 0:
        raise DataError("the dataset is empty (the file has 0 bytes)", file=shown)
    progress = progress or Progress()
    rows = _jsonl_rows(p, shown, progress) if kind == "json" and _is_jsonl(p) else _read_whole(p, kind, shown,
                                                                                                max_rows)
    n = 0
    for row in rows:
        yield row
        n += 1
        if n == max_rows:
            break
    if n == 0:
        raise DataError("the dataset is empty (no rows)", file=shown)


def _read_whole(p: Path, kind: str, shown: str, max_rows: int) -> list[dict]:
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
                raise DataError("a folder of rows must be a dataset saved with Dataset.save_to_disk (a folder of "
                                "documents trains with SFT only)", file=shown) from None
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
                raise DataError(f"cannot read as {kind}: {type(e).__name__}: {reason_line(str(e))}",
                                file=shown) from None
    except PermissionError:
        raise DataError("file is not readable (permissions)", file=shown) from None
    if max_rows:
        ds = ds.select(range(min(max_rows, len(ds))))
    return ds.to_list()


def detect_format(rows: list[dict], path: str) -> str:
    """Which of FORMATS the rows are in, from the columns of the first row."""
    if not rows:
        raise DataError("the dataset is empty (no rows)", file=path)
    cols = set(rows[0])
    if {"chosen", "rejected"} <= cols:
        return "pairs"
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


def preview(path: str, fmt: str = "auto", n: int = 20, progress=None) -> tuple[list[dict], str]:
    """First rows and the detected (or given) format, for the UI's table; for documents,
    ([], "documents"): their chunks need the tokenizer (engine/data/documents.preview_chunks).
    `progress` (as Progress's callback) hears how far a long read for them got (a file of
    blank lines)."""
    if is_documents(path):
        resolve_data_path(path)
        return [], "documents"
    rows = list(iter_rows(path, n, Progress(progress)))
    return rows, detect_format(rows, path) if fmt == "auto" else fmt


# --------------------------------------------------------------------------- row checks


def text_cell(row: dict, col: str, file: str, n: int, required: bool = True) -> str:
    """A column as a string; numbers (CSV, JSON) become their text."""
    if col not in row or row[col] is None:
        if required:
            raise DataError(f"missing '{col}' (columns: {sorted(row)})", file=file, row=n)
        return ""
    v = row[col]
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise DataError(f"'{col}' must be a string, got {type(v).__name__}", file=file, row=n)
    return v if isinstance(v, str) else str(v)


def messages_cell(value: Any, col: str, file: str, n: int) -> list[dict]:
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


# --------------------------------------------------------------------------- split + report


def split_rows(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Seeded held-out share; at least one eval row when asked for and possible.
    Both halves keep file order (the training loop shuffles)."""
    n = len(items)
    if eval_fraction <= 0 or n < 2:
        return list(items), []
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    held = set(random.Random(seed).sample(range(n), n_eval))
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def length_stats(lengths: list[int], bins: int = 20) -> tuple[dict, dict]:
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


def eval_source(ds: DataSettings) -> str:
    if ds.eval_path:
        return ds.eval_path
    return str(EMBEDDED_EVAL[ds.path]) if ds.path in EMBEDDED_EVAL else ""


def format_for(rows: list[dict], ds: DataSettings, file: str) -> str:
    if ds.format != "auto":
        if ds.format not in FORMATS:
            raise DataError(f"unknown format '{ds.format}' (known: {', '.join(FORMATS)})", file=file)
        return ds.format
    return detect_format(rows, file)


def report_dict(report: ValidationReport) -> dict:
    return dataclasses.asdict(report)
