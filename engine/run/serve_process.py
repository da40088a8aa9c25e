"""The server the app starts: `edgetune serve` in a process of its own, found again by a
reloaded page or a restarted app.

    <runs_dir>/.serve/
        pid         "PID START PORT": the server's process, when it started, its port
        serve.log   what it printed (its address and models once the base has loaded)

It serves the base and every finished run of the runs folder trained on that base, as the
command does (engine/run/serve.py), on 127.0.0.1 only. A pid file is trusted only for a
process whose command line is this server's on that port and that started when the file
says: a file planted in a copied runs folder signals no process and names no port.

Importing this module loads no torch: the server's process loads the model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from edgetune.engine.core.errors import RunError
from edgetune.engine.core.runfolder import atomic_write_text, open_append, our_process, process_start
from edgetune.engine.core.threads import worker_env

SERVE_DIR = ".serve"  # <runs_dir>/.serve
COMMAND = ("edgetune.engine.cli", "serve")
PORTS = (1024, 65535)  # no port that needs root


class Server:
    """The runs folder's server, as its pid file and log say; `process` when this app started it."""

    def __init__(self, runs_dir: str | os.PathLike, process: subprocess.Popen | None = None):
        self.path = Path(runs_dir) / SERVE_DIR
        self.process = process

    def _recorded(self) -> tuple[int, int, int] | None:
        try:
            pid, start, port = (int(x) for x in (self.path / "pid").read_text().split())
        except (OSError, ValueError):
            return None
        return pid, start, port

    def pid(self) -> int | None:
        """The server's pid while it runs (checked as the module says), else None."""
        rec = self._recorded()
        if rec is None:
            return None
        pid, start, port = rec
        return pid if our_process(pid, (*COMMAND, f"--port {port}"), start) else None

    def port(self) -> int | None:
        rec = self._recorded()
        return rec[2] if rec is not None and self.pid() is not None else None

    def alive(self) -> bool:
        if self.process is not None:  # ours: its exit status (and no zombie left)
            return self.process.poll() is None
        return self.pid() is not None

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port()}/v1"

    def models(self) -> list[str] | None:
        """The names it serves (GET /v1/models); None while the base still loads."""
        port = self.port()
        if port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                return [m["id"] for m in json.loads(r.read())["data"]]
        except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError):
            return None

    def last_line(self) -> str:
        """The log's last line (why a server that ended, ended)."""
        try:
            with open(self.path / "serve.log", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def stop(self) -> None:
        """Ask it to end (SIGTERM to its session: uvicorn shuts down, the model goes with it)."""
        pid = self.pid()
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if self.process is not None:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start(runs_dir: str | os.PathLike, base: str, quant: str, port) -> Server:
    """`edgetune serve --runs-dir RUNS --base BASE --quant QUANT --port PORT` in a session of
    its own, on 127.0.0.1; refused in one line while the runs folder's server runs."""
    from edgetune.engine.core.settings import Range, typed_number

    port = typed_number("port", port, Range(*PORTS))
    if quant not in ("nf4", "int8", "none"):
        raise RunError(f"quant: one of nf4, int8, none, not {quant!r}")
    if not base:
        raise RunError("the base model: give model.name on the Model tab")
    runs = Path(runs_dir).resolve()
    running = Server(runs)
    if running.alive():
        raise RunError(f"already serving at {running.url()}: stop it first")
    folder = runs / SERVE_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        log = open_append(folder / "serve.log")
    except OSError as e:
        raise RunError(f"{folder}: cannot write there ({e.strerror})") from None
    cmd = [sys.executable, "-m", *COMMAND, "--runs-dir", str(runs), "--base", base, "--quant", quant,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=worker_env(PYTHONUNBUFFERED="1"), cwd=str(runs))
    log.close()
    atomic_write_text(folder / "pid", f"{proc.pid} {process_start(proc.pid) or 0} {port}")
    return Server(runs, proc)
