"""Training on several GPUs or machines: the check of --gpus, the relaunch under torchrun
for several machines, and one rank's share of a run that torchrun started."""

from __future__ import annotations

import os
import sys
import threading

from edgetune.engine.core import distributed as dist
from edgetune.engine.core.errors import EdgetuneError
from edgetune.engine.core.events import follow

from edgetune.engine.planning import planner

from edgetune.engine.run import api, worker

from edgetune.engine.cli.common import config_from


def check_gpus(n: int | None) -> None:
    """--gpus (already within its range): on a machine without a CUDA GPU every rank is a
    CPU process (gloo), so at most one a core."""
    if n is None:
        return
    cores = os.cpu_count() or 1
    if n > cores and planner.gpu_memory() is None:
        raise EdgetuneError(f"--gpus {n}: this machine has no CUDA GPU, so each rank would be a CPU process; "
                            f"at most {cores} (its CPU cores)")


def exec_torchrun(a) -> int:
    """Several machines: this machine's share of the ranks under torchrun, which meets the
    other machines at --rdzv-endpoint; every rank runs `edgetune train` (below)."""
    if not a.rdzv_endpoint:
        raise EdgetuneError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every machine)")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={a.nnodes}", f"--nproc-per-node={a.gpus}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={a.rdzv_endpoint}", f"--rdzv-id={a.rdzv_id}"]
    if a.node_rank is not None:
        cmd.append(f"--node-rank={a.node_rank}")
    cmd += ["-m", "edgetune.engine.cli", "train"]
    for flag, value in (("--preset", a.preset), ("--config", a.config), ("--name", a.name),
                        ("--runs-dir", a.runs_dir)):
        if value:
            cmd += [flag, value]
    for s in a.set or []:
        cmd += ["--set", s]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    os.execv(sys.executable, cmd)
    return 1  # not reached


def train_as_rank(a) -> int:
    """`torchrun ... -m edgetune.engine.cli train ...`: every rank trains in its own
    process (no worker is spawned); rank 0 makes the run folder and prints the steps."""
    dist.init()
    made = fd = None
    if dist.is_main():
        try:
            run, fd = api.create(config_from(a), name=a.name)
            made = ("ok", str(run.path))
        except EdgetuneError as e:
            made = ("error", str(e))
    made = dist.broadcast_object(made)
    if made[0] == "error":
        dist.shutdown()
        if fd is None and dist.is_main():
            raise EdgetuneError(made[1])
        return 2
    path = made[1]
    done = threading.Event()
    main = dist.is_main()  # (worker.run leaves the process group at its end)
    if main:
        print(f"run folder: {path} ({dist.world()} ranks)", flush=True)

        def show():
            for ev in follow(f"{path}/events.jsonl", alive=lambda: not done.is_set()):
                if ev["type"] == "step":
                    nums = ", ".join(f"{k} {ev[k]:.4g}" for k in ("loss", "reward_mean", "best") if k in ev)
                    print(f"step {ev['step']}/{ev.get('total')}: {nums}", flush=True)
                elif ev["type"] in ("error", "warning"):
                    print(f"{ev['type']}: {ev['message']}", file=sys.stderr, flush=True)
                elif ev["type"] in ("finished", "stopped"):
                    print(f"{ev['type']}: adapter in {ev.get('adapter')}", flush=True)

        shower = threading.Thread(target=show, daemon=True)
        shower.start()
    try:
        return worker.run(path, owns_pid=main)
    finally:
        done.set()
        if main:
            shower.join(10)  # the last events printed
        if fd is not None:
            os.close(fd)
