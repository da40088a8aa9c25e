"""The process that trains one run: `python -m edgetune.engine.run.worker RUN_DIR [--resume]`.

Started by engine/run/api.py in its own process session, so the UI (or the CLI) never holds
the training stack, and a crash of either side loses nothing: everything the worker
knows goes to the run folder. SIGTERM asks for a graceful stop (finish the step, save
the adapter), like the STOP file.

On several GPUs (`edgetune train --gpus N`) the process that engine/run/api.py starts is a
launcher (`--nproc N`): it runs `torchrun`, which starts N copies of this module, one a
GPU (engine/core/distributed.py). The run has one writer however it ends: torchrun holds
the runs folder's lock beside the launcher and dies with it, and the ranks die with
torchrun, so killing any of these processes ends them all (a dead rank: see below) and
the lock is free only once none of them can write. Rank 0 writes the run folder and watches the other ranks:
one that dies ends the run with an `error` event that names it. The launcher writes the
error itself when the ranks ended without one (rank 0 itself died): the rank, pid and exit
status torchrun reports as the first failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import traceback

from edgetune.engine.core.errors import ConfigError, EdgetuneError
from edgetune.engine.core.events import TERMINAL, EventWriter, read_events, schedule_steps, started_config
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.runfolder import (
    INPUTS_FILE,
    RunDir,
    atomic_write_text,
    cannot_write,
    changed_input,
    checkpoint_mismatch,
    clean_temporaries,
    disk_full,
    exit_words,
    inputs_unchecked,
    record_inputs,
)
from edgetune.engine.core.settings import cache_dir, from_dict, load_run_config, resume_changes
from edgetune.engine.core.threads import worker_env

from edgetune.engine.models import startup

HEARTBEAT_SECONDS = 1.0


def start_heartbeat(run: RunDir) -> threading.Event:
    """Write `memory.json` (time, GPU and host memory) every second from a side thread,
    so the app's memory panel moves even while one step takes a minute (or while the
    model is still loading). Events stay the record; this file is only the live gauge."""
    from edgetune.engine.core import memory

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
    """The module whose `train(ctx)` trains `method`: its record's `module`
    (settings.resolve refuses an unknown method before this)."""
    import importlib

    return importlib.import_module(RECORDS[method].module)


class _NoEvents:
    """The event writer of ranks other than 0: they report nothing themselves."""

    count = 0

    def emit(self, type: str, **fields) -> dict:
        return {"type": type, **fields}

    __call__ = emit

    def close(self) -> None:
        pass


class _LockedEvents:
    """Rank 0's writer shared with its rank watch (a side thread): one line at a time,
    and nothing after the watch has ended the run."""

    def __init__(self, writer: EventWriter):
        self.writer, self.lock, self.closed, self.ended = writer, threading.Lock(), False, False

    def emit(self, type: str, **fields) -> dict:
        with self.lock:
            if self.closed:
                return {"type": type, **fields}
            self.ended = self.ended or type in TERMINAL
            return self.writer.emit(type, **fields)

    __call__ = emit

    def final(self, type: str, **fields) -> bool:
        """Write a terminal event unless one was written; True when this call wrote it."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            if self.ended:
                return False
            self.writer.emit(type, **fields)
            return True

    def close(self) -> None:
        self.writer.close()


