#!/usr/bin/env python3
"""ESSA's held-out gain over its warm start, from the event files of learning runs.

`bench/learning_search.sh` copies every run's events to OUT/<part>/logs/<group>/; a run its
deadline stopped during the final `edgetune eval` still holds the held-out evaluations it
made while searching (`--curve-every`). This reads them back: per setting (the group's name
less its `_seed<N>`) and task, the first point (generation 0: the warm start) and the last
generation reached, and prints the mean gain over seeds with each seed's in brackets.
Those in-search evaluations use the run's own held-out questions and ESSA's own completion
cap; where a final `edgetune eval` exists too they gave the same figures.

    python bench/essa_gains.py bench/results/<...>/essa-relative/logs
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning  # noqa: E402  (the same reading of events as the benchmark's report)


def gains(logs: Path) -> dict:
    """(setting, task) -> {seed: (warm start, last, last generation)}."""
    out: dict = defaultdict(dict)
    for ev in sorted(logs.glob("*/*-essa/runs/*-essa/events.jsonl")):
        group, task = ev.parts[-5], ev.parts[-4].removesuffix("-essa")
        m = re.fullmatch(r"(.+)_seed(\d+)", group)
        if m is None or task not in learning.TASKS:
            raise SystemExit(f"{ev}: expected logs/<setting>_seed<N>/<task>-essa/...")
        pts = learning.held_out_points(learning.curve_of_events(ev))
        if len(pts) >= 2 and pts[0]["step"] == 0:
            out[(m[1], task)][int(m[2])] = (pts[0]["held_out"], pts[-1]["held_out"], pts[-1]["step"])
    return out


def table(g: dict, target: float) -> str:
    settings = sorted({s for s, _ in g})
    tasks = [t for t in learning.TASKS if any((s, t) in g for s in settings)]
    # (setting, task) -> each seed's gain in points, in seed order
    gain = {key: [100 * (b - a) for a, b, _ in (per[k] for k in sorted(per))] for key, per in g.items()}
    lines = ["| task | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for t in tasks:
        cells = []
        for s in settings:
            if (s, t) not in gain:
                cells.append("not run")
                continue
            d, gens = gain[(s, t)], sorted({n for *_, n in g[(s, t)].values()})
            cells.append(f"{statistics.mean(d):+.1f} ({', '.join(f'{x:+.0f}' for x in d)})"
                         + ("" if len(gens) == 1 else f" gen. {gens[0]}-{gens[-1]}"))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    n = {s: sum(statistics.mean(gain[(s, t)]) >= 100 * target
                for t in tasks if (s, t) in gain and t != learning.KEPT_ASIDE) for s in settings}
    lines.append(f"| benchmark tasks with a mean gain ≥ +{100 * target:.0f} | "
                 + " | ".join(str(n[s]) for s in settings) + " |")
    reached = sorted({n for per in g.values() for *_, n in per.values()})
    lines.append("\nLast generation reached: " + (f"{reached[0]} in every run" if len(reached) == 1
                                                   else f"{reached[0]} to {reached[-1]} (marked where a cell mixes them)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", type=Path, help="a learning_search.sh part's logs folder")
    ap.add_argument("--target", type=float, default=0.08, help="gain to count tasks at (default 0.08)")
    a = ap.parse_args(argv)
    g = gains(a.logs)
    if not g:
        raise SystemExit(f"{a.logs}: no ESSA run with held-out points from generation 0 on")
    print("Held-out greedy gain of ESSA over its warm start, points: mean over seeds (per seed), "
          "at the last generation each run reached\n")
    print(table(g, a.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
