#!/usr/bin/env python3
"""Greedy generation on the CPU: edgetune's rollouts.generate on the embedded model as
`edgetune eval` loads it (NF4, LoRA attached) against plain transformers `generate` on the
same weights in fp32 (the NF4 codes dequantised), in one process, rounds interleaved
(A B C A B C ...: a slow window of a shared machine hits every path alike); each path's
best round counts, its first round shown beside it (ours makes its fp32 copy there).

Paths: `ours` (rollouts.generate's choice: on the CPU the static loop over an fp32 copy of
the base, engine/generation/fast_decode.py's host_copy_wanted), `ours, NF4 layers` (the
plain loop through bitsandbytes' layers: what the CPU ran before the copy), `transformers
fp32` (AutoModelForCausalLM.generate, greedy). The held-out prompts of the F-GRPO quick
start in batches of --batch, --new new tokens; tokens are counted up to each row's EOS
(the same for every path when their greedy tokens agree, which is reported).

    python bench/cpu_generation.py --prompts 100 --batch 25 --new 32 --rounds 3 --threads 1
    python bench/cpu_generation.py --tiny        # 8 prompts, 8 new tokens, one round

Writes $OUT/cpu_generation.json; prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402,F401  (edgetune importable from this checkout)

ap = argparse.ArgumentParser()
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--prompts", type=int, default=100)
ap.add_argument("--batch", type=int, default=25)
ap.add_argument("--new", type=int, default=32)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()
if args.tiny:
    args.prompts, args.batch, args.new, args.rounds = 8, 8, 8, 1

import torch  # noqa: E402

torch.set_num_threads(args.threads)

from edgetune.engine.core.settings import resolve  # noqa: E402

from edgetune.engine.generation import fast_decode  # noqa: E402
from edgetune.engine.generation.rollouts import generate, left_pad, render_prompts  # noqa: E402

from edgetune.engine.training import grading  # noqa: E402


def until_eos(rows: torch.Tensor, eos: int) -> list[list[int]]:
    out = []
    for r in rows.tolist():
        out.append(r[: r.index(eos) + 1] if eos in r else r)
    return out


def main() -> None:
    cfg = resolve(preset="fgrpo-quickstart")
    model, tok, _ = grading.eval_model(cfg, "")
    rows = grading.held_out_rows(cfg, tok, grading.grading_settings(cfg))
    prompts = [r["prompt"] for r in (rows * (-(-args.prompts // len(rows))))[: args.prompts]]
    rendered = render_prompts(tok, prompts, cfg.data.system_prompt)
    eos, pad = tok.eos_token_id, tok.pad_token_id

    # transformers in fp32 on the same weights: the NF4 codes dequantised, as the copy holds them
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.model import resolve_model_path

    base = model.get_base_model()
    # the model as a user loads it with transformers, its linear layers then set to the NF4 values
    dense = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model.name), dtype=torch.float32).eval()
    weights = {name.replace(".base_layer", "") + ".weight": fast_decode._base_and_lora(mod)[0].float()
               for name, mod in base.named_modules() if type(mod).__name__ == "Linear4bit"}
    left = dense.load_state_dict(weights, strict=False).unexpected_keys
    if left or not weights:
        raise SystemExit(f"the fp32 model has no such layers: {left[:5]}")

    def hf():
        out = []
        for s in range(0, len(rendered), args.batch):
            ids, mask = left_pad(rendered[s : s + args.batch], pad, "cpu")
            with torch.no_grad():
                g = dense.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                   pad_token_id=pad, eos_token_id=eos)
            out += until_eos(g[:, ids.shape[1]:], eos)
        return out

    def ours(fast):
        def run():
            roll = generate(model, tok, rendered, max_new_tokens=args.new, greedy=True, batch_size=args.batch,
                            fast=fast)
            return until_eos(roll.completion_ids, eos), roll.info
        return run

    paths = {"transformers fp32": hf, "ours": ours(None), "ours, NF4 layers": ours(False)}
    best: dict = {}
    first: dict = {}  # the first round: ours makes its fp32 copy of the base there
    info: dict = {}
    tokens: dict = {}
    for r in range(args.rounds):
        for name, fn in paths.items():
            t = time.process_time()
            out = fn()
            cpu = time.process_time() - t
            if isinstance(out, tuple):
                out, info[name] = out
            tokens[name] = out
            best[name] = min(best.get(name, cpu), cpu)
            first.setdefault(name, cpu)
            print(f"round {r + 1} {name}: {cpu:.2f} CPU-s", flush=True)
    ref = tokens["transformers fp32"]
    result = {"prompts": args.prompts, "batch": args.batch, "new": args.new, "threads": args.threads,
              "rounds": args.rounds, "paths": {}}
    for name in paths:
        n = sum(len(x) for x in tokens[name])
        result["paths"][name] = {"cpu_s": round(best[name], 3), "first_cpu_s": round(first[name], 3), "tokens": n,
                                 "tokens_per_cpu_s": round(n / best[name], 1),
                                 "same_greedy_as_transformers": sum(a == b for a, b in zip(tokens[name], ref)),
                                 "info": info.get(name)}
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_generation.json").write_text(json.dumps(result, indent=1, default=str))
    hf_rate = result["paths"]["transformers fp32"]["tokens_per_cpu_s"]
    print(f"\n{args.prompts} prompts x {args.new} new tokens, batches of {args.batch}, {args.threads} thread(s), "
          f"best of {args.rounds}\n")
    print("| path | CPU-s (first round) | tokens | tokens per CPU-s | vs transformers | same greedy |")
    print("|---|---|---|---|---|---|")
    for name, p in result["paths"].items():
        print(f"| {name} | {p['cpu_s']:.2f} ({p['first_cpu_s']:.2f}) | {p['tokens']} | {p['tokens_per_cpu_s']} | "
              f"{p['tokens_per_cpu_s'] / hf_rate:.2f}x | {p['same_greedy_as_transformers']}/{args.prompts} |")


if __name__ == "__main__":
    main()
