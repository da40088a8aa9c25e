#!/usr/bin/env python3
"""The product path on several GPUs: `edgetune train --gpus N` (launcher, torchrun, NCCL)
for SFT, F-GRPO and ESSA on a small random-init Llama, against the same runs on one GPU.

    python bench/multi_gpu_runs.py --tokenizer DIR [--gpus 2]    # JSON in $OUT/multi_gpu_runs.json

DIR holds a tokenizer with a chat template (the embedded SmolLM2's, as the tests use).
Checked: every run finishes; SFT's losses on N GPUs against one GPU (bf16 autocast on
CUDA, so close rather than equal; the CPU tests check equality in fp32); each `step`
event carries every rank's GPU memory; ESSA's greedy fitness per candidate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_model(tok_dir: str, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def train(cfg: dict, name: str, gpus: int, work: Path, timeout: float) -> dict:
    (work / f"{name}.yaml").write_text(json.dumps(cfg))
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "train", "--config", str(work / f"{name}.yaml"),
                        "--name", name, "--gpus", str(gpus)], capture_output=True, text=True, timeout=timeout)
    events = [json.loads(line) for line in (Path(cfg["run"]["runs_dir"]) / name / "events.jsonl").read_text()
              .splitlines() if line.strip()]
    steps = [e for e in events if e["type"] == "step"]
    return {"gpus": gpus, "exit": p.returncode, "s": round(time.time() - t, 1), "last": events[-1]["type"],
            "error": events[-1].get("message") if events[-1]["type"] == "error" else None,
            "world_size": next((e.get("world_size") for e in events if e["type"] == "started"), None),
            "steps": [{k: e.get(k) for k in ("step", "loss", "grad_norm", "reward_mean", "best", "mean")} for e in steps],
            "ranks_gpu_peak_gib": [[round(r["gpu"]["peak"] / 2**30, 3) for r in e["ranks"]] for e in steps
                                   if "ranks" in e][-1:],
            "fitness": [e["fitness"] for e in events if e["type"] == "candidate"],
            "stderr_tail": p.stderr[-1500:] if p.returncode else ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120, help="seconds for each run")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT") or ".")
    work = Path(tempfile.mkdtemp(prefix="mgruns-"))
    model = tiny_model(a.tokenizer, work / "model")
    runs = str(work / "runs")
    base = {"model": {"name": str(model), "quant": "nf4", "gradient_checkpointing": False},
            "lora": {"r": 8, "alpha": 16}, "run": {"runs_dir": runs, "seed": 3, "checkpoint_every": 0}}
    rl = work / "rl.jsonl"
    rl.write_text("".join(json.dumps({"prompt": f"What is {i} plus {j}?", "answer": str(i + j)}) + "\n"
                          for i in range(6) for j in range(6)))
    (work / "reward.py").write_text("def reward(completion, answer, row):\n"
                                    "    return (sum(map(ord, completion)) % 97) / 96\n")
    sft = {**base, "method": "sft", "data": {"path": "embedded:arith-sft", "max_rows": 256, "max_seq_len": 256},
           "sft": {"lr": 1e-3, "steps": 6, "batch_size": 8, "grad_accum": 2, "warmup_steps": 1, "eval_every": 0}}
    fgrpo = {**base, "method": "fgrpo", "data": {"path": str(rl), "eval_fraction": 0.0},
             "fgrpo": {"steps": 3, "prompts_per_step": 4, "num_generations": 4, "max_new_tokens": 16,
                       "reward": "file", "reward_file": str(work / "reward.py"), "eval_prompts": 0,
                       "sample_every": 0}}
    essa = {**base, "method": "essa", "data": {"path": str(rl), "eval_fraction": 0.0},
            "essa": {"warm_start_steps": 2, "population": 6, "generations": 2, "prompts_per_generation": 4,
                     "max_new_tokens": 8, "sigma0": 0.5, "reward": "file", "reward_file": str(work / "reward.py"),
                     "eval_prompts": 0}}
    env_note = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",)}
    R: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "env": env_note, "runs": {}}
    for name, cfg, gpus in (("sft-1", sft, 1), ("sft-n", sft, a.gpus), ("fgrpo-n", fgrpo, a.gpus),
                            ("essa-1", essa, 1), ("essa-n", essa, a.gpus)):
        try:
            R["runs"][name] = train(cfg, name, gpus, work, a.timeout)
        except Exception as e:  # a run that hangs or fails: say so, go on
            R["runs"][name] = {"failed": f"{type(e).__name__}: {e}"[:500]}
        print(name, json.dumps(R["runs"][name])[:600], flush=True)
        (out / "multi_gpu_runs.json").write_text(json.dumps(R, indent=1))
    one, n = R["runs"].get("sft-1", {}), R["runs"].get("sft-n", {})
    if one.get("steps") and n.get("steps"):
        R["sft_loss_max_rel_diff"] = max(abs(x["loss"] - y["loss"]) / abs(x["loss"])
                                         for x, y in zip(one["steps"], n["steps"]))
    e1, en = R["runs"].get("essa-1", {}), R["runs"].get("essa-n", {})
    if e1.get("fitness") and en.get("fitness"):
        R["essa_fitness_max_abs_diff"] = max(abs(x - y) for x, y in zip(e1["fitness"], en["fitness"]))
    (out / "multi_gpu_runs.json").write_text(json.dumps(R, indent=1))
    print(json.dumps({k: v for k, v in R.items() if k != "runs"}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
