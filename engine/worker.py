"""The process that trains one run: `python -m edgetune.engine.worker RUN_DIR [--resume]`.

Started by engine/api.py in its own process session, so the UI (or the CLI) never holds
the training stack, and a crash of either side loses nothing: everything the worker
knows goes to the run folder. SIGTERM asks for a graceful stop (finish the step, save
the adapter), like the STOP file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback

import yaml

from .errors import EdgetuneError
from .events import EventWriter, read_events
from .runfolder import RunDir, atomic_write_text, clean_temporaries, disk_full
from .settings import from_dict

METHOD_MODULES = {"sft": "sft", "fgrpo": "fgrpo", "essa": "essa"}
HEARTBEAT_SECONDS = 1.0


def start_heartbeat(run: RunDir) -> threading.Event:
    """Write `memory.json` (time, GPU and host memory) every second from a side thread,
    so the app's memory panel moves even while one step takes a minute (or while the
    model is still loading). Events stay the record; this file is only the live gauge."""
    from . import memory

    done = threading.Event()

    def beat():
        while not done.wait(HEARTBEAT_SECONDS):
            try:
                atomic_write_text(run.memory_path, json.dumps({"time": time.time(), **memory.snapshot()}))
            except Exception:  # a full disk must not kill training from a side thread
                pass

    threading.Thread(target=beat, name="edgetune-heartbeat", daemon=True).start()
    return done


def method_module(method: str):
    return importlib.import_module(f".{METHOD_MODULES[method]}", __package__)


def run(run_dir: str, resume: bool = False) -> int:
    run = RunDir(run_dir).require()
    clean_temporaries(run.path)  # what a write killed mid-way left (this process is the run's only writer)
    emit = EventWriter(run.events_path)
    atomic_write_text(run.pid_path, str(os.getpid()))
    from .loop import RunContext, pick_checkpoint

    ctx = None
    beat = start_heartbeat(run)
    try:
        cfg = from_dict(yaml.safe_load(run.config_path.read_text()))
        ckpt = last = None
        if resume:
            last = pick_checkpoint(run, lambda m: emit("warning", message=m))
            ckpt = last[1] if last else None
        run.clear_stop()
        ctx = RunContext(cfg=cfg, run=run, emit=emit, resume=ckpt)
        signal.signal(signal.SIGTERM, lambda *_: ctx.stop_flag.__setitem__(0, True))
        from .model import resolve_device

        emit("started", method=cfg.method, run=run.name, config=cfg.to_dict(), device=resolve_device(cfg.model),
             resumed_from=last[0] if resume and last else None, pid=os.getpid())
        method_module(cfg.method).train(ctx)
        return 0
    except EdgetuneError as e:
        emit("error", message=str(e), kind="input")
        return 2
    except KeyboardInterrupt:
        emit("error", message="interrupted", kind="killed")
        return 130
    except BaseException as e:  # a bug: keep the traceback in worker.log, one line in events
        traceback.print_exc()
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(e, torch.OutOfMemoryError) and ctx is not None:
            from .oom import advice

            steps = [ev for ev in read_events(run.events_path) if ev["type"] == "step"]
            last = run.last_checkpoint()
            emit("error", message=advice(ctx.cfg, steps[-1]["step"] if steps else 0, last[0] if last else None),
                 kind="input")
            return 2
        if disk_full(e):  # the user's condition, not ours
            where = getattr(e, "filename", None) or run.path
            emit("error", message=f"no space left on {where}: free some space, then edgetune resume {run.path}",
                 kind="input")
            return 2
        first = str(e).splitlines()[0] if str(e) else ""
        emit("error", message=f"internal error: {type(e).__name__}: {first} (traceback in {run.log_path})",
             kind="bug")
        return 1
    finally:
        beat.set()
        emit.close()
        try:
            run.pid_path.unlink()
        except FileNotFoundError:
            pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="edgetune-worker")
    p.add_argument("run_dir")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    return run(a.run_dir, a.resume)


if __name__ == "__main__":
    sys.exit(main())
