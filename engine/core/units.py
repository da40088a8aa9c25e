"""How sizes and durations read wherever edgetune shows them (CLI, app, messages): one
format each, so the same number looks the same on every screen. Imports nothing heavy."""

from __future__ import annotations

GiB = 2**30
MiB = 2**20


def size(n) -> str:
    """Bytes as GiB with two decimals, or whole MiB below one GiB; what is not a number as it is."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return str(n)
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def duration(seconds) -> str:
    """Seconds as "45s", "3m 05s" or "2h 07m"; "–" when unknown."""
    if seconds is None:
        return "–"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"
