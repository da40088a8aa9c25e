"""What to tell the user when the GPU runs out of memory in a step: the setting to lower
first, and what the planner (engine/planning/planner.py) predicts with it lowered.

The levers are the method's record's `oom_levers` (engine/core/methods.py), in the order
worth trying (each changes memory, not the maths of the update, except a shorter
max_seq_len / max_new_tokens, which is why they come last); the one named first is the one
the planner says saves most.
"""

from __future__ import annotations

import copy
import math

from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.settings import Config
from edgetune.engine.core.units import size


def _get(cfg: Config, key: str):
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def _levers(cfg: Config) -> list[tuple[str, object]]:
    """The method's levers (its record's `oom_levers`) that can still go down, each with the
    value one piece of advice sets: a switch's value, or half of a number above its floor."""
    out: list[tuple[str, object]] = []
    for lever in RECORDS[cfg.method].oom_levers:
        value = _get(cfg, lever.setting)
        if lever.to is not None:
            if value != lever.to:
                out.append((lever.setting, lever.to))
            continue
        if value == 0 and lever.zero_means:  # 0 = all at once: the product of those settings
            value = math.prod(_get(cfg, k) for k in lever.zero_means)
        if value > lever.floor:
            out.append((lever.setting, max(lever.floor, value // 2)))
    return out


def _set(cfg: Config, key: str, value) -> Config:
    c = copy.deepcopy(cfg)
    group, name = key.split(".")
    setattr(getattr(c, group), name, value)
    return c


def _peak(cfg: Config) -> float | None:
    from edgetune.engine.planning.planner import estimate

    try:
        return estimate(cfg, device="cuda")["total"]
    except Exception:  # noqa: BLE001 - the advice stands without the numbers
        return None


def advice(cfg: Config, step: int | None, last_checkpoint: int | None) -> str:
    """One line: where it ran out, what to lower (with the planner's numbers), what is kept."""
    where = f"in step {step + 1}" if step is not None else "while training"
    kept = f"checkpoints up to step {last_checkpoint} are kept" if last_checkpoint else "no checkpoint was written yet"
    levers = _levers(cfg)
    if not levers:
        peak = _peak(cfg)
        return f"out of GPU memory {where}: the planner's estimate is {size(peak) if peak else 'unknown'}; choose a smaller model " \
               f"or a card with more memory ({kept})"
    now = _peak(cfg)
    # The lever the planner says saves most; ties keep the order above.
    peaks = [_peak(_set(cfg, k, v)) for k, v in levers]
    best = min(range(len(levers)), key=lambda i: (peaks[i] if peaks[i] is not None else float("inf"), i))
    key, value = levers[best]
    lowered = peaks[best]
    numbers = f" (the planner estimates {size(lowered)} peak, against {size(now)} now)" if lowered and now else ""
    others = ", ".join(k for i, (k, _) in enumerate(levers) if i != best)
    more = f"; then {others}" if others else ""
    return (f"out of GPU memory {where}: set {key}={_value(value)}{numbers}{more}, and train again "
            f"(edgetune estimate checks a setting before a run; {kept})")


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
