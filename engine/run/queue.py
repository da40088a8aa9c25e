"""The queue: jobs that run one after another on the device, in order, and survive the app
or the machine restarting.

A job is a command and a folder: `edgetune <command>` run from the folder it was queued
in (`cwd`), which writes its results into `<runs_dir>/<folder>`. The folder appears whole
with the job's token in it (engine/run/api.create: `queue-job`), and that is the proof
that the job started: a queued job whose folder holds its token is never started again,
however the last driver ended; one whose folder never appeared is started (again). A job
that failed is recorded and the next one starts.

    <runs_dir>/.edgetune-queue.json   {"format", "next_id", "jobs": [...], "history": [...]}
    <runs_dir>/.queue/<token>.yaml    the settings of a queued run (removed once it is done)

Each edit of the queue file (add, cancel, move, a driver's start and end of a job) reads
it, changes it and writes it whole (atomic_write_text) under QUEUE_LOCK, held for that
edit only: the runs folder's own lock is held by a training worker for the whole run, and
the queue must take jobs while one trains. One driver at a time works the queue (the
app's process, or `edgetune queue run`): it holds DRIVER_LOCK while it does, and the
kernel drops that lock when the driver dies, so the next one continues where it stopped.

A kind of job is one entry of KINDS: the flags that make its command write into a given
folder, how its folder says the job ended, and what starts a folder that appeared but whose
work never did. Its command takes `--queue-job TOKEN`, makes its folder appear whole with
the token in it (as api.create does for a run) and holds the runs folder's lock while it
works (the device does one thing at a time); `add(runs_dir, kind, command, folder, cwd)`
queues one.

A runs folder may come from elsewhere, and its queue file with it: every job is checked as
it is read, exactly as when it was added (a plain run name, a command of the form `add_run`
makes, its settings in the queue's own folder), and a driver starts only the jobs this
machine's user queued, as a record outside the runs folder says (engine/core/consent.py:
the checksum of the job's command, folder and settings). Any other job waits, with one line
naming what it would run, until the user confirms it (`edgetune queue confirm N`).
A job's run is found by the token in its folder, not by its name: a run renamed since it
started is still that job's, and one deleted since is never started again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgetune.engine.core import consent
from edgetune.engine.core.errors import ConfigError, EdgetuneError, RunError, os_error_line
from edgetune.engine.core.runfolder import RunDir, atomic_write_text, check_run_name, lock_runs_folder, try_lock

from edgetune.engine.run import api

QUEUE_FILE = ".edgetune-queue.json"
QUEUE_LOCK = ".edgetune-queue.lock"  # held while the queue file is edited
DRIVER_LOCK = ".edgetune-queue-driver.lock"  # held by the one process that runs the queue; holds its pid
SPOOL = ".queue"  # <runs_dir>/.queue/<token>.yaml: a queued run's settings
FORMAT = 1
HISTORY = 50  # ended jobs kept in the queue file, newest last
POLL_SECONDS = 1.0  # how often a driver looks at a job that runs, or at an empty queue in the app


# --------------------------------------------------------------------------- kinds of job


def _train_outcome(folder: Path) -> tuple[str, str] | None:
    """A run's end: (status, message), or None while it trains."""
    run = api.Run(folder)
    status = run.status()
    if status in api.ACTIVE:
        return None
    if status == "crashed":
        return status, run.death()
    return status, run.summary().get("message") or ""


def _train_revive(folder: Path, job: dict) -> None:
    """The folder appeared but its worker never started (the driver ended in between):
    start it now (a resume without a checkpoint starts from step 0). The Python the run's
    settings name (a reward file) was accepted when it was queued: it is allowed again,
    and only that."""
    from edgetune.engine.core.settings import load_run_config

    spool = job.get("settings")
    allowed = [what for _, what in api.code_it_runs(load_run_config(spool))] if spool and Path(spool).is_file() else []
    api.resume(folder, allow_code=allowed)


@dataclass(frozen=True)
class Kind:
    label: str
    folder_args: Callable[[Path], list[str]]  # the flags that make the command write into this folder
    outcome: Callable[[Path], tuple[str, str] | None]  # (status, message) once ended; None while it works
    revive: Callable[[Path, dict], None] | None = None  # a folder that appeared but whose work never started


