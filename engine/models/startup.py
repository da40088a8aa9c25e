"""A run's start-up (imports, base-model load, LoRA) made shorter without changing what it does.

Two things, both undone before the first training step:

* The cyclic garbage collector is paused. Importing torch / transformers / peft and loading
  a model allocate millions of long-lived objects (modules, functions, tensors' Python
  wrappers); each full collection walks all of them and finds almost nothing to free
  (seconds of pauses before a 7B model's first step; bench/README.md). Reference
  counting still frees everything that is not in a cycle, so memory grows only by the few
  cycles start-up makes, collected once the collector is back. The objects of the imports
  are frozen (gc.freeze) after them: they stay for the whole process, and no collection
  during training walks them again. engine/run/worker.run pauses the collector for its imports
  (imports_done ends the pause), engine/models/model.load for the load and the LoRA (paused_gc).
* peft is imported on a side thread while the main thread reads the base weights (file
  reads and host-to-GPU copies release the GIL). Its error, if any, is raised in the
  thread that waits for it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import threading
from pathlib import Path


def kernel_caches(root: Path) -> None:
    """What a run compiles and measures once, kept under the edgetune cache (`$EDGETUNE_CACHE`)
    for every later run of the same shapes: Triton's compiled kernels and its autotuning
    results, torch.compile's (inductor's) compiled graphs. Set before torch is imported, as
    defaults: a cache folder the user chose for either stays theirs. SEBP's backend choices
    go there too (`remember_measurements`). Where each cache pays: docs/performance.md."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))


def remember_measurements(root: Path) -> None:
    """SEBP's per-layer backend choices read from and kept in `root`/sebp (kernels/sebp.py)."""
    from edgetune.kernels import sebp

    sebp.remember_choices(root / "sebp")


_paused = [False]  # whether pause_gc turned the collector off (and resume_gc must turn it on)


def pause_gc() -> None:
    """Disable the cyclic collector for the start-up, if it is on; resume_gc undoes it."""
    if gc.isenabled():
        gc.disable()
        _paused[0] = True


def resume_gc() -> None:
    """Turn the collector back on if pause_gc turned it off (idempotent)."""
    if _paused[0]:
        _paused[0] = False
        gc.enable()


def imports_done() -> None:
    """End the pause begun for a process's imports: every object alive now (the modules,
    classes and functions, which live as long as the process anyway) moves out of the
    collector's reach for good (gc.freeze), so no collection during training walks them
    again, and the collector is back on. The few reference cycles the imports left
    behind stay too: a fixed cost, paid once, before any model weight exists."""
    if _paused[0]:  # nothing collected or promoted since the pause began
        gc.freeze()
    resume_gc()


@contextlib.contextmanager
def paused_gc():
    """The collector off inside the block, back on after it (also on an error). A block
    inside an earlier pause leaves it to whoever began it. Not frozen at the end: for a
    block that loads a model, a reference cycle holding a tensor would keep its memory
    to the end of the process."""
    was_paused = _paused[0]
    pause_gc()
    try:
        yield
    finally:
        if not was_paused:
            resume_gc()


class BackgroundImport:
    """Import modules on a daemon thread; wait() returns when they are imported, raising
    the thread's error in the caller.

    Two threads importing at once take Python's per-module import locks; when they would
    wait on each other (a circular import across them), importlib raises a deadlock error
    in one of them. That case only is retried on the calling thread, where the import then
    proceeds as it would have without the side thread."""

    def __init__(self, *names: str):
        self.names, self.error = names, None
        self.thread = threading.Thread(target=self._run, name="edgetune-import", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for name in self.names:
                importlib.import_module(name)
        except BaseException as e:  # handed to wait()
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        e, self.error = self.error, None
        if e is None:
            return
        if isinstance(e, RuntimeError) and "deadlock" in str(e).lower():
            for name in self.names:
                importlib.import_module(name)
            return
        raise e
