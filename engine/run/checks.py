"""Checks the app runs before a run starts, in a fresh subprocess.

Validating data needs the model's tokenizer (transformers, which loads torch); the UI
process must not, so it calls `isolated()`,
which runs `python -m edgetune.engine.run.checks` with the settings as JSON on stdin and
reads one JSON answer from stdout. A problem with the user's input comes back as
{"ok": false, "error": <one line>}, never as a traceback.

    check_data(cfg)  -> preview rows, detected format, the ValidationReport, and every
                        bad row found (row number + problem), not only the first; for
                        documents, each file's line and the first chunks
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from edgetune.engine.core.errors import DataError, EdgetuneError
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.threads import worker_env

MAX_BAD_ROWS = 20


# --------------------------------------------------------------------------- in the subprocess


def _jsonable_rows(rows: list[dict]) -> list[dict]:
    # Preview cells are shown as text; nested values (messages lists) as compact JSON.
    return [{k: v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v, ensure_ascii=False)
             for k, v in r.items()} for r in rows]


def _bad_json_lines(path: Path) -> list[dict]:
    """Every malformed line of a JSONL file (the loader stops at the first), read line by
    line; a line over the loader's limit ends the search (engine/data/files.MAX_LINE_BYTES)."""
    from edgetune.engine.data.files import MAX_LINE_BYTES

    bad = []
    try:
        with open(path, "rb") as f:
            n = 0
            while line := f.readline(MAX_LINE_BYTES + 1):
                n += 1
                if n == 1 and line.lstrip().startswith(b"["):
                    return bad
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    bad.append({"row": n, "problem": f"the line is longer than {MAX_LINE_BYTES / 2**20:g} MiB"})
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.decode("utf-8-sig" if n == 1 else "utf-8"))
                except UnicodeDecodeError as e:
                    bad.append({"row": n, "problem": f"not UTF-8 text ({e.reason})"})
                except json.JSONDecodeError as e:
                    bad.append({"row": n, "problem": f"malformed JSON: {e.msg} (column {e.colno})"})
                else:
                    if not isinstance(row, dict):
                        bad.append({"row": n, "problem": f"expected a JSON object, got {type(row).__name__}"})
                if len(bad) >= MAX_BAD_ROWS:
                    break
    except OSError:
        return bad
    return bad


def check_data(cfg) -> dict:
    from edgetune.engine.models import model as model_lib

    from edgetune.engine import data as d

    ds = cfg.data
    out: dict = {"ok": False, "file": ds.path, "format": None, "preview": [], "report": None, "bad_rows": []}
    try:
        rows, fmt = d.preview(ds.path, ds.format, 20)
        out["preview"], out["format"] = _jsonable_rows(rows), fmt
    except DataError as e:
        out["error"] = str(e)
        p = Path(ds.path).expanduser()
        if p.is_file() and p.name.lower().endswith((".jsonl", ".ndjson", ".json")):
            out["bad_rows"] = _bad_json_lines(p)
        return out
    tokenizer = None
    needs_tokenizer = RECORDS[cfg.method].data != "prompts" or not ds.path.startswith("embedded:")
    if needs_tokenizer:
        tokenizer = model_lib.load_tokenizer(model_lib.resolve_model_path(cfg.model.name))
    try:
        data = d.load_for(cfg.method, ds, tokenizer, cfg.run.seed)
        report = data.report
        out.update(ok=True, report=d.report_dict(report), summary=report.summary())
        if fmt == d.documents.FORMAT:  # documents: the first chunks, as the model reads them
            out["preview"] = d.documents.preview_chunks(data, tokenizer)
    except DataError as e:
        out["error"] = str(e)
        try:
            rows = d.iter_rows(ds.path, ds.max_rows)  # one row at a time: a long file stays out of memory
            first = next(rows)
            fmt = d.format_for([first], ds, ds.path)
            out["bad_rows"] = d.bad_rows(itertools.chain([first], rows), fmt, cfg.method, ds, tokenizer,
                                         limit=MAX_BAD_ROWS)
        except DataError:
            pass
    return out


CHECKS = {"data": check_data}


def main() -> int:
    from edgetune.engine.core.settings import from_dict

    request = json.loads(sys.stdin.read())
    # Libraries print progress and warnings on stdout; keep it for the one JSON answer.
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        result = CHECKS[request["check"]](from_dict(request["config"]))
    except EdgetuneError as e:
        result = {"ok": False, "error": str(e)}
    with os.fdopen(answer_fd, "w") as f:
        f.write(json.dumps(result, default=str))
    return 0


# --------------------------------------------------------------------------- in the caller


def isolated(check: str, config: dict, timeout: float = 300) -> dict:
    """Run one check in a fresh Python process; returns its JSON answer."""
    env = worker_env(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "edgetune.engine.run.checks"],
                              input=json.dumps({"check": check, "config": config}), capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the {check} check took longer than {timeout:.0f} s"}
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"the {check} check failed: {last}"}


if __name__ == "__main__":
    sys.exit(main())
