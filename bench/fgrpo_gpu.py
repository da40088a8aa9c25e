"""F-GRPO steps on a 7B-architecture NF4 model: time split generation / training, peak memory.

Built like bench/essa.py (random-init Qwen2.5-7B architecture, NF4, layer by layer on
the GPU), then the engine's own path: `engine.models.model.add_lora` (r=16 on all linear
projections, gradient checkpointing), SEBP patched, the optimizer `auto` picks, and per
step `engine.generation.rollouts.generate` + `engine.methods.fgrpo.fgrpo.policy_update`, exactly as
engine/methods/fgrpo/fgrpo.py's loop calls them. A random-init model solves nothing, so rewards are
seeded coin flips: that keeps the advantage structure of real training (mixed groups,
some all-right or all-wrong groups dropped) and exercises every part of the update.

    python bench/fgrpo_gpu.py [--tiny] [--steps 3]      # writes $OUT/fgrpo_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from essa import QWEN25_7B, TINY, IdTokenizer, build_nf4_model  # noqa: E402


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    a = ap.parse_args()
    if a.tiny:
        a.prompts, a.group, a.prompt_len, a.new_tokens, a.steps = 2, 4, 8, 8, 2

    from edgetune.kernels import sebp as sebp_lib

    from edgetune.engine.core.settings import FGRPOSettings, LoraSettings

    from edgetune.engine.models.model import add_lora

    from edgetune.engine.generation.rollouts import generate

    from edgetune.engine.training.loop import make_optimizer, make_scheduler

    from edgetune.engine.methods.fgrpo.fgrpo import policy_update
    from edgetune.engine.methods.fgrpo.loss import focal_weights, group_advantages

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    arch = TINY if a.tiny else QWEN25_7B
    t0 = time.time()
    model = build_nf4_model(arch, dev, dtype)
    model = add_lora(model, LoraSettings(r=16, alpha=32, target_modules="all-linear"), gradient_checkpointing=True)
    build_s = time.time() - t0
    s = FGRPOSettings(num_generations=a.group, prompts_per_step=a.prompts, max_new_tokens=a.new_tokens,
                      temperature=0.9, loss_type="dapo", gamma=1.0, lr=1e-5, steps=a.steps, micro_batch_size=8)
    opt = make_optimizer(model.parameters(), "auto", s.lr, 0.0, dev)
    sched = make_scheduler(opt, 0, s.steps)
    tok = IdTokenizer()
    g = torch.Generator().manual_seed(0)
    vocab = arch["vocab_size"]
    prompts = [torch.randint(1, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows = []
    with sebp_lib.enabled(model, dev == "cuda") as sebp:
        for step in range(a.steps):
            t = time.time()
            with sebp.lifted():  # as engine/methods/fgrpo/fgrpo.py's loop: the packed fast path needs it
                roll = generate(model, tok, prompts, num_generations=s.num_generations,
                                max_new_tokens=s.max_new_tokens, temperature=s.temperature, seed=step)
            if dev == "cuda":
                torch.cuda.synchronize()
            gen_s = time.time() - t
            r = (torch.rand(roll.completion_ids.shape[0], generator=g) < 0.4).float().to(roll.logprobs.device)
            w = focal_weights(r, s.num_generations, s.gamma, success=r.bool())
            adv = group_advantages(r, s.num_generations, s.scale_rewards) * w
            upd = policy_update(model, roll, adv, s, opt, sched, sebp)
            if dev == "cuda":
                torch.cuda.synchronize()
            gen_tokens = int(roll.completion_mask.sum())
            rows.append({"step": step, "gen_s": round(gen_s, 3), "train_s": round(upd["train_s"], 3),
                         "gen_tokens": gen_tokens, "gen_tokens_per_s": round(gen_tokens / gen_s, 1),
                         "train_tokens_per_s": round(upd["train_tokens"] / max(upd["train_s"], 1e-9), 1),
                         "dropped": upd["dropped"], "loss": upd["loss"], "grad_norm": upd["grad_norm"]})
            print(json.dumps(rows[-1]), flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "arch": "tiny" if a.tiny else "Qwen2.5-7B (random init)", "build_s": round(build_s, 1),
           "rows": a.prompts * a.group, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
           "rollout_path": roll.info,
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None,
           "steps": rows}
    out = Path(os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fgrpo_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    print("| step | generation s | gen tokens/s | training s | train tokens/s | dropped rows |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['gen_s']} | {r['gen_tokens_per_s']} | {r['train_s']} | {r['train_tokens_per_s']} "
              f"| {r['dropped']} |")
    print(f"peak allocated {res['peak_gib']} GiB; build {res['build_s']} s; rollout path {res['rollout_path']}")
    return res


if __name__ == "__main__":
    main()
