"""The engine's public API: what the app and the CLI call. Light on purpose: importing
it loads no torch; the training stack lives in the worker process it starts.

    cfg = resolve(preset="sft-quickstart", overrides=["lora.r=32"])
    run = start(cfg)                      # spawns the worker, returns at once
    for ev in run.events(follow=True):   # replay from any index, then live
        ...
    run.stop()                            # graceful: finishes the step, saves the adapter
    run.kill()                            # immediate; the run is marked failed
    export(run.path, "my-adapter/")       # PEFT folder (or .zip)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Iterator

from edgetune.engine.core.config_files import read_run_yaml
from edgetune.engine.core.errors import ConfigError, EdgetuneError, RunError, os_errors_as_run_errors
from edgetune.engine.core.events import TERMINAL, follow, read_events, scan_events, started_config
from edgetune.engine.core.methods import METHODS
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.runfolder import (
    RunDir,
    atomic_write_text,
    changed_input,
    check_run_name,
    checkpoint_mismatch,
    exit_words,
    lock_runs_folder,
    open_append,
    our_process,
    pid_alive,
)
from edgetune.engine.core.settings import (  # noqa: F401
    GPUS,
    MORE_STEPS,
    Config,
    declared,
    load_run_config,
    resolve,  # (resolve: re-exported)
    resume_changes,
    typed_number,
)
from edgetune.engine.core.threads import worker_env

from edgetune.engine.run.eval_jobs import active_eval
from edgetune.engine.run.user_code import code_it_runs, confirm_code  # noqa: F401 (code_it_runs: re-exported)

ACTIVE = ("starting", "running")
UPLOADS = ".uploads"  # <runs_dir>/.uploads: the app's copies of the data files uploaded in the browser


class Run:
    """A handle on a run folder; works the same for a run this process started and for
    one found on disk after a restart."""

    def __init__(self, path: str | os.PathLike, process: subprocess.Popen | None = None):
        self.dir = RunDir(path)
        self.process = process

    @property
    def path(self) -> Path:
        return self.dir.path

    @property
    def name(self) -> str:
        return self.dir.name

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, status={self.status()!r})"

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return pid_alive(self.dir.read_pid())

    def status(self, events: list[dict] | None = None) -> str:
        """starting | running | finished | stopped | failed | crashed (`events`: the run's,
        when the caller has read them already)."""
        try:
            return self._status(_ending(read_events(self.dir.events_path) if events is None else events))
        except OSError:  # events.jsonl unreadable (a folder, no permission): the run is damaged, no other is
            return "damaged"

    def _status(self, ending: dict) -> str:
        """The status from what the events say of the run's end (`_ending`), and whether its
        worker lives."""
        if ending["ended"] is not None:
            return {"finished": "finished", "stopped": "stopped"}.get(ending["ended"], "failed")
        if self.alive():
            return "running" if ending["started"] else "starting"
        return "crashed" if ending["any"] or self.dir.pid_path.exists() else "failed"

    def death(self, returncode: int | None = None) -> str:
        """Why a `crashed` run's worker ended, in one line: its exit status or signal (known
        to the process that started it: this handle's, or `returncode`) and the last line
        of its worker.log."""
        if self.process is not None and self.process.poll() is not None:
            returncode = self.process.returncode
        pid = self.process.pid if self.process is not None else self.dir.read_pid()
        who = f"the worker (pid {pid})" if pid else "the worker"
        how = f" ({exit_words(returncode)})" if returncode is not None else ""
        last = self.dir.last_log_line()
        said = f"the last line of {self.dir.log_path}: {last}" if last else f"{self.dir.log_path} is empty"
        return f"{who} ended without a final event{how}; {said}"

    def events(self, start: int = 0, follow_live: bool = False, timeout: float | None = None) -> Iterator[dict]:
        """Events from index `start`; with `follow_live`, keep yielding new ones until the
        run ends (or `timeout` seconds pass)."""
        if not follow_live:
            yield from read_events(self.dir.events_path, start)
            return
        yield from follow(self.dir.events_path, start, alive=self.alive, timeout=timeout)

    def stop(self) -> None:
        """Graceful: the worker finishes its current step, saves the adapter, ends with `stopped`."""
        self.dir.request_stop()

    def kill(self) -> None:
        """Immediate. The worker cannot write, so the run is marked failed here."""
        pid = self.process.pid if self.process is not None else self.dir.read_pid()
        # (a pid read from worker.pid is signalled only when it is an edgetune process: the
        # file may be planted in a copied run folder, or its pid reused since)
        if pid and self.alive() and (self.process is not None or our_process(pid, ("edgetune",))):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            self.wait(10)
        if self.status() in ("running", "starting", "crashed"):
            from edgetune.engine.core.events import EventWriter

            w = EventWriter(self.dir.events_path)
            w.emit("error", message="killed by the user", kind="killed")
            w.close()
        try:
            self.dir.pid_path.unlink()
        except FileNotFoundError:
            pass

    def wait(self, timeout: float | None = None) -> str:
        t0 = time.time()
        while self.alive():
            if timeout is not None and time.time() - t0 > timeout:
                break
            time.sleep(0.1)
        return self.status()

    def config(self) -> dict:
        """The run's settings as its config.yaml holds them; a damaged file is a ConfigError
        naming it (and the line)."""
        return read_run_yaml(self.dir.config_path)

    def summary(self) -> dict:
        """The run as `edgetune runs` and the app's Runs table show it. A damaged run folder
        (its config.yaml or events.jsonl unreadable) is status `damaged`, and `message` names
        the file and the problem: one damaged folder never hides the others."""
        return self._summary(self._facts())

    def _summary(self, facts: dict) -> dict:
        """The summary from the run's files' facts (`_facts`, or the index's copy of them):
        only its status and whether it has an adapter are read again."""
        out = {k: v for k, v in facts.items() if k not in ("ending", "problem")}
        out["status"] = "damaged" if facts["problem"] else self._status(facts["ending"])
        out["has_adapter"] = (self.dir.adapter / "adapter_config.json").is_file()
        return out

    def _facts(self) -> dict:
        """What the run's config.yaml and events.jsonl say (one read of each)."""
        problem = None
        try:
            events, damaged = scan_events(self.dir.events_path)
        except OSError as e:
            (events, damaged), problem = ([], 0), f"{self.dir.events_path}: cannot read ({e.strerror})"
        try:
            cfg = self.config()
        except ConfigError as e:
            cfg, problem = {}, problem or str(e)
        last_step = next((e for e in reversed(events) if e["type"] == "step"), None)
        end = next((e for e in reversed(events) if e["type"] in TERMINAL), None)
        # the figures of the last attempt that measured any (an attempt that failed has none)
        measured = next((e for e in reversed(events) if e["type"] in TERMINAL and e.get("metrics")), None)
        model = cfg.get("model")
        record = METHODS.get(cfg.get("method")) if isinstance(cfg.get("method"), str) else None
        total = last_step.get("total") if last_step else record.total(cfg) if record else None
        return {
            "name": self.name, "path": str(self.path),
            "method": cfg.get("method") if isinstance(cfg.get("method"), str) else None,
            "model": model.get("name") if isinstance(model, dict) else None,
            "created": events[0]["time"] if events else None,
            "step": last_step["step"] if last_step else 0, "total": total,
            "metrics": (measured or {}).get("metrics", {}), "message": problem or (end or {}).get("message"),
            "helped": _helped(events),
            "damaged_event_lines": damaged, "problem": bool(problem), "ending": _ending(events),
        }


def _helped(events: list[dict]) -> str:
    """Did the run help: the words of the first `comparison` its last attempt recorded (its
    adapter against the base on the held-out split), or ""."""
    started = [e["i"] for e in events if e["type"] == "started"]
    since = started[-1] if started else -1
    return next((e.get("words") or "" for e in events if e["type"] == "comparison" and e["i"] > since), "")


def _ending(events: list[dict]) -> dict:
    """What the events say of the run's end: `ended` (the type of the terminal event of
    its last attempt, None while it has none), whether that attempt `started`, whether
    there are `any` events."""
    last = next((e for e in reversed(events) if e["type"] in TERMINAL), None)
    started = [e for e in events if e["type"] == "started"]
    # A resumed run appends a new `started` after an old terminal event.
    ended = last["type"] if last is not None and (not started or started[-1]["i"] < last["i"]) else None
    return {"ended": ended, "started": bool(started), "any": bool(events)}


INDEX_FILE = ".edgetune-runs-index.json"  # in a runs folder: each run's facts, by its files' size and time


def _stamp(run: Run) -> list:
    out = []
    for p in (run.dir.config_path, run.dir.events_path):
        try:
            st = p.stat()
            out.append([st.st_mtime_ns, st.st_size])
        except OSError:
            out.append(None)
    return out


def summaries(runs_dir: str | os.PathLike = "runs") -> list[dict]:
    """Every run's summary (Run.summary), newest first, for `edgetune runs` and the app's
    Runs table. What a run's config.yaml and events.jsonl say is kept in the runs folder's
    index (INDEX_FILE) with their sizes and times, and read again only for a run whose
    files changed: hundreds of runs list in a fraction of a second. The index is a cache:
    a damaged or foreign one is rebuilt, and a folder that cannot take it lists all the same."""
    import json

    d = Path(runs_dir)
    try:
        index = json.loads((d / INDEX_FILE).read_text())
        index = index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        index = {}
    fresh, out = {}, []
    for run in list_runs(d):
        stamp = _stamp(run)
        kept = index.get(run.name)
        facts = kept.get("facts") if isinstance(kept, dict) and kept.get("stamp") == stamp else None
        if not (isinstance(facts, dict) and facts.get("path") == str(run.path)
                and isinstance(facts.get("ending"), dict)):
            facts = run._facts()
        fresh[run.name] = {"stamp": stamp, "facts": facts}
        out.append(run._summary(facts))
    if fresh != index:
        try:
            atomic_write_text(d / INDEX_FILE, json.dumps(fresh))
        except OSError:
            pass
    return out


def _unique_name(runs_dir: Path, base: str) -> str:
    name, n = base, 1
    while (runs_dir / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def list_runs(runs_dir: str | os.PathLike = "runs") -> list[Run]:
    d = Path(runs_dir)
    if not d.is_dir():
        return []
    # (a hidden folder is no run: run names never start with '.', temporaries do)
    runs = [Run(p) for p in d.iterdir() if not p.name.startswith(".") and (p / "config.yaml").is_file()]
    return sorted(runs, key=lambda r: r.dir.config_path.stat().st_mtime, reverse=True)


def active_run(runs_dir: str | os.PathLike = "runs") -> Run | None:
    return next((r for r in list_runs(runs_dir) if r.status() in ACTIVE), None)


def _spawn(run: RunDir, resume: bool, lock_fd: int, gpus: int = 1) -> subprocess.Popen:
    """gpus > 1: the worker is a launcher that runs torchrun with one rank a GPU (on a
    machine without CUDA, that many CPU processes over gloo: for tests)."""
    # An earlier attempt's STOP (it stopped, or a Stop came after its end) must not stop this
    # one; cleared here, before the worker exists, so that a Stop pressed while this attempt
    # starts is kept: the worker honours it at its first check.
    run.clear_stop()
    log = open_append(run.log_path)  # never through a symbolic link
    cmd = [sys.executable, "-m", "edgetune.engine.run.worker", str(run.path)] + (["--resume"] if resume else []) + \
        (["--nproc", str(gpus), "--lock-fd", str(lock_fd)] if gpus > 1 else [])
    env = worker_env(PYTHONUNBUFFERED="1")  # torch threads: engine/core/threads.py
    # Own session: a Ctrl-C in the terminal of the UI does not kill training, and
    # kill() can take the whole process group (data loader children included).
    # The worker inherits the runs folder's lock and holds it until it exits.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env, cwd=os.getcwd(), pass_fds=(lock_fd,))
    log.close()
    atomic_write_text(run.pid_path, str(proc.pid))
    return proc


def preflight(cfg: Config) -> None:
    """Checks that need no model or data loading, so that a typo fails before a run
    folder exists: the model path and the data files must be there, and no reward file
    may come from an upload."""
    from edgetune.engine.core.errors import DataError, ModelError

    from edgetune.engine.models.model import looks_like_path

    if not cfg.model.name.startswith("embedded:") and looks_like_path(cfg.model.name) \
            and not Path(cfg.model.name).expanduser().exists():
        raise ModelError(f"model path does not exist: {cfg.model.name}")
    for key in ("path", "eval_path"):
        value = getattr(cfg.data, key)
        if value and not value.startswith("embedded:") and not Path(value).expanduser().exists():
            raise DataError(f"data.{key}: file not found", file=value)
    check_reward_files(cfg)
    check_report_to(cfg.run.report_to)


def upload_folders(runs_dir: str | os.PathLike) -> list[Path]:
    """Where files sent through the app's page are kept: the app's copies in
    <runs_dir>/.uploads and Gradio's upload cache ($GRADIO_TEMP_DIR, else <tmp>/gradio, as
    gradio.utils.get_upload_folder has it; the engine does not import Gradio)."""
    gradio_cache = os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio"
    return [Path(runs_dir) / UPLOADS, Path(gradio_cache)]


def check_reward_files(cfg: Config) -> None:
    """A reward file is Python that the worker runs with the user's rights, so it is taken
    only from a path the user typed, never from a file someone sent through the app's
    upload: none may lie in an upload folder (as typed, or once links are followed)."""
    for section in (name for name, m in RECORDS.items() if m.rewards):
        value = getattr(cfg, section).reward_file
        if not value:
            continue
        p = Path(value).expanduser()
        for folder in upload_folders(cfg.run.runs_dir):
            if Path(os.path.abspath(p)).is_relative_to(os.path.abspath(folder)) or \
                    p.resolve().is_relative_to(folder.resolve()):
                raise ConfigError(f"{section}.reward_file {value}: lies in {folder}, where the app keeps uploaded "
                                  "files; a reward file runs as Python, so it is never taken from an upload: "
                                  "save it elsewhere and give that path")


# What brings each run.report_to backend's library (engine/run/tracking.py uses them).
REPORT_TO_INSTALL = {"tensorboard": "tensorboard", "mlflow": "edgetune[mlflow]", "wandb": "edgetune[wandb]"}


def check_report_to(backend: str) -> None:
    """One line when the library of `backend` is missing (a look-up: nothing is imported)."""
    import importlib.util

    from edgetune.engine.core.errors import ConfigError

    if backend in REPORT_TO_INSTALL and importlib.util.find_spec(backend) is None:
        raise ConfigError(f"run.report_to: {backend} is not installed (pip install {REPORT_TO_INSTALL[backend]})")


class RunsFolderBusy(RunError):
    """Another run holds the runs folder (one run at a time per runs folder)."""


# How long a start or resume waits for the runs folder's lock while no run is active: the
# last run's worker holds it until its process has exited, seconds after its final event
# (the interpreter's exit, a GPU's memory given back), and Resume is pressed as soon as the
# page says "stopped".
WAIT_FOR_ENDED_WORKER_S = 60.0


def _locked(runs_dir: Path) -> int:
    """The runs folder's lock (one active run per runs folder), or a one-line refusal."""
    deadline = time.time() + WAIT_FOR_ENDED_WORKER_S
    fd = lock_runs_folder(runs_dir)
    while fd is None:
        busy = active_run(runs_dir)
        grading = None if busy else active_eval(runs_dir)
        if busy or grading or time.time() > deadline:
            who = (f"run '{busy.name}' is still training" if busy else f"the evaluation {grading.name} is running"
                   if grading else "another run is starting")
            raise RunsFolderBusy(f"{who} in {runs_dir} (one run at a time per runs folder): stop it first")
        time.sleep(0.2)
        fd = lock_runs_folder(runs_dir)
    return fd


def start(cfg: Config, name: str | None = None, gpus: int = 1, job: str | None = None) -> Run:
    """Create `runs/<name>/` with the resolved config and start its worker; `gpus` > 1
    trains data-parallel on that many GPUs of this machine (engine/core/distributed.py).
    `job`: the token of the queued job this run is (create)."""
    gpus = typed_number("--gpus", gpus, GPUS)
    run, fd = create(cfg, name, job=job)
    try:
        return Run(run.path, _spawn(run, resume=False, lock_fd=fd, gpus=gpus))
    finally:
        os.close(fd)


def create(cfg: Config, name: str | None = None, job: str | None = None) -> tuple[RunDir, int]:
    """The new run folder with its config, and the runs folder's lock (an fd the caller
    closes once the worker holds it). `start` is this and a worker; under torchrun the
    CLI's rank 0 calls it and trains in its own process. The folder appears whole (built
    under a temporary name, then renamed). `job`: the token of the queued job this run is
    (engine/run/queue.py): written into the folder as it appears, which proves the job
    started; such a run takes exactly its name (the queue chose it), or is refused."""
    preflight(cfg)
    runs_dir = Path(cfg.run.runs_dir)
    auto = f"{cfg.method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    base = check_run_name(name if name is not None else (cfg.run.name or auto))  # a given name may not be empty
    fd = _locked(runs_dir)
    try:
        busy = active_run(runs_dir)  # a worker of a version that did not hold the lock
        if busy is not None:
            raise RunsFolderBusy(f"run '{busy.name}' is still training in {runs_dir} (one run at a time per runs "
                                 "folder): stop it first")
        if job is not None and (runs_dir / base).exists():
            raise RunError(f"{runs_dir / base} exists already: a queued run takes the name its queue gave it")
        run = RunDir(runs_dir / _unique_name(runs_dir, base))
        tmp = run.path.with_name(f".{run.name}.{uuid.uuid4().hex[:8]}.tmp")  # runfolder.clean_temporaries' names
        try:
            tmp.mkdir(parents=True)
            cfg.run.name = run.name
            atomic_write_text(tmp / "config.yaml", cfg.to_yaml())
            if job is not None:
                atomic_write_text(tmp / run.queue_job_path.name, job)
            os.rename(tmp, run.path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RunError(f"{run.path}: cannot create the run folder ({e.strerror})") from None
        return run, fd
    except BaseException:
        os.close(fd)
        raise


def more_steps(run: Run, cfg: Config, n: int) -> None:
    """Train a run `n` steps further: its config.yaml gets the new step count and the events
    a `more_steps` event (setting, from, to, schedule). The learning-rate schedule keeps the
    length it had before the first extension (`schedule`; engine/training/loop.make_scheduler), so the
    added steps train at its final rate. A finished run continues from its final checkpoint,
    which holds its optimizer state; one without it is refused. Call with the runs folder
    locked and the run not active."""
    from edgetune.engine.core.events import EventWriter, schedule_steps

    n = typed_number("--more-steps", n, MORE_STEPS)
    if RECORDS[cfg.method].more_steps:
        raise ConfigError(f"run '{run.name}' is an {RECORDS[cfg.method].label} run: {RECORDS[cfg.method].more_steps}")
    events = read_events(run.dir.events_path)
    end = next((e for e in reversed(events) if e["type"] in TERMINAL), None)
    if run.status() == "finished" and not run.dir.checkpoint(end["step"]).is_dir():
        raise RunError(f"run '{run.name}' finished without a checkpoint of its step {end['step']} (an older edgetune "
                       "kept none at the end), so its optimizer state is gone: start a new run with "
                       f"lora.init_from={run.dir.adapter} to train its adapter further")
    group = getattr(cfg, cfg.method)
    before = group.steps
    key = f"{cfg.method}.steps"
    steps = declared()[key].metadata["range"]
    if not steps.allows(before + n):
        raise ConfigError(f"--more-steps {n}: {key} would be {before + n}; {key} {steps.describe()}")
    schedule = schedule_steps(events) or before
    group.steps = before + n
    try:  # the worker's own check of what changed since the run started, before anything is written
        resume_changes(cfg, started_config(events), run.dir.config_path)
    except ConfigError:
        group.steps = before
        raise
    atomic_write_text(run.dir.config_path, cfg.to_yaml())
    w = EventWriter(run.dir.events_path)
    w.emit("more_steps", setting=f"{cfg.method}.steps", **{"from": before, "to": group.steps}, schedule=schedule)
    w.close()


def resume(path: str | os.PathLike, gpus: int | None = None, allow_code: list[str] | tuple[str, ...] = (),
           more: int | None = None) -> Run:
    """Continue a stopped, failed or crashed run from its last intact checkpoint (or from
    the start when it has none); new events are appended to the same events.jsonl.
    `more`: train that many steps past the run's step count, a finished run too
    (more_steps).
    `gpus`: ranks to continue on (checkpoints hold nothing rank-specific); None = as many
    as the run's last start had. `allow_code`: the reward files and models (as config.yaml
    names them) whose Python the user agrees to run; any other is refused (confirm_code).
    A run folder holding a symbolic link, a damaged config.yaml, or settings its newest
    checkpoint was not trained with is refused in one line before a worker starts."""
    gpus = None if gpus is None else typed_number("--gpus", gpus, GPUS)
    more = None if more is None else typed_number("--more-steps", more, MORE_STEPS)
    r = Run(path)
    r.dir.require().refuse_links()
    cfg = load_run_config(r.dir.config_path)
    confirm_code(r, cfg, allow_code)
    last = r.dir.last_checkpoint()
    mismatch = checkpoint_mismatch(cfg, last[1], r.dir.config_path) if last else None
    if mismatch:
        raise ConfigError(mismatch)
    resume_changes(cfg, started_config(read_events(r.dir.events_path)), r.dir.config_path)  # an edit it would ignore
    changed = changed_input(r.dir)  # the data or base it trained on, replaced since
    if changed:
        raise ConfigError(changed)
    fd = _locked(r.path.parent)
    try:
        status = r.status()
        if status in ACTIVE:
            raise RunError(f"run '{r.name}' is still {status}")
        if status == "finished" and more is None:
            raise RunError(f"run '{r.name}' already finished; edgetune resume {r.path} --more-steps N trains it "
                           "N steps further")
        busy = active_run(r.path.parent)
        if busy is not None:
            raise RunError(f"run '{busy.name}' is still training (one run at a time per runs folder): stop it first")
        if more is not None:
            more_steps(r, cfg, more)
        if gpus is None:
            started = [e for e in read_events(r.dir.events_path) if e["type"] == "started"]
            gpus = int(started[-1].get("world_size", 1)) if started else 1
        return Run(r.path, _spawn(r.dir, resume=True, lock_fd=fd, gpus=gpus))
    finally:
        os.close(fd)


TRASH = ".trash"  # <runs_dir>/.trash: runs deleted from the app or `trash_run`, restorable


def _idle_run(path: str | os.PathLike, doing: str) -> Run:
    if Path(path).name in ("", ".", ".."):  # the folder would be taken from under its own name
        raise RunError(f"{path}: name the run to {doing} by its name or path (edgetune runs lists them), not "
                       "'.' or '..'")
    r = Run(os.path.abspath(path))
    r.dir.require()
    status = r.status()
    if status in ACTIVE:
        raise RunError(f"run '{r.name}' is {status}: stop it before you {doing} it")
    return r


def _trash(runs_dir: Path, make: bool = False) -> Path:
    """<runs_dir>/.trash, refused in one line when it is not a folder of the runs folder's
    own (a file, or a link: a run moved through it would leave the runs folder)."""
    trash = Path(runs_dir) / TRASH
    if trash.is_symlink() or (trash.exists() and not trash.is_dir()):
        raise RunError(f"{trash}: not a folder of the runs folder ({'a link' if trash.is_symlink() else 'a file'}); "
                       "move it aside, and deleted runs go to a new trash")
    if make:
        trash.mkdir(exist_ok=True)
    return trash


@os_errors_as_run_errors
def trash_run(path: str | os.PathLike) -> Path:
    """Move a run folder (not a training one) into <runs_dir>/.trash/, whole and under its
    own name (a suffix if the trash holds one of that name); `restore_run` brings it back."""
    r = _idle_run(path, "delete")
    trash = _trash(r.path.parent, make=True)
    dest = trash / _unique_name(trash, r.name)
    os.rename(r.path, dest)
    return dest


def trashed_runs(runs_dir: str | os.PathLike = "runs") -> list[str]:
    """The names of the runs in <runs_dir>/.trash/, newest deletion first."""
    trash = _trash(Path(runs_dir))
    if not trash.is_dir():
        return []
    found = [p for p in trash.iterdir() if (p / "config.yaml").is_file()]
    return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]


@os_errors_as_run_errors
def restore_run(runs_dir: str | os.PathLike, name: str) -> Path:
    """A run of <runs_dir>/.trash/ back among the runs (a suffix if its name was taken since)."""
    src = _trash(Path(runs_dir)) / check_run_name(name)
    if not (src / "config.yaml").is_file():
        raise RunError(f"no run '{name}' in {Path(runs_dir) / TRASH}")
    dest = Path(runs_dir) / _unique_name(Path(runs_dir), name)
    os.rename(src, dest)
    return dest


@os_errors_as_run_errors
def rename_run(path: str | os.PathLike, new_name: str) -> Path:
    """Give a run folder (not a training one) a new name in the same runs folder; its
    config.yaml's run.name follows. Both change or neither: the config is written first (a
    full disk refuses it before the folder moves), and put back if the folder cannot move."""
    r = _idle_run(path, "rename")
    new_name = check_run_name(new_name)
    dest = r.path.parent / new_name
    if dest.exists():
        raise RunError(f"{dest} exists already: pick another name")
    text = r.dir.config_path.read_text()
    try:
        cfg = load_run_config(r.dir.config_path)
        cfg.run.name = new_name
        atomic_write_text(r.dir.config_path, cfg.to_yaml())
    except ConfigError:  # a damaged config.yaml keeps its text; the folder is renamed all the same
        pass
    try:
        os.rename(r.path, dest)
    except OSError:
        atomic_write_text(r.dir.config_path, text)
        raise
    return dest


def open_run(path: str | os.PathLike) -> Run:
    r = Run(path)
    r.dir.require()
    return r


def _refuse_a_training_run(p: Path) -> None:
    """A run that trains (a resumed one, too) holds the previous attempt's adapter, if any,
    until it ends: exporting it now would hand out a stale adapter under the run's name."""
    for run in (p, p.parent) if p.name == "adapter" else (p,):
        if (run / "config.yaml").is_file():
            status = Run(run).status()
            if status in ACTIVE:
                raise RunError(f"{run}: the run is {status}: its adapter is written when it ends (until then "
                               "adapter/ is missing or a previous attempt's); export after it stops or finishes")


def export(run_or_adapter: str | os.PathLike, out: str | os.PathLike, merged: bool = False,
           as_zip: bool = False, force: bool = False, isolated: bool = False, gguf: bool = False) -> Path:
    """`out` must be new or an empty folder; `force` replaces only a previous export.
    `isolated`: export in a fresh Python process, so that a merge (which loads torch and
    the full base model) leaves the caller torch-free and its memory as it was; errors
    come back as the same one-line errors."""
    from edgetune.engine.models.export import export as _export
    from edgetune.engine.models.export import export_isolated

    _refuse_a_training_run(Path(run_or_adapter))
    if merged or gguf:  # these read the base model: the one the run trained on
        p = Path(run_or_adapter)
        for run in (p, p.parent) if p.name == "adapter" else (p,):
            changed = changed_input(RunDir(run), only=("model.name",)) if (run / "config.yaml").is_file() else None
            if changed:
                raise RunError(changed)
    fn = export_isolated if isolated else _export
    return fn(run_or_adapter, out, merged=merged, as_zip=as_zip, force=force, gguf=gguf)


def hub_cache() -> Path:
    """Where Hugging Face keeps downloaded models, as huggingface_hub finds it (HF_HUB_CACHE,
    else HF_HOME/hub, else ~/.cache/huggingface/hub); read without importing it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def known_models() -> list[str]:
    """Models this machine has without a download, for the page's model picker: the embedded
    model, then every model in the Hugging Face cache (hub ids, a snapshot with a config.json)."""
    from edgetune.engine.core.settings import EMBEDDED_MODEL

    found = []
    cache = hub_cache()
    if cache.is_dir():
        for d in sorted(cache.glob("models--*")):
            if any((snap / "config.json").is_file() for snap in (d / "snapshots").glob("*")):
                found.append(d.name.removeprefix("models--").replace("--", "/"))
    return [EMBEDDED_MODEL, *found]


def gpu_count() -> int:
    """CUDA devices this machine shows (nvidia-smi, honouring CUDA_VISIBLE_DEVICES); no
    torch in the calling process. 0 without a GPU."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def estimate(cfg: Config, gpus: int = 1) -> dict:
    """Predicted peak memory of a configuration (engine/planning/planner.py); `gpus` > 1: of each
    GPU of a data-parallel run on that many."""
    from edgetune.engine.planning.planner import estimate as _estimate

    return _estimate(cfg, gpus=typed_number("--gpus", gpus, GPUS))


def longest_sequence(cfg: Config, gpu_total: int | None = None) -> list[dict]:
    """The longest data.max_seq_len of `cfg` that fits the card's memory (`gpu_total` bytes),
    or 24, 48 and 80 GiB when no card is known: as set and with each long-sequence lever it
    does not use yet (engine/planning/long_context.fit_rows); [] for a method whose step has
    no such levers."""
    from edgetune.engine.planning import long_context

    if not RECORDS[cfg.method].offload:
        return []
    return long_context.fit_rows(cfg, (gpu_total / 2**30,) if gpu_total else long_context.FIT_MEMORIES_GIB)


def time_estimate(cfg: Config, data_report: dict | None = None) -> dict:
    """Seconds of each phase of `cfg`'s run on this machine before it starts
    (engine/planning/timing.py): the initial evaluation, training, the final evaluation.
    data_report: check_data's "report" (its rows and mean tokens), read here when None;
    data that cannot be read leaves an upper bound (rows of data.max_seq_len tokens)."""
    from edgetune.engine.planning import timing

    if data_report is None:
        try:
            data_report = check_data(cfg).get("report")
        except EdgetuneError:
            data_report = None
    return timing.estimate(cfg, data_report if isinstance(data_report, dict) else None)


def check_data(cfg: Config) -> dict:
    """Preview, detected format, validation report and every bad row of `cfg.data`,
    computed in a subprocess (it needs the model's tokenizer). See engine/run/checks.py."""
    from edgetune.engine.run.checks import isolated

    return isolated("data", cfg.to_dict())


def chat_session(log_path: str | os.PathLike | None = None):
    """A handle on a chat worker process: base vs adapter replies (engine/generation/chat.py)."""
    from edgetune.engine.generation.chat import ChatSession

    return ChatSession(log_path)
