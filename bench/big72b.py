#!/usr/bin/env python3
"""Qwen2.5-72B architecture on one GPU: a QLoRA step at 2,048 tokens, and one step on a
single 32,768-token sequence inside 80 GB.

Model: random-init Qwen2.5-72B architecture (hidden 8192, intermediate 29568, 80 layers,
64 heads, 8 KV heads, vocab 152064, untied) built decoder layer by decoder layer on the
GPU and quantised to NF4 right away by the reference baseline's builder (it stops early
and says so if the build would take longer than --max-build-s). LoRA r=16 / alpha=32 on
all 7 projections, gradient checkpointing.

Rows (one process, one build):
  hf_2048          bench/reference/baseline.py's add_lora + train_bench on 1 x 2,048 (its section C)
  ours_2048_before  the engine's step before autocast became its default:
                   engine.models.model.add_lora + engine/training/lm_loss (2,048-row chunks) without
                   autocast, paged 8-bit AdamW
  ours_2048        the engine's step now (engine/methods/sft/sft.py): bf16 autocast, fused AdamW,
                   512-row loss chunks
  ours_2048_liger  + Liger-Kernel's RMSNorm / SwiGLU / RoPE (engine/models/liger.py), GPU only
  ours_2048_no_ckpt  + model.gradient_checkpointing=false (no recomputation: the floor of
                   a checkpointed step is 4 x 2 x 72.7 G x 2,048 FLOP / 790 TFLOP/s = 1.5 s)
  ours_32k         as ours_2048_liger + model.offload_activations (engine/models/offload.py): each
                   layer's checkpointed input waits in pinned host memory; logits only
                   in 512-row chunks (engine/training/lm_loss). Checkpointed inputs alone would
                   be 80 x 32,768 x 8,192 x 2 B = 43 GB on the GPU; the target is a peak
                   under 80 GB. One step (the first includes pinned-memory allocation);
                   a second when time allows.
Each row: s/step, tokens/s, peak allocated and reserved, first loss; and the memory
planner's prediction for the same shape (written to the "planner" list).

    python bench/big72b.py --tiny      # CPU, tiny config, seconds
    PYTHONPATH=$PWD/.gpu-site python bench/big72b.py    # GPU (~5-7 min): $OUT/big72b.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import _common as C  # noqa: E402
import torch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (functional check)")
ap.add_argument("--ref", default=str(C.ROOT / "bench" / "reference"))
ap.add_argument("--max-build-s", type=float, default=240.0, help="stop building layers after this (noted)")
ap.add_argument("--long-seq", type=int, default=0, help="tokens of the long step (default 32768; tiny 256)")
ap.add_argument("--skip-hf", action="store_true")
ap.add_argument("--time-limit", type=float, default=560.0)
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

T0 = time.perf_counter()
B = C.load_baseline(args.ref)
DEV = B.DEV
SHORT = B.C_SEQ  # 2048 (tiny 64)
LONG = args.long_seq or (256 if args.tiny else 32768)
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
R: dict = {"config": {"arch": B.C72B, "short": SHORT, "long": LONG, "lora": "r16 a32 all 7 projections",
                      "tiny": args.tiny}, "env": B.R["env"], "rows": {}, "planner": [], "errors": {}, "notes": []}


BUDGET = C.Budget("big72b", args.time_limit, OUT / "big72b.json", R, T0)
left, log, dump, section = BUDGET.left, BUDGET.log, BUDGET.dump, BUDGET.section


def mem() -> dict:
    if DEV != "cuda":
        return {}
    return {"alloc_GiB": C.gib(torch.cuda.memory_allocated()), "peak_reserved_GiB": C.gib(torch.cuda.max_memory_reserved())}


def batch_of(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, B.C72B["vocab_size"], (1, n), generator=g).to(DEV)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main():
    if DEV == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))

    def build():
        C.reset_peak()
        model, secs, layers = B.build_72b_layers(B.C72B, args.max_build_s)
        R.update(build_s=round(secs, 1), layers=layers, mem_after_load=mem())
        if layers < B.C72B["num_hidden_layers"]:
            R["notes"].append(f"built {layers} of {B.C72B['num_hidden_layers']} layers (build time cap)")
        log(f"built {layers} layers in {secs:.1f}s {mem()}")
        return model

    model = section("build", build)
    if model is None:
        return
    arch = dict(B.C72B, num_hidden_layers=R["layers"])
    folder = C.arch_folder(arch)
    short = batch_of(SHORT, 2)

    def hf():
        pm, opt, trainable, _ = B.add_lora(model)
        C.reset_peak()
        m = B.train_bench(pm, opt, [short], n_warm=1, n_meas=2)
        m.update(tok_per_s=SHORT / m["total"], peak_alloc=C.peak(), peak_alloc_GiB=C.gib(C.peak()), **mem())
        R["rows"]["hf_2048"] = m
        log(f"hf 2048: {m['total']:.2f}s, peak {m['peak_alloc_GiB']} GiB")
        del opt
        return pm.unload()

    base = model if args.skip_hf else section("hf_2048", hf, need_s=30 if args.tiny else 60)
    if base is None:
        return
    from edgetune.engine.core.settings import LoraSettings

    from edgetune.engine.models import model as model_lib
    from edgetune.engine.models import offload

    from edgetune.engine.training.loop import make_optimizer

    ours = model_lib.add_lora(base, LoraSettings(r=16, alpha=32, dropout=0.0, target_modules=list(C.TARGETS)),
                              gradient_checkpointing=True)
    ours.train()

    def run(name, batch, n_warm, n_meas, how=None):
        how = dict(how or {})
        C.reinit_lora(ours, seed=0)
        opt = make_optimizer(ours.parameters(), how.pop("optimizer", "auto"), 1e-4, 0.0, DEV)
        C.reset_peak()
        m = C.time_steps(lambda: C.engine_step(ours, opt, batch, **how), n_warm, n_meas, log)
        n = batch["input_ids"].shape[1]
        m.update(tok_per_s=n / m["total"], tokens=n, **mem())
        R["rows"][name] = m
        log(f"{name}: {m['total']:.2f}s ({m['tok_per_s']:.0f} tok/s), peak {m['peak_alloc_GiB']} GiB")
        sets = C.sft_row_settings("big72b", name, R["config"])
        if sets is not None:  # the planner models the engine's step as it is now
            R["planner"].append(C.compare(f"72B SFT {name}", C.planner_prediction(folder, "sft", sets),
                                          m["peak_alloc"]))
        del opt
        return m

    section("ours_2048_before", lambda: run("ours_2048_before", short, 1, 2, C.STEP_BEFORE),
            need_s=20 if args.tiny else 45)
    section("ours_2048", lambda: run("ours_2048", short, 1, 2), need_s=20 if args.tiny else 40)

    def liger_row():
        from edgetune.engine.models import liger

        R["notes"].append(f"liger: {liger.apply(ours, 'on')}")
        run("ours_2048_liger", short, 1, 2)

    if DEV == "cuda":
        section("ours_2048_liger", liger_row, need_s=40)

    def no_ckpt_row():
        ours.get_base_model().gradient_checkpointing_disable()
        try:
            run("ours_2048_no_ckpt", short, 1, 2)
        finally:
            ours.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            C.reset_peak()

    section("ours_2048_no_ckpt", no_ckpt_row, need_s=40)

    def long_step():
        offload.enable(ours)
        long = batch_of(LONG, 3)
        first = run("ours_32k", long, 0, 1)
        if left() > 2 * first["total"] + 20:
            run("ours_32k_second", long, 0, 1)

    section("ours_32k", long_step, need_s=30 if args.tiny else 150)
    R["table"] = table()
    R["wall_s"] = round(time.perf_counter() - T0, 1)
    dump()
    print("\n" + R["table"], flush=True)


def table() -> str:
    rows = R["rows"]
    out = [f"72B arch NF4 ({R.get('layers')} layers), LoRA r16 all-linear, checkpointing; build {R.get('build_s')}s, "
           f"after load {R.get('mem_after_load')}", "",
           "| row | tokens | s/step | tokens/s | peak allocated GiB | peak reserved GiB | first loss |",
           "|---|---|---|---|---|---|---|"]
    for name, m in rows.items():
        first = m.get("first_loss")  # the HF rows report only their last loss
        out.append(f"| {name} | {m.get('tokens', SHORT)} | {m['total']:.2f} | {m['tok_per_s']:,.0f} | "
                   f"{m.get('peak_alloc_GiB')} | {m.get('peak_reserved_GiB')} | "
                   f"{'-' if first is None else f'{first:.4f}'} |")
    for p in R["planner"]:
        out.append(f"planner {p['name']}: predicted {p['predicted_GiB']} GiB, measured {p['measured_GiB']} GiB"
                   + (f" ({p['error']:+.1%})" if "error" in p else ""))
    if R["errors"]:
        out.append(f"errors: {R['errors']}")
    if R["notes"]:
        out.append(f"notes: {R['notes']}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
