"""How an evaluation task is named (`edgetune eval --task`, the app's Evaluate tab): the
config's held-out split, a task file's path, or a harness task behind HARNESS_PREFIX.
Imports nothing heavy: the app builds its task lists with it."""

from __future__ import annotations

HELD_OUT = "held-out"
LARGE_TASK_PROMPTS = 1000  # a task file of more prompts is a long evaluation: the app asks before it starts
HARNESS_PREFIX = "lm:"  # lm:TASK = an lm-evaluation-harness task (engine/run/harness.py)


def task_list(held_out: bool, files: list[str], harness: list[str]) -> list[str]:
    """The tasks of an evaluation: the held-out split (when asked), each file, each harness
    task (the prefix added where it is missing); blanks dropped, each once."""
    out = [HELD_OUT] if held_out else []
    out += [f.strip() for f in files if f.strip()]
    out += [h if h.startswith(HARNESS_PREFIX) else HARNESS_PREFIX + h for h in (x.strip() for x in harness) if h]
    return list(dict.fromkeys(out))


def size_line(cfg, task: str, prompts: int, systems: int) -> str:
    """How much an evaluation of a task file of `prompts` prompts generates, in one line,
    said before it starts (a large file takes hours): the completions (a greedy one a
    prompt, and 2 x fgrpo.eval_k samples for pass@k) for each system, at most
    max_new_tokens each. Speeds per machine are on bench/README.md."""
    from edgetune.engine.core.methods import METHODS

    group = getattr(cfg, cfg.method) if METHODS[cfg.method].rewards else cfg.fgrpo
    each = 1 + (2 * cfg.fgrpo.eval_k if cfg.fgrpo.eval_k > 0 else 0)
    completions = prompts * each * systems
    return (f"{task}: {prompts:,} prompts x {systems} system{'s' if systems != 1 else ''} = {completions:,} "
            f"completions of up to {group.max_new_tokens} new tokens each (up to "
            f"{completions * group.max_new_tokens:,} tokens to generate; bench/README.md has generation speeds)")
