"""`edgetune queue`: list the queued jobs, run them one after another, cancel or move one."""

from __future__ import annotations

from pathlib import Path

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import queue

from edgetune.engine.cli.tables import job_line


def cmd_queue(a) -> int:
    runs = a.runs_dir
    if a.action == "list":
        jobs, ended = queue.jobs(runs), queue.history(runs)
        pid = queue.driver_pid(runs)
        print(f"queue of {Path(runs).resolve()}: {len(jobs)} job{'s' if len(jobs) != 1 else ''}; "
              + (f"run by pid {pid}" if pid else "no process runs it now (edgetune queue run, or the app)"))
        for i, j in enumerate(jobs):
            print(job_line(j, i + 1) + (f"\n     {queue.waiting_line(runs, j)}" if not queue.queued_here(j) else ""))
        if ended and a.all:
            print("ended:")
            for j in ended:
                print(job_line(j))
        return 0
    if a.action == "run":
        queue.Driver(runs, say=lambda line: print(line, flush=True)).run(wait=a.wait)
        return 0
    if a.job is None:
        raise EdgetuneError(f"edgetune queue {a.action}: give the job's number (edgetune queue list shows them)")
    if a.action == "confirm":
        print(f"job {queue.confirm(runs, a.job)['id']} may run; it trains with the settings in its file, as they are now")
        return 0
    if a.action == "cancel":
        job = queue.cancel(runs, a.job)
        print(f"job {job['id']} ({job['folder']}) taken out of the queue")
        return 0
    places = {"up": -1, "down": 1}
    if a.to is None and a.action in places:
        now = queue.position(runs, a.job) if any(j["id"] == a.job for j in queue.jobs(runs)) else 0
        a.to = now + places[a.action]
    if a.to is None:
        raise EdgetuneError("edgetune queue move: give --to N (1 = next to run)")
    print(f"job {a.job} is now number {queue.move(runs, a.job, a.to)} in the queue")
    return 0


def add_parser(sub) -> None:
    """`edgetune queue`'s arguments."""
    q = sub.add_parser("queue", help="the queued jobs: list, run them one after another, cancel or move one",
                       description="Jobs queued with `edgetune train --queue` (or the app's Add to queue) run one "
                                   "after another, in order: in the app while it runs, or under `edgetune queue run`. "
                                   "The queue lives in the runs folder and survives restarts.")
    q.add_argument("action", nargs="?", default="list", choices=["list", "run", "cancel", "up", "down", "move",
                                                                  "confirm"],
                   help="list (the default); run: run the jobs one after another until the queue is empty; cancel, "
                        "up, down, move (with --to N) a job that has not started; confirm: let a job run that this "
                        "user did not queue here (a copied runs folder's)")
    q.add_argument("job", nargs="?", help="the job's number, as list shows it")
    q.add_argument("--to", metavar="N", help="move: the job's new place (1 = next to run)")
    q.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    q.add_argument("--all", action="store_true", help="list: also the jobs that ended (the last 50)")
    q.add_argument("--wait", action="store_true", help="run: when the queue is empty, wait for more jobs (until "
                                                        "Ctrl-C)")
    q.set_defaults(fn=cmd_queue)
