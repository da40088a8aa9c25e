#!/usr/bin/env python3
"""Time to the first training step of a 7B bf16 checkpoint on disk, loaded in NF4: the
first run (read 15 GB, quantise, store the 4-bit weights in the cache) against the second
run of the same model and settings (engine/quant_cache.py: the stored 4-bit weights).

The checkpoint is a random-init Qwen2.5-7B architecture in bf16 with a small tokenizer,
written by .ref/unsloth_bench.py's save phase. Each run is its own process, as a user's
second `edgetune train` would be: imports, engine/model.load_base (the cache's decision
inside), add_lora, one SFT step of 1 x 512 tokens; every phase timed.

    PYTHONPATH=$PWD/.gpu-site python bench/quant_cache_gpu.py      # GPU: $OUT/quant_cache.json
    python bench/quant_cache_gpu.py --tiny                          # CPU: the plumbing
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

T_START = time.perf_counter()
HERE = Path(__file__).resolve().parent

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--child", default="", help="(internal) the model folder to time one run on")
ap.add_argument("--out", default=os.environ.get("OUT", "."))
ap.add_argument("--profile", action="store_true", help="run each load under cProfile; the top functions go to the JSON")
args = ap.parse_args()


def child(folder: str) -> dict:
    """One run: imports, load, LoRA, one step; seconds of each, printed as JSON."""
    sys.path.insert(0, str(HERE))
    import _common as C  # noqa: F401  (edgetune importable)
    import torch

    from edgetune.engine import model as model_lib
    from edgetune.engine.settings import LoraSettings, ModelSettings

    t = {"imports": time.perf_counter() - T_START}
    t0 = time.perf_counter()
    model, _, _ = model_lib.load_base(ModelSettings(name=folder, quant="nf4"))
    C.sync()
    t["load_base"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = model_lib.add_lora(model, LoraSettings(r=16, alpha=32), gradient_checkpointing=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    t["add_lora"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = torch.randint(3, model.config.vocab_size, (1, 64 if args.tiny else 512), device=model.device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    C.engine_step(model, opt, batch)
    t["first_step"] = time.perf_counter() - t0
    t["to_first_step"] = time.perf_counter() - T_START
    t["peak_GiB"] = C.gib(C.peak())
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in t.items()}


def main():
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    R: dict = {"runs": {}, "notes": []}
    folder = os.path.join("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir(), "edgetune-cache-q7b")
    cache = tempfile.mkdtemp(prefix="edgetune-cache-")
    env = dict(os.environ, EDGETUNE_CACHE=cache, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    cmd = [sys.executable, str(HERE.parent / ".ref" / "unsloth_bench.py"), "--phase", "save", "--dir", folder]
    subprocess.run(cmd + (["--tiny"] if args.tiny else []), env=dict(env, OUT=cache), check=True,
                   cwd=tempfile.gettempdir())
    R["save_s"] = round(time.perf_counter() - t0, 1)
    R["source_GB"] = round(sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 1e9, 2)
    for name in ("first", "second"):
        prof = out / f"profile_{name}.prof"
        pre = ["-m", "cProfile", "-o", str(prof)] if args.profile else []
        p = subprocess.run([sys.executable, *pre, __file__, "--child", folder] + (["--tiny"] if args.tiny else []),
                           env=env, capture_output=True, text=True)
        sys.stderr.write(p.stderr[-3000:])
        R["runs"][name] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else \
            {"rc": p.returncode, "stderr": p.stderr[-1500:]}
        R["runs"][name]["log"] = [line for line in p.stderr.splitlines() if line.startswith("quantised base")]
        if args.profile and prof.is_file():  # where the seconds go: the top functions by cumulative time
            import io
            import pstats

            buf = io.StringIO()
            pstats.Stats(str(prof), stream=buf).sort_stats("cumulative").print_stats(45)
            R["runs"][name]["profile_top"] = buf.getvalue().splitlines()[-55:]
            buf = io.StringIO()
            pstats.Stats(str(prof), stream=buf).sort_stats("tottime").print_stats(25)
            R["runs"][name]["profile_self"] = buf.getvalue().splitlines()[-35:]
            prof.unlink()
        print(name, R["runs"][name], flush=True)
        (out / "quant_cache.json").write_text(json.dumps(R, indent=1))  # kept if a later run is cut off
    R["entry_GB"] = round(sum(f.stat().st_size for f in Path(cache).rglob("*.safetensors")) / 1e9, 2)
    subprocess.run(["rm", "-rf", folder, cache])
    (out / "quant_cache.json").write_text(json.dumps(R, indent=1))
    f, s = R["runs"]["first"], R["runs"]["second"]
    print(f"\n| run | imports s | load_base s | add_lora s | first step s | to first step s |\n|---|---|---|---|---|---|")
    for name, r in (("first (quantise + store)", f), ("second (cache)", s)):
        print(f"| {name} | {r.get('imports')} | {r.get('load_base')} | {r.get('add_lora')} | {r.get('first_step')} "
              f"| {r.get('to_first_step')} |")
    print(f"source {R['source_GB']} GB bf16, entry {R['entry_GB']} GB")


if __name__ == "__main__":
    if args.child:
        print(json.dumps(child(args.child)), flush=True)
    else:
        main()
