"""How many CPU threads torch uses in the processes edgetune starts (a run's worker, the
chat worker, the data check, an isolated export): the environment every one of them is
started with. No torch here: the app and the CLI call it before the worker imports torch.

The embedded model is small: its matrix products are too short for many threads to share,
and a thread that waits on a core taken by something else (the app, the chat worker, the
other rank of a test run, any other job) holds up all the others at every product. On a
2-core machine one thread is the measured choice; a loaded machine is where two threads
lose most (bench/README.md, "CPU threads on 2 cores"). Larger machines get half
their cores, leaving the other half to what runs beside the worker (not measured there),
shared out among the processes of one run (the ranks of a run on several GPUs). A thread
count the user sets (OMP_NUM_THREADS) is kept.
"""

from __future__ import annotations

import os


def torch_threads(cores: int | None = None, processes: int = 1) -> int:
    """Threads for each of `processes` processes of one run on a machine of `cores` CPU
    cores (this one's by default)."""
    cores = cores if cores is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                             else os.cpu_count() or 1)
    return max(1, cores // 2 // max(1, processes))


def worker_env(base: dict | None = None, processes: int = 1, **extra: str) -> dict:
    """`base` (os.environ by default) with `extra`, and OMP_NUM_THREADS set to
    torch_threads() for `processes` processes unless it is set already."""
    env = dict(os.environ if base is None else base, **extra)
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(torch_threads(processes=processes))
    return env