KINDS = {
    "train": Kind("run", lambda f: ["--name", f.name, "--runs-dir", str(f.parent), "--detach"],
                  _train_outcome, _train_revive),
}
FAILED = ("failed", "crashed", "damaged", "deleted")  # outcomes that mean the job did not do its work


# --------------------------------------------------------------------------- the file


def queue_path(runs_dir: str | os.PathLike) -> Path:
    return Path(runs_dir) / QUEUE_FILE


def _empty() -> dict:
    return {"format": FORMAT, "next_id": 1, "jobs": [], "history": []}


def read(runs_dir: str | os.PathLike) -> dict:
    """The queue file's contents (an empty queue when there is none); a damaged one, or
    one holding a job that `add_run` would not make, is a RunError naming it, never
    silently replaced."""
    p = queue_path(runs_dir)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return _empty()
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise RunError(f"{p}: the queue file cannot be read ({e}); move it aside to start an empty queue") from None
    ok = isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("jobs"), list) \
        and isinstance(data.get("history"), list) and isinstance(data.get("next_id"), int)
    if not ok:
        raise RunError(f"{p}: not a queue file of this edgetune (format {FORMAT}); move it aside to start an empty "
                       "queue")
    for job in data["jobs"]:
        problem = job_problem(runs_dir, job)
        if problem:
            raise RunError(f"{p}: {problem}; nothing in the queue runs: move the file aside to start an empty queue")
    for h in data["history"]:
        if not (isinstance(h, dict) and _number(h.get("id")) and all(isinstance(h.get(k), str) for k in
                ("kind", "folder", "status", "message")) and isinstance(h.get("ended"), (int, float))):
            raise RunError(f"{p}: an ended job that is not one this edgetune writes ({json.dumps(h)[:80]}); move "
                           "the file aside to start an empty queue")
    return data


TOKEN = re.compile(r"[0-9a-f]{32}")  # a job's token: uuid4().hex
STATES = ("queued", "started")


