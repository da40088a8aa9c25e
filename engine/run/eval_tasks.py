"""How an evaluation task is named (`edgetune eval --task`, the app's Evaluate tab): the
config's held-out split, a task file's path, or a harness task behind HARNESS_PREFIX.
Imports nothing heavy: the app builds its task lists with it."""

from __future__ import annotations

HELD_OUT = "held-out"
HARNESS_PREFIX = "lm:"  # lm:TASK = an lm-evaluation-harness task (engine/run/harness.py)


def task_list(held_out: bool, files: list[str], harness: list[str]) -> list[str]:
    """The tasks of an evaluation: the held-out split (when asked), each file, each harness
    task (the prefix added where it is missing); blanks dropped, each once."""
    out = [HELD_OUT] if held_out else []
    out += [f.strip() for f in files if f.strip()]
    out += [h if h.startswith(HARNESS_PREFIX) else HARNESS_PREFIX + h for h in (x.strip() for x in harness) if h]
    return list(dict.fromkeys(out))