class RankWatch:
    """Rank 0 checks every second that the other ranks of its machine are alive; one that
    is gone ends the run at once with an error naming it (the collectives of the others
    would otherwise fail with a socket error, or wait on NCCL for minutes). Ranks on other
    machines are left to torchrun, which ends the job when one of them fails."""

    def __init__(self, emit: _LockedEvents, run: RunDir):
        from edgetune.engine.core import distributed as dist
        from edgetune.engine.core.runfolder import pid_alive

        self.emit, self.run, self.pid_alive = emit, run, pid_alive
        me = {"rank": dist.rank(), "pid": os.getpid(), "host": os.uname().nodename}
        self.peers = [p for p in dist.all_gather_object(me) if p["rank"] != 0 and p["host"] == me["host"]]
        self.done = threading.Event()
        if dist.is_main() and self.peers:
            threading.Thread(target=self._loop, name="edgetune-rank-watch", daemon=True).start()

    def dead(self) -> dict | None:
        return next((p for p in self.peers if not self.pid_alive(p["pid"])), None)

    def check(self) -> bool:
        """End the run naming a dead rank, if there is one; True when one was found."""
        p = self.dead()
        if p is None:
            return False
        kind, _, why = _rank_error(p["rank"]).partition("|")
        self.emit.final("error", kind=kind or "killed",
                        message=f"rank {p['rank']} (pid {p['pid']}) died{': ' + why if why else ''}; the run stopped "
                                f"(its output is in {self.run.log_path}); edgetune resume {self.run.path} continues "
                                "from the last checkpoint")
        return True

    def _loop(self) -> None:
        while not self.done.wait(1.0):
            if self.check():
                os._exit(1)  # the collectives of this rank may never return: torchrun ends the others

    def stop(self) -> None:
        self.done.set()


def _store():
    import torch.distributed as tdist

    return tdist.distributed_c10d._get_default_store()


def _rank_error(rank: int) -> str:
    """The one line a dead rank left in the process group's store before exiting."""
    try:
        store = _store()
        key = f"edgetune/error/{rank}"
        return store.get(key).decode() if store.check([key]) else ""
    except Exception:
        return ""


def _leave_error(kind: str, message: str) -> None:
    """A rank other than 0 that fails leaves its one-line error (and its kind) for rank 0."""
    from edgetune.engine.core import distributed as dist

    try:
        _store().set(f"edgetune/error/{dist.rank()}", f"{kind}|{message[:500]}")
    except Exception:
        pass


