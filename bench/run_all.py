#!/usr/bin/env python3
"""Every GPU benchmark in groups of under 10 minutes each (one GPU command each).

    small (~8 min):      sebp.py --quick, planner_check.py (0.5B), essa.py, rollouts.py
    training (~8 min):   sft_speed.py (HF, ours lever by lever in two runs each, checkpointing
                         auto at 12 / 24 GiB, Unsloth twice; ~450 s on the H200)
    big (~9 min):        big72b.py (72B build, HF and ours at 2k, no-checkpointing 2k, two
                         32k steps), big72b_methods.py (an F-GRPO step and an ESSA generation
                         at 72B inside 80 GB, ~150 s), quant_cache_gpu.py (first vs cached load)
    essentials (~10 min): the quick start on CUDA, ESSA's population, the SFT step, when
                         only one command fits
    report:              tables (see bench/README.md) from the groups' JSON, on any machine

Each bench runs in its own process (Unsloth patches transformers on import; a crash or a
CUDA OOM in one must not take the others down) with a wall-clock cap taken from what is
left of the group's budget; the ones that self-limit get a --time-limit / --budget inside
their cap, so they end with their JSON written. The most expensive bench of each group runs
last and gets whatever the cheaper ones left. Everything lands in $OUT (at most 8 files
come back: one JSON per bench plus this script's log).

    export PYTHONPATH=$PWD/.gpu-site:$PYTHONPATH
    python bench/run_all.py --group small 2>&1 | tee $OUT/run_all.log   # GPU; then --group training
    python bench/run_all.py --report DIR1 DIR2   # here: tables from the fetched files
    python bench/run_all.py --group small --tiny   # CPU check of the plumbing (tiny configs)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (name, script, extra args, cap seconds, argument that passes an inner time limit or None)
# Walls measured on the H200 (2026-11-30): sebp --quick 60 s (cut at its cap after the
# tiny-model check and one shape), planner_check 58 s, essa 65 s, rollouts ~5 min with
# both `generate` baselines (46 s without them), sft_speed 273 s (Unsloth's save
# overlapped with our build, its own phase ~90 s), big72b 151 s (build 1.4 s, two 32k steps).
GROUPS = {
    "small": [("sebp", "sebp.py", ["--quick"], 60, None),
        ("planner_check", "planner_check.py", [], 90, "--time-limit"),
        ("essa", "essa.py", ["--population", "16", "--sequential-candidates", "2"], 110, None),
        ("rollouts", "rollouts.py", [], 340, "--budget")],
    "training": [("sft_speed", "sft_speed.py", [], 560, "--time-limit")],
    "big": [("big72b_methods", "big72b_methods.py", [], 200, "--time-limit"),
        ("quant_cache_gpu", "quant_cache_gpu.py", [], 150, None),
        ("big72b", "big72b.py", ["--max-build-s", "180"], 240, "--time-limit")],
    # What one GPU command holds when only one fits: the quick start on CUDA, ESSA's
    # sequential vs batched population, and the SFT step.
    "essentials": [("quickstart_gpu", "quickstart_gpu.py", ["--steps", "20"], 90, None),
        ("essa", "essa.py", ["--population", "16", "--sequential-candidates", "2"], 130, None),
        ("sft_speed", "sft_speed.py", [], 420, "--time-limit")],
}
TINY_ARGS = {"sebp": ["--dry-run"]}  # sebp.py's CPU mode has its own name


def run_group(group: str, budget: float, tiny: bool, out: Path, skip: set) -> dict:
    t0 = time.perf_counter()
    steps = [s for s in GROUPS[group] if (HERE / s[1]).is_file() and s[0] not in skip]
    status = {}
    env = dict(os.environ, OUT=str(out), PYTHONUNBUFFERED="1")
    for i, (name, script, extra, cap, limit_flag) in enumerate(steps):
        left = budget - (time.perf_counter() - t0)
        # keep ~45 s for each later bench (so each at least starts and writes its JSON)
        later = 45 * (len(steps) - i - 1)
        wall = max(20.0, min(cap, left - later) if i < len(steps) - 1 else left)
        if left < 20:
            status[name] = {"rc": "skipped: no time left"}
            continue
        argv = [sys.executable, str(HERE / script), *extra]
        if tiny:
            argv += TINY_ARGS.get(name, ["--tiny"])
        if limit_flag:
            argv += [limit_flag, str(max(10, int(wall - 25)))]  # inner limit: room for imports and the JSON
        print(f"\n######## [{time.perf_counter() - t0:5.0f}s] {name}: cap {wall:.0f}s: {' '.join(argv[1:])}",
              flush=True)
        t = time.perf_counter()
        # own process group: a bench's own children (Unsloth's phases) go down with it
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=wall)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        status[name] = {"rc": rc, "wall_s": round(time.perf_counter() - t, 1), "cap_s": round(wall)}
        print(f"######## {name}: {status[name]}", flush=True)
    status["total_s"] = round(time.perf_counter() - t0, 1)
    (out / f"run_all_{group}.json").write_text(json.dumps(status, indent=1))
    return status


# --------------------------------------------------------------------------- report


def load(dirs, name):
    for d in dirs:
        f = Path(d) / name
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except ValueError:
                return None
    return None


def other_table(name: str, r: dict) -> str:
    """The other benches print their own tables; rebuild ESSA's from its JSON, show the
    others' JSON (their logs in run_all's output hold the printed tables)."""
    if isinstance(r.get("table"), str):
        return r["table"]
    if name == "essa.json":
        try:
            sys.path.insert(0, str(HERE))
            import essa  # noqa: PLC0415

            return essa.table(r)
        except Exception as e:  # noqa: BLE001
            return f"(essa table failed: {e}) {json.dumps(r, default=str)[:2000]}"
    return json.dumps(r, default=str)[:3000]


def report(dirs) -> str:
    out = []
    sft = load(dirs, "sft_speed.json")
    if sft:
        out += ["## SFT step", "", sft.get("table", "(no table: see errors)"), ""]
    big = load(dirs, "big72b.json")
    if big:
        out += ["## 72B", "", big.get("table", "(no table)"), ""]
    methods = load(dirs, "big72b_methods.json")
    if methods:
        out += ["## F-GRPO and ESSA at 72B", "", methods.get("table", "(no table)"), ""]
    for name, title in (("rollouts.json", "Rollouts"), ("essa.json", "ESSA"), ("sebp.json", "SEBP")):
        r = load(dirs, name)
        if r:
            out += [f"## {title}", "", other_table(name, r), ""]
    # the planner table over every group's rows: planner_check re-plans them on this machine
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "planner-report"
    tmp.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(HERE / "planner_check.py"), "--collect-only", "--out", str(tmp)]
    for d in dirs:
        argv += ["--from", str(d)]
    subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    pc = load([tmp], "planner_check.json")
    if pc:
        out += ["## Memory planner vs measured peak", "", pc.get("table", ""), ""]
    for d in dirs:
        for f in sorted(Path(d).glob("run_all*.json")):
            out.append(f"{f.stem} ({d}): {f.read_text().strip()}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", choices=sorted(GROUPS))
    ap.add_argument("--report", nargs="*", metavar="DIR", help="folders holding the fetched JSON of the groups")
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for this group (one GPU command may take 600)")
    ap.add_argument("--skip", default="", help="comma list of benches to leave out (e.g. sebp,rollouts)")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    if a.group:
        run_group(a.group, a.budget, a.tiny, out, set(filter(None, a.skip.split(","))))
        print("\n" + report([out]), flush=True)
    elif a.report is not None:
        print(report(a.report or [out]))
    else:
        ap.error("--group NAME or --report DIR ...")


if __name__ == "__main__":
    main()
