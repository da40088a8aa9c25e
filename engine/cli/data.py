"""`edgetune data`: check a data file and print its report."""

from __future__ import annotations

import sys

from edgetune.engine.core.settings import DataSettings, ModelSettings

from edgetune.engine.models import model as model_lib

from edgetune.engine import data as data_lib


def cmd_data(a) -> int:
    ds = DataSettings(path=a.path, format=a.format, max_seq_len=a.max_seq_len, include=a.include,
                      exclude=a.exclude, chunk_overlap=a.chunk_overlap)
    tty, shown = sys.stderr.isatty(), []

    def progress(rows: int, read: int, total: int) -> None:  # a long file: how far the check got
        shown.append(rows)
        done = f" ({read / 2**20:.0f} of {total / 2**20:.0f} MiB)" if total else ""
        print(f"{chr(13) if tty else ''}checking {a.path}: {rows:,} rows{done}", end="" if tty else "\n",
              file=sys.stderr, flush=True)

    fmt = data_lib.preview(a.path, a.format, 1, progress)[1]
    if fmt == "rl":
        report = data_lib.load_rl(ds, 0, progress=progress, lengths_only=True).report
    else:
        tok = model_lib.load_tokenizer(model_lib.resolve_model_path(a.model or ModelSettings().name))
        load = data_lib.load_pairs if fmt == "pairs" else data_lib.load_sft
        report = load(ds, tok, 0, progress, lengths_only=True).report
    if tty and shown:
        print(file=sys.stderr)  # ends the \r line
    print(report.summary())
    return 0


def add_parser(sub) -> None:
    """`edgetune data`'s flags."""
    d = sub.add_parser("data", help="validate a data file, or read a folder of documents, and print its report")
    d.add_argument("path")
    d.add_argument("--format", default="auto")
    d.add_argument("--max-seq-len", default=512)
    d.add_argument("--include", default="", help="documents: more files to read as text (globs, comma-separated)")
    d.add_argument("--exclude", default="", help="documents: files not to read (globs, comma-separated)")
    d.add_argument("--chunk-overlap", default=0, help="documents: tokens each chunk repeats from the one before")
    d.add_argument("--model", help="tokenizer of this model (default: the embedded one)")
    d.set_defaults(fn=cmd_data)
