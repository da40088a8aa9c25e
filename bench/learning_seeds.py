"""Learning benchmark over several seeds: mean held-out figures per task and method.

One `bench/learning.py` run is one seed: one train/held-out split of 50 questions and one
training run per method, whose held-out rates move by ±7 points from noise alone. This
script pools runs made with different `--seed` values (each seed draws its own split and
its own base figure) and prints, per task and setting, the mean over seeds of greedy
success and pass@k, the mean gain over the same seed's base, and in how many seeds the
gain reaches a target. ESSA's gain is over its own warm start (the same run's
essa_warm_start figures), which its target is about; its "base" cell is that warm start.

    python bench/learning_seeds.py default=results/.../default/*.json \\
        mask_truncated=results/.../mask-truncated/*.json --base results/.../learning.json
    (a LABEL=FILE argument per file; the base figures come from every file that has them)

LABEL:METHOD=FILE takes only that method's figures from the file (and its base), so runs of one
method from several runs can be pooled under one label, e.g. GRPO from an earlier run's seeds
beside F-GRPO's at new settings: grpo6:grpo=old/seed0.json ... grpo6:grpo=new/seed4.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

# F-GRPO without its γ: a setting may change it (the label column says which)
NAMES = {"sft": "SFT", "fgrpo": "F-GRPO", "grpo": "GRPO γ=0", "essa": "ESSA"}


def load(files: list[tuple[str, str, Path]], methods: set[str]):
    """(label, method, task, seed) -> (greedy, pass@k) and (task, seed) -> base's.
    files: (label, the one method to take or "" for all, path)."""
    runs, base, k = {}, {}, None
    for label, only, path in files:
        try:
            d = json.loads(path.read_text())
            seed, k = d["args"]["seed"], d["args"]["eval_k"]
            for t in d["tasks"]:
                for m, v in t["methods"].items():
                    if v.get("success_rate") is None:
                        continue
                    fig = (v["success_rate"], v.get(f"pass@{k}"))
                    if m == "base":
                        base[(t["task"], seed)] = fig
                    elif label and only in ("", m.removesuffix("_warm_start")) and \
                            (m in methods or (m == "essa_warm_start" and "essa" in methods)):
                        runs[(label, m, t["task"], seed)] = fig
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a learning.json of bench/learning.py ({type(e).__name__}: {e})") from None
    return runs, base, k


def report(runs, base, k, target: float) -> str:
    pct = lambda x: f"{100 * x:.0f}"  # noqa: E731
    rows = defaultdict(dict)
    for (label, m, task, seed), fig in runs.items():
        if m != "essa_warm_start":
            rows[(task, label, m)][seed] = fig

    def ref(task, label, m, s):  # what a gain is measured from
        return runs.get((label, "essa_warm_start", task, s)) if m == "essa" else base.get((task, s))

    lines = [f"| task | setting | method | seeds | base (ESSA: its warm start) | greedy | gain (per seed) | "
             f"seeds with gain ≥ +{pct(target)} | pass@{k} |", "|---|---|---|---|---|---|---|---|---|"]
    for (task, label, m), by_seed in sorted(rows.items()):
        seeds = sorted(s for s in by_seed if ref(task, label, m, s) is not None)
        if not seeds:
            continue
        greedy = [by_seed[s][0] for s in seeds]
        start = [ref(task, label, m, s)[0] for s in seeds]
        gains = [g - b for g, b in zip(greedy, start)]
        passk = [by_seed[s][1] for s in seeds if by_seed[s][1] is not None]
        lines.append(
            f"| {task} | {label} | {NAMES[m]} | {len(seeds)} | {pct(statistics.mean(start))}% "
            f"| {pct(statistics.mean(greedy))}% | {100 * statistics.mean(gains):+.0f} "
            f"({', '.join(f'{100 * g:+.0f}' for g in gains)}) | {sum(g >= target - 1e-9 for g in gains)} of {len(seeds)} "
            f"| {f'{100 * statistics.mean(passk):.1f}%' if passk else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=FILE", help="a learning.json and the setting it ran")
    p.add_argument("--base", nargs="*", default=[], metavar="FILE", help="more files to take base figures from")
    p.add_argument("--target", type=float, default=0.15, help="the gain counted, as a rate")
    p.add_argument("--methods", default=",".join(NAMES), help=f"comma-separated, from {', '.join(NAMES)}")
    a = p.parse_args(argv)
    methods = set(a.methods.split(","))
    if methods - set(NAMES):
        p.error(f"unknown method: {', '.join(sorted(methods - set(NAMES)))}")
    files = [("", "", Path(f)) for f in a.base]
    for spec in a.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"{spec}: expected LABEL=FILE")
        label, _, only = label.partition(":")
        if only and only not in NAMES:
            p.error(f"{spec}: unknown method '{only}' (from {', '.join(NAMES)})")
        files.append((label, only, Path(path)))
    try:
        runs = load(files, methods)
    except ValueError as e:
        p.error(str(e))
    print(report(*runs, a.target))


if __name__ == "__main__":
    main()
