"""The one event stream of a run: `runs/<name>/events.jsonl`, one JSON object a line.

Every event has `i` (0-based index in the file), `time` (unix seconds) and `type`.
The app, the CLI's progress bar and a reader after a page reload all read this file;
nothing else passes between the worker and its readers.

Types and their fields (fields a method does not have are left out):

- `started`   method, run, config (dict), device, resumed_from (step or null), total (steps);
              world_size when the run trains on several ranks (engine/core/distributed.py)
- `phase`     phase: loading, data_check, initial_eval, warm_start, training, final_eval or
              export, at its start; a long phase repeats it with done, total and unit
              (e.g. initial_eval 12/30 prompts); words for it in engine/core/phases.py
- `step`      step, total, loss (SFT) / reward_mean, reward_std, success_rate, ... (F-GRPO)
              / best, mean, std, sigma, best_so_far (ESSA generation), lr, grad_norm,
              tokens_per_s, elapsed (s), eta (s), gpu (see below), host_rss (bytes); on
              several ranks also ranks: [{rank, gpu, host_rss, step_s}, ...], each rank's
              memory and seconds since its last logged step
- `eval`      step, and the method's held-out metrics: eval_loss (SFT),
              pass@1 / pass@k / success_rate (F-GRPO), reward (ESSA)
- `comparison` F-GRPO: a, b ("the base", "the adapter"), metric, kind, n, difference, low,
              high, p_value, needed, better, worse, words: the final adapter against the base on
              the same held-out prompts, paired (engine/training/stats.py), one per metric
- `candidate` ESSA only: generation, index, fitness, seconds
- `warm_start` ESSA only: an event of the warm-start SFT run (in `<run>/warm_start/`),
              its own type in `event`, its other fields unchanged
- `checkpoint` step, path
- `sample`    step, prompt, completion, reward (optional)
- `samples`   step, samples: [{prompt, completion, reference}, ...]: held-out prompts with
              the model's greedy completion and the reference answer, at each evaluation
              (sft.samples / fgrpo.samples of them)
- `more_steps` setting (sft.steps or fgrpo.steps), from, to, schedule: the run was given
              more steps (`edgetune resume --more-steps`; config.yaml holds `to`); its
              learning-rate schedule keeps decaying over `schedule` steps, then stays flat
- `warning`   message
- `error`     message (one line for the user), kind ("input" = bad input, "bug",
              "killed"); a traceback, if any, is in worker.log
- `stopped`   step: a graceful stop finished the step and saved the adapter
- `finished`  step, adapter (path), metrics (dict of final numbers), elapsed

`gpu` is {allocated, reserved, peak, total} in bytes (all 0 on the CPU).
A run whose last event is `finished`, `stopped` or `error` is over; one whose worker
is gone without such an event crashed (see engine/run/api.py `status`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

from edgetune.engine.core.runfolder import open_append

TERMINAL = ("finished", "stopped", "error")


class EventWriter:
    """Appends events; each is flushed and fsynced so a crash loses nothing written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        events = read_events(self.path)
        self.count = events[-1]["i"] + 1 if events else 0
        self._f = open_append(self.path)  # never through a symbolic link planted in a copied run folder
        # A writer killed mid-line left no newline: start on a fresh line so that line
        # stays one damaged line instead of swallowing our first event.
        if self._f.seek(0, os.SEEK_END) > 0:
            self._f.seek(-1, os.SEEK_END)
            if self._f.read(1) != b"\n":
                self._f.write(b"\n")

    def emit(self, type: str, **fields) -> dict:
        event = {"i": self.count, "time": round(time.time(), 3), "type": type, **fields}
        self._f.write((json.dumps(event, default=_jsonable) + "\n").encode("utf-8"))
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


def schedule_steps(events: list[dict]) -> int | None:
    """The steps a run's learning-rate schedule decays over when it was given more steps
    (its last `more_steps` event), else None (its configured steps)."""
    more = [e for e in events if e["type"] == "more_steps" and isinstance(e.get("schedule"), int)]
    return more[-1]["schedule"] if more else None


def started_config(events: list[dict]) -> dict:
    """The settings a run's last attempt started with (its last `started` event), or {}."""
    started = [e for e in events if e["type"] == "started"]
    config = started[-1].get("config") if started else None
    return config if isinstance(config, dict) else {}


def scan_events(path: str | os.PathLike, start: int = 0) -> tuple[list[dict], int]:
    """(events with index `i` >= `start`, number of damaged lines skipped). A last line
    without its newline is being written (or was cut by a crash) and is left for later;
    a complete line that is not an event (a crash mid-write, then more events after it)
    is skipped and counted, so it never hides what follows."""
    path = Path(path)
    if not path.exists():
        return [], 0
    out, damaged = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                ev = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                ev = None
            if not isinstance(ev, dict) or not isinstance(ev.get("i"), int) or "type" not in ev:
                damaged += raw.strip() != b""
                continue
            if ev["i"] >= start:
                out.append(ev)
    return out, damaged


def read_events(path: str | os.PathLike, start: int = 0) -> list[dict]:
    """All complete events with index `i` >= `start` (damaged lines are skipped)."""
    return scan_events(path, start)[0]


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
