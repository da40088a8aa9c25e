"""An evaluation as a job of its own process, the way a run trains: started from the app (or
any caller) with `start`, it outlives the page that started it, says how far it got, can be
stopped, and leaves its result on disk beside the runs, where the page finds it again.

    <runs_dir>/.evaluations/<name>/
        request.json   the systems (the base or not, [name, adapter folder] each) and the tasks
        config.yaml    the settings it grades with (model, data, reward, seed)
        progress.json  {"loading": true} from the worker's start, then the system and task
                       being graded, items done of total
        result.json    engine/run/evaluation.py's comparison, written once at the end
        error.txt      the one line of a job that failed
        stopped        there when a stop was asked for and the job ended on it
        pid            the worker's pid and start time (clock ticks since boot)
        worker.log

Status: `finished` (result.json), `failed` (error.txt), `stopped`, `running` while its process
lives, else `crashed` (the process died without a word: worker.log says why). A stop sends
the job's process group SIGTERM: the job ends at once, writing no result.

Importing this module loads no torch: the worker imports the evaluation when it starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from edgetune.engine.core import interrupts
from edgetune.engine.core.errors import EdgetuneError, RunError
from edgetune.engine.core.runfolder import atomic_write_text, lock_runs_folder, open_append, our_process, process_start
from edgetune.engine.core.threads import worker_env

WORKER_MODULE = "edgetune.engine.run.eval_jobs"
EVALS = ".evaluations"  # <runs_dir>/.evaluations: one folder an evaluation job
STATUSES = ("running", "finished", "failed", "stopped", "crashed")


def evals_dir(runs_dir: str | os.PathLike) -> Path:
    return Path(runs_dir) / EVALS


class EvalJob:
    def __init__(self, path: str | os.PathLike, process: subprocess.Popen | None = None):
        self.path = Path(path)
        self.process = process

    @property
    def name(self) -> str:
        return self.path.name

    def _read(self, name: str):
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def request(self) -> dict:
        return self._read("request.json") or {}

    def progress(self) -> dict:
        return self._read("progress.json") or {}

    def result(self) -> dict | None:
        return self._read("result.json")

    def error(self) -> str:
        try:
            return (self.path / "error.txt").read_text().strip()
        except OSError:
            return ""

    def pid(self) -> int | None:
        """The worker's pid, when that process is this job's worker (its command line names
        this job's folder and it started when the pid file says): a pid file may be planted
        in a copied folder, or its pid reused since, and no other process is signalled."""
        try:
            pid, start = (int(x) for x in (self.path / "pid").read_text().split())
        except (OSError, ValueError):
            return None
        return pid if our_process(pid, (WORKER_MODULE, str(self.path)), start) else None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid() is not None

    def status(self) -> str:
        if (self.path / "result.json").is_file():
            return "finished"
        if (self.path / "error.txt").is_file():
            return "failed"
        if (self.path / "stopped").is_file():
            return "stopped"
        return "running" if self.alive() else "crashed"

    def stop(self) -> None:
        """End the job now (its process group gets SIGTERM); it writes no result."""
        pid = self.pid()
        if pid is None or not self.alive():
            return
        try:
            os.killpg(pid, signal.SIGTERM)  # the worker leads its own session
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> str:
        if self.process is not None:
            self.process.wait(timeout)
        return self.status()


def list_evals(runs_dir: str | os.PathLike) -> list[EvalJob]:
    """The evaluation jobs beside the runs, newest first."""
    d = evals_dir(runs_dir)
    if not d.is_dir():
        return []
    jobs = [EvalJob(p) for p in d.iterdir() if (p / "request.json").is_file()]
    return sorted(jobs, key=lambda j: (j.path / "request.json").stat().st_mtime, reverse=True)


def active_eval(runs_dir: str | os.PathLike) -> EvalJob | None:
    return next((j for j in list_evals(runs_dir) if j.status() == "running"), None)


def start(cfg, base: bool, adapters: list[tuple[str, str]], tasks: list[str],
          runs_dir: str | os.PathLike, run: str | os.PathLike | None = None, long_ok: bool = False) -> EvalJob:
    """A new job folder with its request and settings, and its worker started: the base
    (when `base`) and each (name, adapter or run folder) graded on `tasks`. `run`: the run
    folder whose settings `cfg` are; a run folder may come from anywhere, so Python its
    settings name (a reward file, a model's own code) is refused in one line, as a harness
    task that runs Python is: both run only from the command line, where the user names
    them (`edgetune eval --allow-code`). A task file of more than LARGE_TASK_PROMPTS prompts
    is refused, saying its size and what it generates, unless `long_ok`. The worker holds
    the runs folder's lock, as a run's worker does (engine/core/runfolder.py): one job on
    the device at a time, so no run starts and the queue waits while it grades, and none
    starts while a run trains."""
    if not base and not adapters:
        raise EdgetuneError("nothing to evaluate: pick the base and/or runs")
    if not tasks:
        raise EdgetuneError("nothing to grade on: pick the held-out split, a task file or a harness task")
    _confirm_code(cfg, adapters, tasks, run)
    if not long_ok:
        _confirm_size(cfg, tasks, int(bool(base)) + len(adapters))
    fd = lock_runs_folder(runs_dir)  # the device does one thing at a time: the worker holds it to its end
    if fd is None:
        other = active_eval(runs_dir)
        who = f"the evaluation {other.name} is running" if other else "a run is training or starting"
        raise RunError(f"{who} in {runs_dir} (one job on the device at a time): evaluate when it has ended")
    try:
        return _start(cfg, base, adapters, tasks, runs_dir, fd)
    finally:
        os.close(fd)


def _confirm_code(cfg, adapters, tasks, run) -> None:
    import shlex

    from edgetune.engine.run import harness
    from edgetune.engine.run.user_code import confirm_code

    line = "edgetune eval " + " ".join(
        [f"--config {shlex.quote(str(Path(run) / 'config.yaml'))}" if run else "--config CONFIG",
         *(f"--adapter {shlex.quote(path)}" for _, path in adapters), *(f"--task {shlex.quote(t)}" for t in tasks)])
    if run is not None:
        confirm_code(run, cfg, doing="is graded", command=f"grade it on the command line: {line}")
    harness.confirm_code(tasks, how=f"grade it on the command line: {line}")


def _confirm_size(cfg, tasks: list[str], systems: int) -> None:
    from edgetune.engine.run.eval_tasks import HARNESS_PREFIX, HELD_OUT, LARGE_TASK_PROMPTS, size_line

    from edgetune.engine import data as data_lib

    for task in tasks:
        if task == HELD_OUT or task.startswith(HARNESS_PREFIX):
            continue
        try:
            prompts = len(data_lib.task_rows(task, cfg.data))
        except EdgetuneError:
            continue  # a bad task file: the job names its file and row, as for every task
        if prompts > LARGE_TASK_PROMPTS:
            raise EdgetuneError(f"{size_line(cfg, task, prompts, systems)}: a long evaluation; to start it, tick "
                                "'Start a long evaluation' and Start again")


def _start(cfg, base, adapters, tasks, runs_dir, fd: int) -> EvalJob:
    d = evals_dir(runs_dir)
    stem = datetime.now().strftime("eval-%Y%m%d-%H%M%S")
    name, n = stem, 1
    while (d / name).exists():
        n += 1
        name = f"{stem}-{n}"
    path = d / name
    try:
        path.mkdir(parents=True)
        atomic_write_text(path / "config.yaml", cfg.to_yaml())
        atomic_write_text(path / "request.json", json.dumps({"base": bool(base), "adapters": [list(a) for a in adapters], "tasks": tasks,
                                                             "created": datetime.now().isoformat(timespec="seconds")}))
    except OSError as e:
        raise RunError(f"{path}: cannot create the evaluation folder ({e.strerror})") from None
    log = open_append(path / "worker.log")
    proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(path), str(fd)], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=worker_env(PYTHONUNBUFFERED="1"), cwd=os.getcwd(), pass_fds=(fd,))
    log.close()
    atomic_write_text(path / "pid", f"{proc.pid} {process_start(proc.pid) or 0}")
    return EvalJob(path, proc)


def run(path: str | os.PathLike, lock_fd: int | None = None) -> int:
    """The worker: grade, write progress as it goes and the result at the end. `lock_fd`:
    the runs folder's lock it inherited, let go as soon as the job has ended (before the
    interpreter's slow exit), so that the next job can start once the page says it ended."""
    try:
        return _run(Path(path))
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _run(path: Path) -> int:
    interrupts.install(signal.SIGTERM, second=signal.SIG_IGN)  # a stop: KeyboardInterrupt; a second one: the same stop
    atomic_write_text(path / "progress.json", json.dumps({"loading": True}))  # a stop from here on is heard
    try:
        from edgetune.engine.core.settings import load_run_config

        from edgetune.engine.run import evaluation

        request = json.loads((path / "request.json").read_text())
        cfg = load_run_config(path / "config.yaml")
        systems = ([(evaluation.BASE, "")] if request["base"] else []) + [tuple(a) for a in request["adapters"]]

        def progress(name, i, task, done, total):
            atomic_write_text(path / "progress.json", json.dumps(
                {"system": name, "index": i, "systems": len(systems), "task": task, "done": done, "total": total}))
            return False

        result = evaluation.compare(cfg, systems, request["tasks"], progress=progress)
        atomic_write_text(path / "result.json", json.dumps(result))
        return 0
    except KeyboardInterrupt:
        atomic_write_text(path / "stopped", "")
        return 130
    except Exception as e:  # noqa: BLE001 - the page shows one line; worker.log has the traceback
        # A stop that lands inside a library's import (the model loading) may come out as
        # another error (numpy's half-imported module: a RecursionError): still a stop.
        if interrupts.asked():
            atomic_write_text(path / "stopped", "")
            return 130
        if isinstance(e, EdgetuneError):
            atomic_write_text(path / "error.txt", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return 2
        import traceback

        traceback.print_exc()
        atomic_write_text(path / "error.txt", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                                              f"(the traceback is in {path / 'worker.log'})")
        return 1
    finally:
        interrupts.ended(signal.SIGTERM)  # the job has ended: a stop from here on changes nothing


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
