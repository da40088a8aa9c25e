"""`edgetune export`: a run's adapter to a folder or a .zip (merged, GGUF)."""

from __future__ import annotations

import json
import signal
import sys

from edgetune.engine.models.export_gguf import CHECK_FILE, check_line

from edgetune.engine.run import api

from edgetune.engine.cli.common import run_arg


def cmd_export(a) -> int:
    a.run = run_arg(a.run, a.runs_dir)
    # SIGTERM ends through the export's cleanup (its temporary folder removed), as Ctrl-C does
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        out = api.export(a.run, a.out, merged=a.merged, as_zip=a.zip, force=a.force, gguf=a.gguf)
    finally:
        signal.signal(signal.SIGTERM, before)
    print(f"exported to {out}")
    if a.gguf:
        print(check_line(json.loads((out / "gguf" / CHECK_FILE).read_text())))
    return 0


def add_parser(sub) -> None:
    """`edgetune export`'s flags."""
    e = sub.add_parser("export", help="copy a run's adapter (PEFT format) to a new or empty folder")
    e.add_argument("run", help="a run folder, an adapter folder, or a run name as `edgetune runs` prints it")
    e.add_argument("--out", required=True,
                   help="a new folder; with --zip a file (.zip added when it has no extension; into an existing "
                        "folder: <run name>.zip there)")
    e.add_argument("--runs-dir", default="runs", help="where run names are looked up")
    e.add_argument("--merged", action="store_true", help="also fold the adapter into a bf16 copy of the base")
    e.add_argument("--zip", action="store_true", help="write a .zip instead of a folder")
    e.add_argument("--gguf", action="store_true",
                   help="also write gguf/: the LoRA as a llama.cpp GGUF adapter and an Ollama Modelfile; with "
                        "--merged, the merged model as F16 and Q8_0 GGUF (instead of merged/); checked in llama.cpp "
                        "when llama-cpp-python is installed (gguf/gguf-check.json)")
    e.add_argument("--force", action="store_true",
                   help="replace a previous export at --out (never anything else: a non-empty folder or a file "
                        "that an export did not write is refused)")
    e.set_defaults(fn=cmd_export)
