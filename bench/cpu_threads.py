#!/usr/bin/env python3
"""Torch's CPU thread count for the embedded model: a preset trained through the CLI, as a
user runs it, once per thread count and round (A B A B ...: a slow window of a shared
machine hits every count alike), OMP_NUM_THREADS set explicitly for each.

    python bench/cpu_threads.py --threads 1,2 --rounds 2 --out OUT -- --preset sft-quickstart --set sft.steps=6

Per run, from its events.jsonl: seconds from the `started` event to the first step and to
the last, the median seconds between consecutive steps, the losses (the same for every
count, or the thread count changed what is computed). Writes OUT/cpu_threads.json and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def load_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_run(threads: int, cli_args: list[str], runs_dir: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    name = f"threads{threads}-{int(time.time())}"
    t0 = time.time()
    cli = Path(sys.executable).parent / "edgetune"
    done = subprocess.run([str(cli), "train", "--name", name, "--runs-dir", runs_dir, *cli_args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"threads {threads}: edgetune train failed:\n{done.stderr[-3000:]}")
    wall = time.time() - t0
    events = load_events(Path(runs_dir) / name / "events.jsonl")
    started = next(e for e in events if e["type"] == "started")
    steps = [e for e in events if e["type"] == "step"]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    return {"threads": threads, "worker_threads": started.get("cpu_threads"), "wall_s": round(wall, 1),
            "first_step_s": round(steps[0]["time"] - started["time"], 1),
            "last_step_s": round(steps[-1]["time"] - started["time"], 1),
            "median_step_s": round(statistics.median(gaps), 2) if gaps else None,
            "losses": [e.get("loss") for e in steps], "load_avg": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the arguments of `edgetune train`")
    a = p.parse_args()
    cli = [x for x in a.cli if x != "--"]
    counts = [int(x) for x in a.threads.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    runs_dir = str(out / "runs")  # kept: each run's events.jsonl and worker.log
    for r in range(a.rounds):
        for n in counts:
            row = {"round": r + 1, **one_run(n, cli, runs_dir)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "cpu_threads.json").write_text(json.dumps(
                {"cli": cli, "cores": os.cpu_count(), "rows": rows}, indent=1))
    print("\n| threads | round | first step after start (s) | median s/step | whole run (s) | load avg (1 min) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['threads']} | {row['round']} | {row['first_step_s']} | {row['median_step_s']} | "
              f"{row['wall_s']} | {row['load_avg'][0]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