def run(run_dir: str, resume: bool = False, owns_pid: bool | None = None) -> int:
    """Train the run in `run_dir`. Under torchrun (several ranks) every rank calls this;
    rank 0 alone touches the run folder. `owns_pid`: write worker.pid (default: when
    this is the only process of the run)."""
    from edgetune.engine.core import distributed as dist

    multi = dist.init()
    main = dist.is_main()
    run = RunDir(run_dir)
    if main:
        run.require().refuse_links()  # before writing anything: api.resume refused them already, this is the backstop
        clean_temporaries(run.path)  # what a write killed mid-way left (this process is the run's only writer)
    emit = _LockedEvents(EventWriter(run.events_path)) if main else _NoEvents()
    owns_pid = (not multi) if owns_pid is None else owns_pid
    if owns_pid:
        atomic_write_text(run.pid_path, str(os.getpid()))
    ctx = watch = tracker = None
    changed = {}  # settings edited since the run's last start that this attempt applies
    beat = start_heartbeat(run) if main else threading.Event()
    startup.kernel_caches(cache_dir())  # before torch is imported: compiled kernels kept between runs
    startup.pause_gc()  # until the run's imports are done (engine/models/startup.py); back on in `finally` at the latest
    try:
        from edgetune.engine.training.loop import RunContext, pick_checkpoint

        if multi:
            watch = RankWatch(emit, run)
        data = load_run_config(run.config_path).to_dict() if main else None  # a damaged file: one line with its line
        cfg = from_dict(dist.broadcast_object(data))
        ckpt = last = None
        if resume:
            last = pick_checkpoint(run, lambda m: emit("warning", message=m)) if main else None
            mismatch = checkpoint_mismatch(cfg, last[1], run.config_path) if main and last else None
            if main and not mismatch:  # a setting edited since the last start: applied (recorded below) or refused
                try:
                    trained = started_config(read_events(run.events_path))
                    changed = {k: [a, b] for k, a, b in resume_changes(cfg, trained, run.config_path)}
                except ConfigError as e:
                    mismatch = str(e)
            mismatch = mismatch or (changed_input(run) if main else None)  # the data or base it trained on
            if dist.broadcast_object(mismatch):
                raise ConfigError(mismatch)
            last = dist.broadcast_object(last)
            ckpt = dist.share_folder(last[1]) if last else None  # other machines get a copy
        if main:  # (a STOP of an earlier attempt was removed before this worker started: api._spawn)
            unchecked = inputs_unchecked(run) if resume else None
            if unchecked:
                emit("warning", message=unchecked)
            if unchecked or not (run.path / INPUTS_FILE).is_file():  # checked at each resume and export
                record_inputs(run, cfg)
        # A run given more steps keeps its learning-rate schedule's length (engine/run/api.more_steps).
        schedule = dist.broadcast_object(schedule_steps(read_events(run.events_path)) if main else None)
        ctx = RunContext(cfg=cfg, run=run, emit=emit, resume=ckpt, schedule_steps=schedule)
        signal.signal(signal.SIGTERM, lambda *_: ctx.stop_flag.__setitem__(0, True))
        import torch

        from edgetune.engine.models.model import resolve_device

        extra = {"world_size": dist.world()} if multi else {}
        if changed:
            extra["changed"] = changed  # setting -> [the last start's value, this one's]
        emit("started", method=cfg.method, run=run.name, config=cfg.to_dict(),
             device=dist.device(resolve_device(cfg.model)), resumed_from=last[0] if resume and last else None,
             pid=os.getpid(), cpu_threads=torch.get_num_threads(), **extra)
        if main:  # the run's numbers mirrored into run.report_to (engine/run/tracking.py)
            from edgetune.engine.run.tracking import Tracker

            ctx.emit = tracker = Tracker(emit, cfg, run)
        import transformers  # noqa: F401  (the tokenizer and the model load need it first)

        from edgetune.engine.planning.long_context import refuse_too_long
        from edgetune.engine.planning.planner import refuse_far_beyond

        refuse_far_beyond(cfg, resolve_device(cfg.model), dist.world())  # a typo'd batch of 1e9 rows, before loading
        if dist.world() == 1:  # a sequence past the card's longest, with the lever that makes it fit
            refuse_too_long(cfg, resolve_device(cfg.model))

        train = method_module(cfg.method).train
        startup.remember_measurements(cache_dir())
        startup.imports_done()  # the collector back on, the imported objects out of its walks
        train(ctx)
        if multi:  # no rank leaves while rank 0 still writes (its watch would take that for a death)
            watch.stop()
            try:
                dist.barrier()
            except Exception:
                pass
        return 0
    except EdgetuneError as e:
        if multi and not main:
            _leave_error("input", str(e))
        emit("error", message=str(e), kind="input")
        return 2
    except KeyboardInterrupt:
        emit("error", message="interrupted", kind="killed")
        return 130
    except BaseException as e:  # a bug: keep the traceback in worker.log, one line in events
        traceback.print_exc()
        if multi and not main:
            _leave_error("bug", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
            return 1
        if watch is not None and (watch.check() or _wait_for_dead_peer(watch)):
            return 1  # a rank died: the collective failed because of it, and the error names it
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(e, torch.OutOfMemoryError) and ctx is not None:
            from edgetune.engine.planning.oom import advice

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
        if cannot_write(e):  # the run folder made read-only or unwritable under the run: the user's condition too
            where = getattr(e, "filename", None) or run.path
            emit("error", message=f"{where}: cannot write there ({getattr(e, 'strerror', None) or e}); make the run "
                                  f"folder writable, then edgetune resume {run.path}", kind="input")
            return 2
        first = str(e).splitlines()[0] if str(e) else ""
        emit("error", message=f"internal error: {type(e).__name__}: {first} (traceback in {run.log_path})",
             kind="bug")
        return 1
    finally:
        startup.resume_gc()
        beat.set()
        if tracker is not None:  # closed at the terminal event already, unless the run ended in an exception
            tracker.close(warn=False)
        if watch is not None:
            watch.stop()
        emit.close()
        if owns_pid:
            try:
                run.pid_path.unlink()
            except FileNotFoundError:
                pass
        if multi:
            dist.shutdown()


def _wait_for_dead_peer(watch: RankWatch, seconds: float = 3.0) -> bool:
    """A failed collective is usually a peer that died a moment ago; give its process
    the time to be gone (or a zombie) before calling the failure our own."""
    t0 = time.time()
    while time.time() - t0 < seconds:
        time.sleep(0.2)
        if watch.check():
            return True
    return False


# --------------------------------------------------------------------------- launcher


def _die_with_launcher() -> None:
    """torchrun's preexec: SIGKILL when the launcher dies (Linux's PDEATHSIG, kept through
    exec); the ranks die with torchrun in turn (engine/core/distributed.py)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher died before the prctl
        os._exit(1)


def launch(run_dir: str, resume: bool, nproc: int, lock_fd: int | None = None) -> int:
    """The process engine/run/api.py starts for a run on several GPUs: torchrun with one
    rank a GPU on this machine. SIGTERM asks the ranks for a graceful stop (the STOP
    file); when they end without a terminal event (rank 0 died), the error is written
    here. `lock_fd`: the runs folder's lock this process inherited, which torchrun holds
    too."""
    run = RunDir(run_dir).require().refuse_links()
    atomic_write_text(run.pid_path, str(os.getpid()))
    before = EventWriter(run.events_path)
    first = before.count
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        before.emit("error", kind="input", message=f"--gpus {nproc}: this machine has {torch.cuda.device_count()} "
                                                   "CUDA device(s)")
        before.close()
        run.pid_path.unlink(missing_ok=True)
        return 2
    before.close()
    signal.signal(signal.SIGTERM, lambda *_: run.request_stop())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "-m", "edgetune.engine.run.worker", str(run.path)] + \
          (["--resume"] if resume else [])
    env = worker_env(processes=nproc, PYTHONUNBUFFERED="1")  # each rank's torch threads: engine/core/threads.py
    import subprocess

    log_start = run.log_path.stat().st_size if run.log_path.is_file() else 0
    fds = (lock_fd,) if lock_fd is not None and _fd_open(lock_fd) else ()
    try:
        rc = subprocess.call(cmd, env=env, stdin=subprocess.DEVNULL, pass_fds=fds, preexec_fn=_die_with_launcher)
    except KeyboardInterrupt:
        rc = 130
    try:
        events = read_events(run.events_path, first)
        if not any(e["type"] in ("finished", "stopped", "error") for e in events):
            w = EventWriter(run.events_path)
            dead = _first_failure(run.log_path, log_start)  # rank 0 died: torchrun named it in worker.log
            if dead is not None:
                w.emit("error", kind="killed" if dead["exitcode"] < 0 else "bug",
                       message=f"rank {dead['rank']} (pid {dead['pid']}) died: {exit_words(dead['exitcode'])}; "
                               f"the run stopped (its output is in {run.log_path}); edgetune resume {run.path} "
                               "continues from the last checkpoint")
            else:
                last = run.last_log_line(log_start)
                w.emit("error", kind="bug" if rc > 0 else "killed",
                       message=f"the training processes ended without a final event (torchrun: {exit_words(rc)}); "
                               + (f"the last line of {run.log_path}: {last}" if last else f"{run.log_path} is empty"))
            w.close()
    finally:
        try:
            run.pid_path.unlink()
        except FileNotFoundError:
            pass
    return rc if rc >= 0 else 1


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


def _first_failure(log_path, start: int = 0, tail_bytes: int = 65536) -> dict | None:
    """{rank, exitcode, pid} of the rank torchrun names as the root cause of a failed job,
    from the summary it writes at its end (its stderr is worker.log, read from byte
    `start`: this attempt's part); None without one."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    root = text.rfind("Root Cause")
    m = _FAILURE.search(text, root) if root >= 0 else None
    return {"rank": int(m[1]), "exitcode": int(m[2]), "pid": int(m[3])} if m else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="edgetune-worker")
    p.add_argument("run_dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine (> 1: start them with torchrun)")
    p.add_argument("--lock-fd", type=int, help="the runs folder's lock, inherited: torchrun holds it too")
    a = p.parse_args(argv)
    if a.nproc > 1:
        return launch(a.run_dir, a.resume, a.nproc, a.lock_fd)
    return run(a.run_dir, a.resume)


if __name__ == "__main__":
    sys.exit(main())
