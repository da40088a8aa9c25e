#!/usr/bin/env python3
"""The longest sequence one card trains: a random-init Qwen2.5-7B and -72B architecture in
NF4, LoRA r16 / alpha 32 on all 7 projections, batch 1, every layer checkpointed, the
engine's step (bf16 autocast, 512-row loss chunks, fused AdamW).

For each model, memory cap and variant, it doubles the row's length from --start until a
step runs out of memory, then bisects between the last length that fitted and the first
that did not (to --resolution), one optimizer step per probe; it records the longest
length, the peak allocated at it, the step's seconds and tokens per second, and the memory
planner's prediction beside them (its longest length for the cap, its allocated peak at
the measured longest). A cap below the card's memory is emulated with
torch.cuda.set_per_process_memory_fraction (the weights count towards it).

Variants: `levers` = model.offload_activations with offload_prefetch, model.mlp_chunk_tokens
4,096 and model.mask_free_attention (engine/models/offload.py, engine/models/long_context.py);
`plain` = none of them.

    python bench/long_context.py --tiny        # CPU: tiny models, short rows, a fake memory limit
    PYTHONPATH=$PWD/.gpu-site python bench/long_context.py --models 7b --caps 24,80 --out $OUT
    PYTHONPATH=$PWD/.gpu-site python bench/long_context.py --models 72b --caps 80 --out $OUT

A probe at several hundred thousand tokens takes minutes (attention is quadratic in the
length): the search stops when --time-limit would be passed and records the bracket it
reached. --tiny's memory limit counts the bytes autograd saves outside the checkpoints
(no allocator to cap on the CPU): it checks the search and the records, not memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from pathlib import Path

import _common as C  # noqa: E402
import torch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU with a fake memory limit")
ap.add_argument("--ref", default=str(C.ROOT / "bench" / "reference"))
ap.add_argument("--models", default="7b,72b", help="comma list of 7b, 72b")
ap.add_argument("--caps", default="", help="GiB per probe series, comma list; 0 = the whole card "
                                           "(default 24,48,80; tiny: fake limits in KiB 1024,4096)")
ap.add_argument("--variants", default="levers", help="comma list of levers, plain")
ap.add_argument("--start", type=int, default=0, help="first length (default 16,384; tiny 32)")
ap.add_argument("--max-len", type=int, default=2**20, help="stop doubling here")
ap.add_argument("--resolution", type=float, default=0.05, help="bisect until the bracket is this share of the fit")
ap.add_argument("--chunk", type=int, default=0, help="model.mlp_chunk_tokens of the levers (default 4096; tiny 16)")
ap.add_argument("--max-build-s", type=float, default=240.0)
ap.add_argument("--time-limit", type=float, default=560.0)
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

GiB, KiB = 2**30, 2**10


class OutOfMemory(Exception):
    """A probe did not fit (the CUDA allocator's error, or --tiny's fake limit)."""


@contextlib.contextmanager
def fake_limit(limit: int, peak: list):
    """--tiny: raise OutOfMemory once the tensors autograd saves outside the checkpoints
    (deduplicated by storage) pass `limit` bytes; their total is left in peak[0]."""
    seen: dict = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        peak[0] = sum(seen.values())
        if peak[0] > limit:
            raise OutOfMemory(f"fake limit of {limit} bytes")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def search(probe, start: int, max_len: int, resolution: float, left, quantum: int) -> dict:
    """Double from `start` until probe(n) is None (did not fit), then bisect. probe(n) ->
    a record or None; `left()` -> seconds left; a probe is skipped when the last one took
    more than a quarter of them (the next is longer). Returns longest, the record there, the
    first length that did not fit (None if none was met), every probe, and why it stopped."""
    probes: dict = {}
    fit = oom = None
    last_s = 0.0

    def run(n: int) -> bool:
        nonlocal last_s
        t0 = time.perf_counter()
        r = probe(n)
        last_s = time.perf_counter() - t0
        probes[n] = r
        return r is not None

    def time_out() -> bool:
        return left() < 4 * last_s

    n, stop = start, "bracketed"
    while n <= max_len:
        if time_out():
            stop = "time limit while doubling"
            break
        if run(n):
            fit, n = n, 2 * n
        else:
            oom = n
            break
    else:
        stop = "reached --max-len"
    if fit is None and oom is not None:  # even the start did not fit: halve down
        n = oom // 2
        while n >= quantum and not time_out():
            if run(n):
                fit = n
                break
            oom, n = n, n // 2
    while fit is not None and oom is not None and oom - fit > max(quantum, resolution * fit):
        if time_out():
            stop = "time limit while bisecting"
            break
        mid = (fit + oom) // 2 // quantum * quantum
        if mid <= fit:
            break
        if run(mid):
            fit = mid
        else:
            oom = mid
    return {"longest": fit or 0, "at_longest": probes.get(fit), "first_oom": oom, "stop": stop,
            "probes": {str(k): (v if v is None else {k2: v[k2] for k2 in ("peak_alloc_GiB", "step_s")})
                       for k, v in probes.items()}}


def main() -> int:
    T0 = time.perf_counter()
    B = C.load_baseline(args.ref)
    dev = B.DEV
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chunk = args.chunk or (16 if args.tiny else 4096)
    start = args.start or (32 if args.tiny else 16384)
    caps = [float(x) for x in (args.caps or ("1024,4096" if args.tiny else "24,48,80")).split(",")]
    quantum = 8 if args.tiny else 256
    R: dict = {"config": {"models": args.models, "caps": caps, "cap_unit": "KiB (fake)" if args.tiny else "GiB",
                          "variants": args.variants, "start": start, "chunk": chunk, "tiny": args.tiny,
                          "lora": "r16 a32 all 7 projections", "batch": 1},
               "env": B.R["env"], "rows": [], "errors": {}, "notes": []}
    budget = C.Budget("long_context", args.time_limit, out / "long_context.json", R, T0)
    if dev == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))

    from edgetune.engine.core.settings import LoraSettings

    from edgetune.engine.planning import long_context as plan

    from edgetune.engine.models import long_context as levers
    from edgetune.engine.models import model as model_lib
    from edgetune.engine.models import offload

    from edgetune.engine.training.loop import make_optimizer

    def build(which: str):
        arch = dict(B.C7B if which == "7b" else B.C72B, max_position_embeddings=2**21)
        C.reset_peak()
        if which == "7b":
            base, secs = B.build_model(arch, quant=True)
        else:
            base, secs, layers = B.build_72b_layers(arch, args.max_build_s)
            arch["num_hidden_layers"] = layers
        budget.log(f"built {which} ({arch['num_hidden_layers']} layers) in {secs:.1f}s")
        return base, arch

    def one_model(which: str):
        base, arch = build(which)
        folder = C.arch_folder(arch)
        weights = torch.cuda.memory_allocated() if dev == "cuda" else 0
        total = torch.cuda.get_device_properties(0).total_memory if dev == "cuda" else 0
        for variant in args.variants.split(","):
            model = model_lib.add_lora(base, LoraSettings(r=16, alpha=32, dropout=0.0, target_modules=list(C.TARGETS)),
                                       gradient_checkpointing=True)
            model.train()
            on = variant == "levers"
            if on:
                offload.enable(model, prefetch=True)
                levers.chunk_mlp(model, chunk)
            opt = make_optimizer(model.parameters(), "auto", 1e-4, 0.0, dev)
            sets = plan.all_levers() + [f"model.mlp_chunk_tokens={chunk}"] if on else []
            for cap in caps:
                limit = int(cap * (KiB if args.tiny else GiB)) if cap else total
                if dev == "cuda":
                    if weights > limit:
                        R["notes"].append(f"{which} {variant} {cap:g} GiB: the weights alone ({C.gib(weights)} GiB) "
                                          "pass the cap")
                        continue
                    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))

                def probe(n: int):
                    ids = torch.randint(3, arch["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
                    batch = {"input_ids": ids.to(dev), "attention_mask": torch.ones_like(ids).to(dev),
                             "labels": ids.to(dev)}
                    C.reinit_lora(model, seed=0)
                    C.reset_peak()
                    saved = [0]
                    t0 = time.perf_counter()
                    try:
                        with fake_limit(limit, saved) if args.tiny else contextlib.nullcontext(), \
                                levers.mask_free_attention(model, on):
                            loss, _ = C.engine_step(model, opt, batch)
                    except (OutOfMemory, torch.cuda.OutOfMemoryError) as e:
                        budget.log(f"  {n:,} tokens: out of memory ({str(e).splitlines()[0][:80]})")
                        opt.zero_grad(set_to_none=True)
                        del e
                        gc.collect()
                        if dev == "cuda":
                            torch.cuda.empty_cache()
                        return None
                    s = time.perf_counter() - t0
                    peak = saved[0] if args.tiny else C.peak()  # tiny: the bytes the fake limit counted
                    rec = {"tokens": n, "step_s": round(s, 3), "tok_per_s": round(n / s, 1), "loss": round(loss, 4),
                           "peak_alloc": peak, "peak_alloc_GiB": C.gib(peak)}
                    budget.log(f"  {n:,} tokens: {s:.2f}s ({n / s:,.0f} tok/s), peak {rec['peak_alloc_GiB']} GiB")
                    return rec

                budget.log(f"=== {which} {variant} cap {cap:g} ===")
                found = search(probe, start, args.max_len, args.resolution, budget.left, quantum)
                row = {"model": which, "variant": variant, "cap": cap, **found}
                cfg = plan.long_config(folder, max(found["longest"], 1), sets)
                row["planner_longest"] = plan.longest(cfg, int(cap * GiB) if cap else total) if not args.tiny else None
                at = found["at_longest"]
                if at:
                    from edgetune.engine.planning import planner

                    predicted = planner.estimate(cfg, device="cuda", detect_gpu=False)["allocated_peak"]
                    row["planner_peak_GiB"] = C.gib(predicted)
                    if at["peak_alloc"] and not args.tiny:
                        row["planner_error"] = round(predicted / at["peak_alloc"] - 1, 3)
                R["rows"].append(row)
                budget.dump()
            if dev == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0)
            del opt
            base = model.unload()  # the plain base again for the next variant
            for m in base.modules():  # the levers' wrappers off with the adapter
                if getattr(m.forward, "chunk_tokens", None) is not None:
                    del m.forward
            base.gradient_checkpointing_disable()
        del base
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()

    for which in args.models.split(","):
        budget.section(which, lambda w=which: one_model(w), need_s=20 if args.tiny else 120)
    R["table"] = table(R)
    R["wall_s"] = round(time.perf_counter() - T0, 1)
    budget.dump()
    print("\n" + R["table"], flush=True)
    return 0 if R["rows"] and not R["errors"] else 1


def table(R: dict) -> str:
    unit = R["config"]["cap_unit"]
    out = ["| model | levers | cap | longest | peak allocated GiB | s/step | tokens/s | planner longest | "
           "planner peak GiB | stopped |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in R["rows"]:
        at = r["at_longest"] or {}
        cap = f"{r['cap']:g} {unit}" if r["cap"] else "card"
        planned = f"{r['planner_longest']:,}" if r.get("planner_longest") is not None else "-"
        out.append(f"| {r['model']} | {r['variant']} | {cap} | {r['longest']:,} | {at.get('peak_alloc_GiB')} | "
                   f"{at.get('step_s', '-')} | {at.get('tok_per_s', '-')} | {planned} | "
                   f"{r.get('planner_peak_GiB', '-')} | {r['stop']} |")
    if R["errors"]:
        out.append(f"errors: {R['errors']}")
    if R["notes"]:
        out.append(f"notes: {R['notes']}")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
