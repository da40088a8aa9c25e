"""`edgetune train` and `edgetune resume`: start or continue a run and follow it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgetune.engine.core import distributed

from edgetune.engine.run import api, queue

from edgetune.engine.cli.common import config_args, config_from, run_arg
from edgetune.engine.cli.launch import check_gpus, exec_torchrun, train_as_rank
from edgetune.engine.cli.watch import resumed_line, watch


def cmd_train(a) -> int:
    if distributed.launched():  # one of several ranks that torchrun started
        return train_as_rank(a)
    if a.nnodes > 1:
        return exec_torchrun(a)
    check_gpus(a.gpus)
    cfg = config_from(a)
    if a.queue:
        job = queue.add_run(cfg, gpus=a.gpus)
        runs = cfg.run.runs_dir
        print(f"queued as job {job['id']} (run folder {Path(runs).resolve() / job['folder']}, place "
              f"{queue.position(runs, job['id'])} in the queue); it runs in the app (edgetune ui --runs-dir {runs}) "
              f"or with: edgetune queue run --runs-dir {runs}")
        return 0
    run = api.start(cfg, name=a.name, gpus=a.gpus, job=a.queue_job)
    print(f"run folder: {run.path}" + (f" ({a.gpus} ranks)" if a.gpus > 1 else ""))
    if a.detach:
        return 0
    return watch(run)


def cmd_resume(a) -> int:
    a.run = run_arg(a.run, a.runs_dir)
    check_gpus(a.gpus)
    before = list(api.open_run(a.run).events())
    start = before[-1]["i"] + 1 if before else 0  # counted before the worker starts writing
    run = api.resume(a.run, gpus=a.gpus, allow_code=a.allow_code or (), more=a.more_steps)
    if not a.detach:
        return watch(run, start=start, resuming=True)
    # Detached: wait only for the worker's choice of checkpoint (or its refusal).
    for ev in run.events(start, follow_live=True):
        if ev["type"] == "warning":
            print(f"warning: {ev['message']}", file=sys.stderr)
        elif ev["type"] == "error":
            print(f"error: {ev['message']}", file=sys.stderr)
            return 2 if ev.get("kind") == "input" else 1
        elif ev["type"] == "started":
            print(resumed_line(run, ev))
            return 0
    print(f"error: {run.death()}", file=sys.stderr)
    return 1


def add_train_parser(sub) -> None:
    """`edgetune train`'s flags."""
    t = sub.add_parser("train", help="start a run and follow it",
                       epilog="fgrpo.reward_file / essa.reward_file name a Python file that the run imports and "
                              "calls: it runs with your rights, so use only code you trust.")
    config_args(t)
    t.add_argument("--name", help="the run's folder name in the runs folder (default: run.name, else the method "
                                  "and the time)")
    t.add_argument("--runs-dir", help="the folder runs are kept in (default: run.runs_dir, which is runs)")
    t.add_argument("--detach", action="store_true", help="start and return; follow it later")
    t.add_argument("--gpus", "--nproc", dest="gpus", default=1,
                   help="GPUs of this machine to train on, data-parallel (torchrun, NCCL); on a machine "
                        "without CUDA, that many CPU processes (gloo), for tests")
    t.add_argument("--nnodes", default=1, help="machines (run the same command on each; needs "
                                               "--rdzv-endpoint)")
    t.add_argument("--node-rank", help="this machine's index (default: torchrun assigns one)")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of the first machine, where the machines meet")
    t.add_argument("--rdzv-id", default="edgetune", help="a name shared by the machines of one run")
    t.add_argument("--queue", action="store_true",
                   help="add the run to the runs folder's queue instead of starting it now: queued runs train one "
                        "after another, in the app or under `edgetune queue run` (edgetune queue list shows them)")
    t.add_argument("--queue-job", help=argparse.SUPPRESS)  # the queue's driver: the token its run folder carries
    t.set_defaults(fn=cmd_train)


def add_resume_parser(sub) -> None:
    """`edgetune resume`'s flags."""
    r = sub.add_parser("resume", help="continue a stopped or crashed run from its last checkpoint (--more-steps: "
                                      "train a run further)")
    r.add_argument("run", help="a run folder, or a run name as `edgetune runs` prints it")
    r.add_argument("--detach", action="store_true")
    r.add_argument("--runs-dir", default="runs", help="where run names are looked up")
    r.add_argument("--gpus", "--nproc", dest="gpus",
                   help="GPUs to continue on (any number: checkpoints hold nothing rank-specific); default "
                        "as many as the run's last start")
    r.add_argument("--allow-code", action="append", metavar="FILE_OR_MODEL",
                   help="run this Python when resuming: the reward_file, or for model.trust_remote_code the "
                        "model, exactly as the run's config.yaml names it (repeat for both). Without it, a run "
                        "whose settings run Python other than edgetune's is refused: a run folder may come "
                        "from anyone")
    r.add_argument("--more-steps", metavar="N",
                   help="train N steps past the run's step count, a finished run too (from its final checkpoint, "
                        "with its optimizer state); the learning rate stays at the schedule's final value for them")
    r.set_defaults(fn=cmd_resume)
