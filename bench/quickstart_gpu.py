"""The SFT quick-start preset on CUDA in NF4, through the CLI, with SEBP on and off.

Where the embedded model's weights (a 98 MB GGUF) are not at hand, this builds
SmolLM2-135M's architecture with random weights from its config and tokenizer (a folder
with the embedded model's config.json and tokenizer files, `--src`) and runs `edgetune train --preset sft-quickstart` against it. What it checks on
CUDA: the whole pipeline (worker process, NF4, LoRA, autocast, fused AdamW, events,
checkpoints, adapter), step time and peak memory, that SEBP on and off give the same
loss curve, and the packed run (flex_attention + Liger, the CUDA defaults for packing).

    python bench/quickstart_gpu.py --src .ref/smollm2 [--steps N] [--tiny]     # writes $OUT/quickstart_gpu.json

`--presets NAME[,NAME]` instead runs those presets exactly as a user gets them (the real
embedded model: run `bash bench/gpu_learning_env.sh` first, see its header) and writes
$OUT/quickstart_presets-<names>.json: wall time, step time, peak GPU memory, final metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_random_model(src: Path, out: Path, tiny: bool) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(src)
    if tiny:
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 64, 128
        cfg.num_attention_heads, cfg.num_key_value_heads = 4, 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def train(model_dir: Path | None, runs: Path, name: str, sets: list[str], preset: str = "sft-quickstart") -> dict:
    cmd = [sys.executable, "-m", "edgetune.engine.cli", "train", "--preset", preset, "--runs-dir", str(runs),
           "--name", name]
    if model_dir is not None:
        cmd += ["--set", f"model.name={model_dir}"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    events = [json.loads(l) for l in (runs / name / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["type"] == "step"]
    times = [b["elapsed"] - a["elapsed"] for a, b in zip(steps, steps[1:])]
    times.sort()
    return {
        "returncode": p.returncode, "stderr_tail": p.stderr[-800:] if p.returncode else "",
        "wall_s": round(wall, 1), "last_event": events[-1]["type"],
        "device": next((e["device"] for e in events if e["type"] == "started"), None),
        "losses": [round(e["loss"], 6) for e in steps if "loss" in e],  # ESSA's steps have fitness instead
        "eval_losses": [round(e["eval_loss"], 6) for e in events if e["type"] == "eval" and "eval_loss" in e],
        "median_step_s": round(times[len(times) // 2], 4) if times else None,
        "peak_gpu_bytes": max((e["gpu"]["peak"] for e in events if (e.get("gpu") or {}).get("peak")), default=0),
        "metrics": events[-1].get("metrics", {}),
        "adapter": (runs / name / "adapter" / "adapter_model.safetensors").is_file(),
        "worker_log": [l for l in _read(runs / name / "worker.log").splitlines() if l.startswith("liger:")],
    }


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=str(ROOT / ".ref" / "smollm2"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=0, help="override sft.steps (0 = the preset's)")
    ap.add_argument("--only", choices=("sebp_on", "sebp_off", "packed"), help="run just one of them")
    ap.add_argument("--presets", default="", help="comma-separated presets to run as they are, on the real model")
    a = ap.parse_args()
    if a.presets:
        return run_presets(a.presets.split(","))
    if a.tiny and not a.steps:
        a.steps = 6
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    model_dir = work / "smollm2-random"
    build_random_model(Path(a.src), model_dir, a.tiny)
    steps = [f"sft.steps={a.steps}", f"sft.eval_every={max(1, a.steps // 4)}"] if a.steps else []
    res = {"date": time.strftime("%Y-%m-%d"), "tiny": a.tiny, "steps_override": a.steps}
    # packed: the engine's defaults on CUDA for packed rows (flex_attention, Liger, autocast)
    for key, extra in (("sebp_on", ["sft.sebp=true"]), ("sebp_off", ["sft.sebp=false"]),
                       ("packed", ["sft.packing=true"])):
        if a.only and key != a.only:
            continue
        res[key] = train(model_dir, work / "runs", key, steps + extra)
        # Written after each run: a time limit must not lose the first.
        (out_dir / "quickstart_gpu.json").write_text(json.dumps(res, indent=2))
    if a.only:
        return
    on, off = res["sebp_on"]["losses"], res["sebp_off"]["losses"]
    res["max_loss_diff_on_vs_off"] = max((abs(x - y) for x, y in zip(on, off)), default=None)
    (out_dir / "quickstart_gpu.json").write_text(json.dumps(res, indent=2))
    print("| run | rc | device | median s/step | peak GPU GiB | first loss | last loss | eval losses |")
    print("|---|---|---|---|---|---|---|---|")
    for k in ("sebp_on", "sebp_off", "packed"):
        r = res[k]
        print(f"| {k} | {r['returncode']} | {r['device']} | {r['median_step_s']} | "
              f"{r['peak_gpu_bytes'] / 2**30:.3f} | {r['losses'][0] if r['losses'] else '-'} | "
              f"{r['losses'][-1] if r['losses'] else '-'} | {r['eval_losses']} |")
    print(f"max |loss(SEBP on) - loss(SEBP off)| over the curve: {res['max_loss_diff_on_vs_off']}")


def run_presets(names: list[str]) -> None:
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp())
    path = out_dir / f"quickstart_presets-{'-'.join(names)}.json"
    if path.exists():
        raise SystemExit(f"{path} exists: set OUT to another folder (nothing is overwritten)")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    res = {"date": time.strftime("%Y-%m-%d")}
    for name in names:
        res[name] = train(None, work / "runs", name, [], preset=name)
        path.write_text(json.dumps(res, indent=2))
        r = res[name]
        print(f"| {name} | {r['returncode']} | {r['last_event']} | {r['device']} | {r['wall_s']} s | "
              f"{r['median_step_s']} s | {r['peak_gpu_bytes'] / 2**30:.3f} GiB | {json.dumps(r['metrics'])[:300]} |",
              flush=True)


if __name__ == "__main__":
    main()
