"""User data -> validated token rows (SFT) or prompt/answer rows (RL), with a report.

Three modules by concern, gathered here (callers import `engine.data`):

    engine/data/files.py   reading files: formats, encodings, embedded sets, row errors,
                           the train / held-out split and the ValidationReport
    engine/data/sft.py     SFT: conversations rendered (engine/data/prompts.py), tokenised,
                           prompts masked out of the labels; `collate`
    engine/data/rl.py      RL: prompt/answer rows, prompt lengths as the rollouts render them
    engine/data/pairs.py   preference pairs: a prompt, a chosen and a rejected reply, each
                           reply labelled as an SFT row
    engine/data/documents.py  documents (PDF, Word, HTML, text; a folder of them) read as
                           text, cut into token chunks that SFT trains on like `text` rows

Every row is checked before any training starts: a bad row is a one-line `DataError`
naming the file, the row and the problem; `bad_rows` names every bad row, not only the
first (the app's data check).
"""

from __future__ import annotations

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.methods import METHODS as RECORDS

from edgetune.engine.data import documents, sft
from edgetune.engine.data.documents import load_documents
from edgetune.engine.data.files import (
    DOCUMENT_TYPES,
    EMBEDDED,
    EMBEDDED_EVAL,
    EXPECTED_COLUMNS,
    FORMATS,
    ValidationReport,
    detect_format,
    format_for,
    is_documents,
    iter_rows,
    preview,
    read_rows,
    report_dict,
    resolve_data_path,
)
from edgetune.engine.data.pairs import PairData, PairExample, load_pairs, tokenize_pairs
from edgetune.engine.data.rl import DROP_LONG_PROMPT, TASK_FORMATS, RLData, load_rl, rl_rows, task_rows
from edgetune.engine.data.sft import (
    DROP_LONG,
    DROP_NO_TARGET,
    IGNORE,
    SFTData,
    SFTExample,
    collate,
    tokenize_rows,
)

__all__ = ["EMBEDDED", "EMBEDDED_EVAL", "EXPECTED_COLUMNS", "FORMATS", "IGNORE", "DROP_LONG", "DROP_NO_TARGET",
           "DROP_LONG_PROMPT", "ValidationReport", "SFTExample", "SFTData", "RLData", "read_rows", "iter_rows",
           "detect_format", "format_for", "preview", "resolve_data_path", "report_dict", "load_sft", "load_rl",
           "collate", "tokenize_rows", "rl_rows", "bad_rows", "PairData", "PairExample", "load_pairs",
           "tokenize_pairs", "load_for", "task_rows", "TASK_FORMATS", "DOCUMENT_TYPES", "is_documents", "documents",
           "load_documents"]


def load_sft(ds, tokenizer, seed: int, progress=None, lengths_only: bool = False) -> SFTData:
    """SFT's rows: demonstrations (engine/data/sft.py), or documents (a folder, a .pdf, ...)
    cut into token chunks (engine/data/documents.py). `lengths_only`: sft.load_sft's (a
    check of demonstrations; documents are read in bounded blocks already)."""
    if is_documents(ds.path, ds.include):
        return load_documents(ds, tokenizer, seed, progress)
    return sft.load_sft(ds, tokenizer, seed, progress, lengths_only)


def load_for(method: str, ds, tokenizer, seed: int, progress=None):
    """The method's rows (its record's `data`): checked, tokenised where they need a
    tokenizer, split, and reported."""
    kind = RECORDS[method].data
    if kind == "demonstrations":
        return load_sft(ds, tokenizer, seed, progress)
    if kind == "pairs":
        return load_pairs(ds, tokenizer, seed, progress)
    return load_rl(ds, seed, tokenizer)


def bad_rows(rows, fmt: str, method: str, ds, tokenizer, limit: int = 0) -> list[dict]:
    """Check rows (a list or an iterator) one at a time with the loaders' own row checks, so
    that every bad row is named (with its 1-based number), not only the first:
    [{"row": n, "problem": ...}], at most `limit` of them (0 = all)."""
    bad = []
    for n, row in enumerate(rows, start=1):
        try:
            stats = {"total": 0, "dropped": {}, "truncated": 0}
            if RECORDS[method].data == "demonstrations":
                tokenize_rows([row], fmt, tokenizer, ds, ds.path, stats)
            elif RECORDS[method].data == "pairs":
                tokenize_pairs([row], tokenizer, ds, ds.path, stats)
            else:
                rl_rows([row], fmt, ds, ds.path)
        except DataError as e:
            bad.append({"row": n, "problem": e.problem})
            if limit and len(bad) >= limit:
                break
    return bad
