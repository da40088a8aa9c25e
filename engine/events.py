"""The one event stream of a run: `runs/<name>/events.jsonl`, one JSON object a line.

Every event has `i` (0-based index in the file), `time` (unix seconds) and `type`.
The app, the CLI's progress bar and a reader after a page reload all read this file;
nothing else passes between the worker and its readers.

Types and their fields (fields a method does not have are left out):

- `started`   method, run, config (dict), device, resumed_from (step or null), total (steps)
- `phase`     phase: loading, data_check, initial_eval, warm_start, training, final_eval or
              export, at its start; a long phase repeats it with done, total and unit
              (e.g. initial_eval 12/30 prompts); words for it in engine/phases.py
- `step`      step, total, loss (SFT) / reward_mean, reward_std, success_rate, ... (F-GRPO)
              / best, mean, std, sigma, best_so_far (ESSA generation), lr, grad_norm,
              tokens_per_s, elapsed (s), eta (s), gpu (see below), host_rss (bytes)
- `eval`      step, and the method's held-out metrics: eval_loss (SFT),
              pass@1 / pass@k / success_rate (F-GRPO), reward (ESSA)
- `candidate` ESSA only: generation, index, fitness, seconds
- `warm_start` ESSA only: an event of the warm-start SFT run (in `<run>/warm_start/`),
              its own type in `event`, its other fields unchanged
- `checkpoint` step, path
- `sample`    step, prompt, completion, reward (optional)
- `warning`   message
- `error`     message (one line for the user), kind ("input" = bad input, "bug",
              "killed"); a traceback, if any, is in worker.log
- `stopped`   step: a graceful stop finished the step and saved the adapter
- `finished`  step, adapter (path), metrics (dict of final numbers), elapsed

`gpu` is {allocated, reserved, peak, total} in bytes (all 0 on the CPU).
A run whose last event is `finished`, `stopped` or `error` is over; one whose worker
is gone without such an event crashed (see engine/api.py `status`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

TERMINAL = ("finished", "stopped", "error")


class EventWriter:
    """Appends events; each is flushed and fsynced so a crash loses nothing written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.count = len(read_events(self.path))
        self._f = open(self.path, "a", encoding="utf-8")

    def emit(self, type: str, **fields) -> dict:
        event = {"i": self.count, "time": round(time.time(), 3), "type": type, **fields}
        self._f.write(json.dumps(event, default=_jsonable) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.count += 1
        return event

    __call__ = emit

    def close(self) -> None:
        self._f.close()


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def read_events(path: str | os.PathLike, start: int = 0) -> list[dict]:
    """All complete events from index `start` on (a half-written last line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if n < start:
                continue
            if not line.endswith("\n"):
                break
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def follow(path: str | os.PathLike, start: int = 0, alive=lambda: True, poll: float = 0.2,
           timeout: float | None = None) -> Iterator[dict]:
    """Yield events from `start` as they are written, until a terminal event, or until
    `alive()` turns false and nothing more is written, or `timeout` seconds pass."""
    t0 = time.time()
    i = start
    while True:
        new = read_events(path, i)
        for ev in new:
            yield ev
            i = ev["i"] + 1
            if ev["type"] in TERMINAL:
                return
        if not new:
            if not alive():
                for ev in read_events(path, i):  # written between the two checks
                    yield ev
                    if ev["type"] in TERMINAL:
                        return
                return
            if timeout is not None and time.time() - t0 > timeout:
                return
            time.sleep(poll)