def _number(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def spool_path(runs_dir: str | os.PathLike, token: str) -> Path:
    """Where a queued run's settings are kept: in the queue's own folder, named by its token."""
    return Path(runs_dir).resolve() / SPOOL / f"{token}.yaml"


def job_problem(runs_dir: str | os.PathLike, job) -> str | None:
    """What makes `job` (as read from a queue file) other than a job `add_run` makes, in
    words; None when it is one."""
    from edgetune.engine.core.settings import GPUS

    if not isinstance(job, dict):
        return f"a job that is not one this edgetune writes ({json.dumps(job)[:80]})"
    who = f"job {job.get('id')!r}"
    if not _number(job.get("id")):
        return f"{who}: its number is not a whole number from 1"
    if not (isinstance(job.get("token"), str) and TOKEN.fullmatch(job["token"])):
        return f"{who}: its token is not one edgetune makes"
    if job.get("kind") not in KINDS:
        return f"{who}: no kind of job {job.get('kind')!r}"
    try:
        check_run_name(job.get("folder"))
    except ConfigError:
        return f"{who}: folder {job.get('folder')!r} is not a plain run name in the runs folder"
    spool = str(spool_path(runs_dir, job["token"]))
    command = job.get("command")
    forms = (["train", "--config", spool],)
    if not (isinstance(command, list) and (command in forms or (
            command[:3] in forms and len(command) == 5 and command[3] == "--gpus" and isinstance(command[4], str)
            and command[4].isdigit() and GPUS.allows(int(command[4]))))):
        return f"{who}: its command {json.dumps(command)[:120]} is not one edgetune train --queue makes"
    if job.get("settings") != spool:
        return f"{who}: its settings are not the queue's own copy ({spool})"
    if not (isinstance(job.get("cwd"), str) and os.path.isabs(job["cwd"])):
        return f"{who}: its working folder {job.get('cwd')!r} is not an absolute path"
    if job.get("state", "queued") not in STATES:
        return f"{who}: state {job.get('state')!r} is not one of {', '.join(STATES)}"
    for key, types in (("method", str), ("steps", int), ("added", (int, float)), ("started", (int, float)),
                       ("revived", bool), ("ran", bool)):
        if job.get(key) is not None and not isinstance(job[key], types):
            return f"{who}: {key} {job[key]!r} is not a {getattr(types, '__name__', 'number')}"
    return None


def _consent(job: dict) -> dict:
    """What decides what a job runs, for the user's record: its command, folder and settings."""
    try:
        settings = hashlib.sha256(Path(job["settings"]).read_bytes()).hexdigest()
    except OSError:
        settings = None
    return {"token": job["token"], "kind": job["kind"], "command": job["command"], "cwd": job["cwd"],
            "settings": settings}


def queued_here(job: dict) -> bool:
    """Did this machine's user queue `job`, as it is now (engine/core/consent.py)?"""
    return consent.recorded("queued", _consent(job))


def waiting_line(runs_dir: str | os.PathLike, job: dict) -> str | None:
    """One line for a job that waits for the user's word (not queued by this user, or its
    settings changed since), naming what it would run; None when it may run."""
    import shlex

    if queued_here(job):
        return None
    code = ""
    try:
        from edgetune.engine.core.settings import load_run_config

        found = api.code_it_runs(load_run_config(job["settings"]))
        code = "".join(f"; it runs {what} ({setting})" for setting, what in found)
    except (EdgetuneError, OSError):
        pass
    return (f"job {job['id']} ({job['folder']}) waits: it was not queued by this user on this machine, or its "
            f"settings ({job['settings']}) changed since{code}; read them, and if you trust it: edgetune queue "
            f"confirm {job['id']} --runs-dir {shlex.quote(str(runs_dir))}")


@contextlib.contextmanager
def editing(runs_dir: str | os.PathLike):
    """The queue's contents to change in place; written whole when the block ends without
    an error, all under QUEUE_LOCK."""
    d = Path(runs_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / QUEUE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunError(f"the queue of {d} cannot be changed: {os_error_line(e)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = read(d)
        before = json.dumps(data)
        yield data
        if json.dumps(data) != before:
            try:
                atomic_write_text(queue_path(d), json.dumps(data, indent=1))
            except OSError as e:  # the file as it was: written whole or not at all
                raise RunError(f"the queue of {d} is unchanged: {os_error_line(e)}") from None
    finally:
        os.close(fd)


def jobs(runs_dir: str | os.PathLike) -> list[dict]:
    """The queued jobs, first to run first (the first may be running: `state`)."""
    return read(runs_dir)["jobs"]


def history(runs_dir: str | os.PathLike) -> list[dict]:
    """The jobs that ended, newest last: id, kind, folder, status, message, ended."""
    return read(runs_dir)["history"]


def _taken(runs_dir: Path, data: dict) -> set[str]:
    return {j["folder"] for j in data["jobs"]} | ({p.name for p in runs_dir.iterdir()} if runs_dir.is_dir() else set())


def _free_name(base: str, taken: set[str]) -> str:
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


def add(runs_dir: str | os.PathLike, kind: str, command: list[str], folder: str, cwd: str | os.PathLike,
        token: str | None = None, **extra) -> dict:
    """Queue `edgetune <command>` (run from `cwd`) writing into <runs_dir>/<folder> (a
    suffix when that name is taken by a run or a queued job); returns the job."""
    runs_dir = Path(runs_dir).resolve()
    if kind not in KINDS:
        raise RunError(f"no kind of job '{kind}' (one of {', '.join(KINDS)})")
    with editing(runs_dir) as data:
        job = {"id": data["next_id"], "token": token or uuid.uuid4().hex, "kind": kind,
               "folder": _free_name(api.check_run_name(folder), _taken(runs_dir, data)), "command": list(command),
               "cwd": str(Path(cwd).resolve()), "added": time.time(), "state": "queued", **extra}
        problem = job_problem(runs_dir, job)
        if problem:
            raise RunError(f"{queue_path(runs_dir)}: {problem}")
        data["next_id"] += 1
        data["jobs"].append(job)
        consent.record("queued", _consent(job))  # before the queue file says so: a driver may look at once
    return job


def add_run(cfg, gpus: int = 1, cwd: str | os.PathLike | None = None) -> dict:
    """Queue a run of the resolved settings `cfg` (its runs folder's queue): they are kept
    as they are now (<runs_dir>/.queue/<token>.yaml), so a preset or file edited later does
    not change what the run trains. Checked as a Start checks them, before it is queued."""
    from datetime import datetime

    gpus = api.typed_number("--gpus", gpus, api.GPUS)
    api.preflight(cfg)
    runs_dir = Path(cfg.run.runs_dir).resolve()
    name = cfg.run.name or f"{cfg.method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    api.check_run_name(name)
    token = uuid.uuid4().hex
    spool = spool_path(runs_dir, token)
    try:
        atomic_write_text(spool, cfg.to_yaml())
    except OSError as e:
        raise RunError(f"nothing was queued: {os_error_line(e)}") from None
    try:
        command = ["train", "--config", str(spool)] + (["--gpus", str(gpus)] if gpus > 1 else [])
        return add(runs_dir, "train", command, name, cwd or os.getcwd(), token=token, settings=str(spool),
                   method=cfg.method, steps=api.METHODS[cfg.method].total(cfg.to_dict()))
    except BaseException:
        spool.unlink(missing_ok=True)
        raise


def _find(data: dict, job_id: int, runs_dir: Path) -> dict:
    job = next((j for j in data["jobs"] if j["id"] == job_id), None)
    if job is None:
        raise RunError(f"no job {job_id} in the queue of {runs_dir} (edgetune queue list --runs-dir {runs_dir} "
                       "lists it)")
    return job


def cancel(runs_dir: str | os.PathLike, job_id: int) -> dict:
    """Take a job that has not started out of the queue (a started run is stopped as any
    run is: the Train tab's Stop, or Ctrl-C where it was followed)."""
    runs_dir = Path(runs_dir)
    with editing(runs_dir) as data:
        job = _find(data, job_id, runs_dir)
        if job.get("state") != "queued":
            raise RunError(f"job {job_id} has started ({runs_dir / job['folder']}): stop its run instead; the queue "
                           "then goes on with the next job")
        data["jobs"].remove(job)
        _record(data, job, "cancelled", "taken out of the queue")
    _drop_spool(job)
    return job


def move(runs_dir: str | os.PathLike, job_id: int, position: int) -> int:
    """Put a job that has not started at `position` (1 = next to run; clamped to the
    queue, and never before a job that has started); returns the position it got."""
    runs_dir = Path(runs_dir)
    with editing(runs_dir) as data:
        job = _find(data, job_id, runs_dir)
        if job.get("state") != "queued":
            raise RunError(f"job {job_id} has started: it keeps its place")
        data["jobs"].remove(job)
        first = sum(1 for j in data["jobs"] if j.get("state") != "queued")  # started jobs stay in front
        at = min(max(int(position) - 1, first), len(data["jobs"]))
        data["jobs"].insert(at, job)
    return at + 1


def position(runs_dir: str | os.PathLike, job_id: int) -> int:
    return next(i + 1 for i, j in enumerate(jobs(runs_dir)) if j["id"] == job_id)


def _record(data: dict, job: dict, status: str, message: str) -> None:
    data["history"].append({"id": job["id"], "kind": job["kind"], "folder": job["folder"], "status": status,
                            "message": message, "ended": time.time()})
    del data["history"][:-HISTORY]


def _drop_spool(job: dict) -> None:
    """The copy of a queued run's settings, made when it was queued, and the user's record
    of it, once the job is done."""
    consent.forget("queued", _consent(job))
    spool = job.get("settings")
    if spool and Path(spool).parent.name == SPOOL:
        Path(spool).unlink(missing_ok=True)


def confirm(runs_dir: str | os.PathLike, job_id: int) -> dict:
    """The user's word that a job in the queue (one copied with the runs folder, or whose
    settings changed since it was queued) may run as it is now."""
    runs_dir = Path(runs_dir)
    with editing(runs_dir) as data:
        job = _find(data, job_id, runs_dir)
        if not Path(job["settings"]).is_file():
            raise RunError(f"job {job_id}: its settings {job['settings']} are gone; cancel it (edgetune queue cancel "
                           f"{job_id} --runs-dir {runs_dir})")
        consent.record("queued", _consent(job))
    return job


# --------------------------------------------------------------------------- the driver


def driver_pid(runs_dir: str | os.PathLike) -> int | None:
    """The pid of the process that runs the queue now, or None."""
    p = Path(runs_dir) / DRIVER_LOCK
    if not p.is_file():
        return None
    fd = try_lock(p)
    if fd is not None:
        os.close(fd)
        return None
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return -1  # held, pid not yet written


def _busy(runs_dir: Path) -> bool:
    """Something works on the device: a run's worker holds the runs folder's lock."""
    fd = lock_runs_folder(runs_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


class Driver:
    """Runs a runs folder's queue, one job after another; `say` hears one line per event
    (a job started, ended, waits)."""

    def __init__(self, runs_dir: str | os.PathLike, say: Callable[[str], None] = lambda line: None):
        self.runs_dir = Path(runs_dir).resolve()
        self.say = say
        self.fd: int | None = None
        self.told: set[str] = set()  # the jobs that said they wait for the user's word

    def acquire(self) -> bool:
        """Become the queue's driver; False when another process is."""
        if self.fd is None:
            self.fd = try_lock(self.runs_dir / DRIVER_LOCK)
            if self.fd is not None:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self.fd is not None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def run(self, wait: bool = False) -> None:
        """Run the queue until it is empty (`wait`: then wait for more, until killed)."""
        if not self.acquire():
            pid = driver_pid(self.runs_dir)
            raise RunError(f"the queue of {self.runs_dir} is already run by another process (pid {pid}: the app or "
                           "edgetune queue run); it runs every job in turn")
        try:
            while True:
                more = self.step()
                if more == "empty" and not wait:
                    return
                if more != "next":
                    time.sleep(POLL_SECONDS)
        finally:
            self.release()

    def step(self) -> str:
        """One look at the queue's first job that may run, acting on it: 'empty' (nothing
        to do: no job, or only jobs that wait for the user's word), 'wait' (it, or another
        run, still works) or 'next' (look again at once)."""
        data = read(self.runs_dir)
        job = self._next(data["jobs"])
        if job is None:
            return "empty"
        kind = KINDS[job["kind"]]
        folder = self._found(job)
        if folder is not None and folder.parent.name == api.TRASH:  # deleted since it started
            status = api.Run(folder).status()
            self._end(job, status if status in ("finished", "stopped") else "deleted", f"its run was moved to "
                      f"{folder} (edgetune restore {folder.name} --runs-dir {self.runs_dir} brings it back)")
            return "next"
        if folder is not None:  # it started: wait for its end, then record it
            if folder.name != job["folder"]:  # renamed since: the job follows its run
                self._set(job, folder=folder.name)
            if not job.get("ran"):
                self._set(job, ran=True)
            if _busy(self.runs_dir):
                return "wait"
            if kind.revive is not None and not RunDir(folder).events_path.exists() and not job.get("revived"):
                self.say(f"job {job['id']}: {folder} appeared but its work never started; starting it")
                self._set(job, revived=True)  # once: a worker that dies before its first word is recorded
                try:
                    kind.revive(folder, job)
                except api.RunsFolderBusy:
                    return "wait"
                except EdgetuneError as e:
                    self._end(job, "failed", str(e))
                return "next"
            outcome = kind.outcome(folder)
            if outcome is None:
                return "wait"
            self._end(job, *outcome)
            return "next"
        if job.get("ran"):  # its folder appeared, and is gone since: never a second run of it
            self._end(job, "deleted", f"its run folder {self.runs_dir / job['folder']} was deleted after it started; "
                      "it is not started again")
            return "next"
        folder = self.runs_dir / job["folder"]
        if folder.exists():  # the name was taken since the job was queued: the job takes another
            with editing(self.runs_dir) as data:
                j = next((x for x in data["jobs"] if x["id"] == job["id"]), None)  # (None: cancelled meanwhile)
                if j is not None:
                    j["folder"] = _free_name(job["folder"], _taken(self.runs_dir, data))
            return "next"
        if not Path(job["settings"]).is_file():
            self._end(job, "failed", f"its settings {job['settings']} are gone")
            return "next"
        if _busy(self.runs_dir):  # a run started elsewhere: the queue waits its turn
            return "wait"
        with editing(self.runs_dir) as data:
            j = next((x for x in data["jobs"] if x["id"] == job["id"]), None)
            if j is None or self._next(data["jobs"], quiet=True) is not j:  # cancelled or moved meanwhile
                return "next"
            j["state"] = "started"
            j["started"] = time.time()
        self.say(f"job {job['id']}: starting {kind.label} {job['folder']}")
        cmd = [sys.executable, "-m", "edgetune.engine.cli", *job["command"], *kind.folder_args(folder),
               "--queue-job", job["token"]]
        try:
            # its own session: a Ctrl-C meant for the app's terminal does not cut a start in two
            p = subprocess.run(cmd, cwd=job["cwd"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               start_new_session=True)
            said = [ln[len("error: "):] for ln in p.stderr.splitlines() if ln.startswith("error: ")]
            why = said[-1] if said else (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        except OSError as e:
            p, why = None, f"{job['cwd']}: cannot start the job there ({e.strerror})"
        if RunDir(folder).queue_job() == job["token"]:
            self._set(job, ran=True)
            return "wait"  # it runs (or ran): the next look records its end
        if p is not None and _busy(self.runs_dir):  # another run took the device first: try again later
            self._set(job, state="queued")
            return "wait"
        self._end(job, "failed", why)
        return "next"

    def _next(self, jobs: list[dict], quiet: bool = False) -> dict | None:
        """The first job that may run: one this user queued (queued_here), or one that
        started already (only its end is recorded; nothing of it is started). Each other
        job says once, in one line, what it waits for."""
        for job in jobs:
            if queued_here(job):
                return job
            if job.get("state") == "started" and self._found(job) is not None \
                    and RunDir(self._found(job)).events_path.exists():
                return job
            if not quiet and job["token"] not in self.told:
                self.told.add(job["token"])
                self.say(waiting_line(self.runs_dir, job))
        return None

    def _found(self, job: dict) -> Path | None:
        """The run folder of a job that started: the one holding its token, under the name the
        queue gave it, or another it was renamed to since, or in the trash; None when no
        folder holds it."""
        folder = self.runs_dir / job["folder"]
        if RunDir(folder).queue_job() == job["token"]:
            return folder
        if job.get("state") != "started":
            return None
        for where in (self.runs_dir, self.runs_dir / api.TRASH):
            try:
                found = [p for p in where.iterdir() if not p.name.startswith(".") and p.is_dir()
                         and not p.is_symlink() and RunDir(p).queue_job() == job["token"]]
            except OSError:
                continue
            if found:
                return found[0]
        return None

    def _set(self, job: dict, **fields) -> None:
        with editing(self.runs_dir) as data:
            j = next((x for x in data["jobs"] if x["id"] == job["id"]), None)
            if j is not None:
                j.update(fields)
        job.update(fields)

    def _end(self, job: dict, status: str, message: str) -> None:
        with editing(self.runs_dir) as data:
            data["jobs"] = [j for j in data["jobs"] if j["id"] != job["id"]]
            _record(data, job, status, message)
        _drop_spool(job)
        self.say(f"job {job['id']}: {KINDS[job['kind']].label} {job['folder']} {status}"
                 + (f": {message}" if message and status in FAILED else ""))


def serve(runs_dir: str | os.PathLike, stop: Callable[[], bool] = lambda: False) -> None:
    """The app's driver, in a side thread: whenever the queue holds jobs and no other
    process runs it, run it; look again every POLL_SECONDS."""
    driver = Driver(runs_dir)
    while not stop():
        try:
            if jobs(runs_dir) and driver.acquire():
                try:
                    while not stop() and driver.step() != "empty":
                        time.sleep(POLL_SECONDS)
                finally:
                    driver.release()
        except EdgetuneError:
            pass  # a damaged queue file: the Queue section names it; nothing runs until it is fixed
        time.sleep(POLL_SECONDS)
