#!/usr/bin/env python3
"""Held-out curves from the event files of learning runs: one table and one plot.

`bench/learning.py --curve-every N` makes F-GRPO / GRPO and ESSA runs evaluate the held-out
split while they train; a run stopped at a deadline keeps those points only in its events.
This script reads them back from each run's events file (`<task>-<method>.jsonl` or a run
folder's `events.jsonl`, named by its folder) and writes, per task, held-out greedy success
(and pass@k where measured) against the step or generation.

    python bench/learning_curves.py bench/results/<...>/curves/*.jsonl --out bench/results/<...>/curves
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning  # noqa: E402  (the same reading of events as the benchmark's report)


def run_name(path: Path) -> tuple[str, str]:
    """(task, method) from 'gcd-fgrpo.jsonl' or '.../runs/gcd-fgrpo/events.jsonl'."""
    stem = path.parent.name if path.name == "events.jsonl" else path.stem
    task, _, method = stem.rpartition("-")
    if task not in learning.TASKS or method not in learning.LABELS:
        raise SystemExit(f"{path}: not named <task>-<method> (task from {', '.join(learning.TASKS)})")
    return task, method


def read(paths: list[Path]) -> dict:
    """task -> method -> held-out points [{step, held_out, pass@k...}]."""
    out: dict = defaultdict(dict)
    for p in paths:
        task, method = run_name(p)
        out[task][method] = learning.held_out_points(learning.curve_of_events(p))
    return out


def table(curves: dict, k: int) -> str:
    lines = [f"Held-out greedy success while training (pass@{k} in brackets where measured), "
             "by step (F-GRPO / GRPO) or generation (ESSA):", ""]
    for task, methods in curves.items():
        for method, pts in methods.items():
            lines.append(f"- {task} {learning.LABELS[method]}: {learning.held_out_cells(pts, k)}")
    return "\n".join(lines) + "\n"


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(curves)
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        learning.draw_held_out(ax, curves[task])
        ax.set_title(task + (" (kept aside)" if task == learning.KEPT_ASIDE else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("events", nargs="+", type=Path)
    p.add_argument("--k", type=int, default=4, help="the pass@k the runs measured")
    p.add_argument("--out", type=Path, required=True, help="folder for curves.md and curves.png")
    a = p.parse_args(argv)
    missing = [str(f) for f in a.events if not f.is_file()]
    if missing:
        raise SystemExit(f"no such events file: {missing[0]}")
    curves = read(a.events)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in ("curves.md", "curves.png"):
        if (a.out / name).exists():
            raise SystemExit(f"{a.out / name} exists: choose another --out (nothing was written)")
    text = table(curves, a.k)
    plot(curves, a.out / "curves.png")  # first: the report is written only once its plot is
    (a.out / "curves.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
