#!/usr/bin/env python3
"""SFT step speed on one GPU: the standard HF QLoRA stack, our engine's step with its
levers switched on one at a time, and Unsloth, on the same batch in one run.

Model: random-init Qwen2.5-7B architecture (hidden 3584, intermediate 18944, 28 layers,
28 heads, 4 KV heads, vocab 152064, untied), built decoder layer by decoder layer on the
GPU and quantised to NF4 right away by the reference baseline's own builder (the bf16
model never exists whole, in memory or on disk). LoRA r=16 / alpha=32 on all 7
projections, gradient checkpointing. Batch: 8 sequences of real lengths
[469, 845, 454, 989, 348, 314, 495, 426] (4,340 tokens) right-padded to 1,024, labels
-100 on padding: baseline.make_sft_data's batch, byte for byte.

Rows, each after warm-up, median of the timed steps, peak allocated since its own reset:
  hf/padded, hf/packed_sdpa   .ref/baseline.py's add_lora + train_bench, unchanged
                              (autocast bf16, HF loss over full logits, fused AdamW)
  ours/before                 the engine's step before autocast became its default:
                              add_lora on the same base (after the HF adapter is unloaded), SEBP,
                              logits only at labelled rows in 2,048-row chunks, no
                              autocast (fp32 LoRA products), paged 8-bit AdamW; padded
  ours/autocast               bf16 autocast, fused AdamW, 512-row loss chunks; no SEBP
  ours/+sebp                  + kernels/sebp.patch: padding rows skipped in every backward
                              (= the engine's default step on a padded batch)
  ours/+packing               + engine/packing.collate_packed: one row, no padding at all
                              (SEBP then has nothing to skip)
  ours/+liger                 + Liger-Kernel's fused RMSNorm / SwiGLU / RoPE
                              (engine/liger.py; liger-kernel 0.8.5 carried in .gpu-site)
  ours/+flex                  + flex_attention (a BlockMask from the packed position ids
                              instead of sdpa with a dense [N, N] boolean mask)
  ours/+no_ckpt               + model.gradient_checkpointing=false: no recomputation, every
                              layer's activations kept (the speed/memory trade the planner prices)
  unsloth/padded, /packed     .ref/unsloth_bench.py's own phases in separate processes
                              (Unsloth patches transformers on import): save a random
                              bf16 7B to disk, then Unsloth's 4-bit load + LoRA + steps
Every "ours" row starts from a freshly initialised adapter (B = 0), so its first loss is
the base model's loss and must match the HF first loss within bf16 noise.

    python bench/sft_speed.py --tiny    # CPU, tiny config, seconds (Unsloth phase skipped)
    PYTHONPATH=$PWD/.gpu-site python bench/sft_speed.py   # GPU: $OUT/sft_speed.json + table
Unsloth needs `.unsloth-site/` (bash /work/shared/tools/unsloth-site.sh .unsloth-site)
and bitsandbytes in `.gpu-site/`; it is skipped when the folder is missing.
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

import _common as C  # noqa: E402  (also puts the checkout on sys.path)
import torch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (functional check)")
ap.add_argument("--ref", default=str(C.ROOT / ".ref"), help="folder holding baseline.py, unsloth_bench.py")
ap.add_argument("--unsloth-site", default=str(C.ROOT / ".unsloth-site"))
ap.add_argument("--gpu-site", default=str(C.ROOT / ".gpu-site"), help="slim bitsandbytes (and peft) for subprocesses")
ap.add_argument("--skip-unsloth", action="store_true")
ap.add_argument("--time-limit", type=float, default=560.0, help="seconds for the whole script")
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

T0 = time.perf_counter()
B = C.load_baseline(args.ref)
DEV = B.DEV
N_WARM, N_MEAS = (1, 2) if args.tiny else (2, 5)
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
R: dict = {"config": {"arch": B.C7B, "seq": B.SEQ, "batch": B.BATCH, "lora": "r16 a32 all 7 projections",
                      "warmups": N_WARM, "timed": N_MEAS, "tiny": args.tiny},
           "env": B.R["env"], "hf": {}, "ours": {}, "unsloth": {}, "planner": [], "errors": {}, "notes": []}


BUDGET = C.Budget("sft_speed", args.time_limit, OUT / "sft_speed.json", R, T0)
left, log, dump, section = BUDGET.left, BUDGET.log, BUDGET.dump, BUDGET.section


# --------------------------------------------------------------------------- HF baseline


def hf_rows(model, padded, packed, real):
    pm, opt, trainable, _ = B.add_lora(model)
    R["hf"]["trainable_params"] = trainable
    with torch.no_grad(), B.autocast():
        R["hf"]["first_loss"] = float(pm(**padded).loss)  # the first step's loss (adapter B = 0)
    for key, batch in (("padded", padded), ("packed_sdpa", packed)):
        C.reset_peak()
        m = B.train_bench(pm, opt, [batch], n_warm=N_WARM, n_meas=N_MEAS)
        m.update({"real_tok_per_s": real / m["total"], "peak_alloc": C.peak(), "peak_alloc_GiB": C.gib(C.peak())})
        R["hf"][key] = m
        log(f"hf {key}: {m['total']:.3f}s/step, peak {m['peak_alloc_GiB']} GiB")
    del opt
    return pm.unload()  # the base again, Linear4bit layers restored, for our rows


# --------------------------------------------------------------------------- ours


class Row:
    def __init__(self, ids, labels):
        self.input_ids, self.labels = ids, labels


def apply_liger(model):
    """engine/liger.py: Liger-Kernel's fused RMSNorm, SwiGLU and RoPE on the instance."""
    if DEV != "cuda":
        raise RuntimeError("Liger's Triton kernels need a GPU")
    from edgetune.engine import liger

    R["notes"].append(f"liger: {liger.apply(model, 'on')}")


def use_flex(model):
    model.get_base_model().set_attn_implementation("flex_attention")


def no_checkpointing(model):
    model.get_base_model().gradient_checkpointing_disable()


def ours_rows(base, padded, real):
    from edgetune.engine import model as model_lib
    from edgetune.engine.data import collate
    from edgetune.engine.loop import make_optimizer
    from edgetune.engine.packing import collate_packed
    from edgetune.engine.settings import LoraSettings
    from edgetune.kernels import sebp

    model = model_lib.add_lora(base, LoraSettings(r=16, alpha=32, dropout=0.0, target_modules=list(C.TARGETS)),
                               gradient_checkpointing=True)
    model.train()
    lens = padded["attention_mask"].sum(1).tolist()
    rows = [Row(padded["input_ids"][i, :n].tolist(), padded["input_ids"][i, :n].tolist()) for i, n in enumerate(lens)]
    to_dev = lambda b: {k: v.to(DEV) for k, v in b.items()}  # noqa: E731
    # engine.data.collate pads to the longest row (989 here); the comparison is at 1,024
    # like the baseline, so take the baseline's tensors after checking they are collate's
    w = max(lens)
    mine = collate(rows, pad_id=0)
    assert all(torch.equal(mine[k], padded[k][:, :w].cpu()) for k in mine)
    b_padded = to_dev(padded)
    b_packed = to_dev(collate_packed(rows))
    handle = None
    levers = [("before", b_padded, True, None, C.STEP_BEFORE), ("autocast", b_padded, False, None, {}),
              ("+sebp", b_padded, True, None, {}), ("+packing", b_packed, True, None, {}),
              ("+liger", b_packed, True, apply_liger, {}), ("+flex", b_packed, True, use_flex, {}),
              ("+no_ckpt", b_packed, True, no_checkpointing, {})]
    folder = C.arch_folder(B.C7B)
    for name, batch, use_sebp, prepare, how in levers:
        def one():
            nonlocal handle
            if prepare is not None:
                prepare(model)
            if use_sebp and handle is None:
                handle = sebp.patch(model)
            if not use_sebp and handle is not None:
                sebp.set_active_rows(handle, None)  # dense backward everywhere for this row
            C.reinit_lora(model, seed=0)
            opt = make_optimizer(model.parameters(), how.get("optimizer", "auto"), 1e-4, 0.0, DEV)
            C.reset_peak()
            kw = {k: v for k, v in how.items() if k != "optimizer"}
            h = handle if use_sebp else None
            m = C.time_steps(lambda: C.engine_step(model, opt, batch, h, **kw), N_WARM, N_MEAS, log)
            m["real_tok_per_s"] = real / m["total"]
            m["tokens_in_batch"] = int(batch["input_ids"].numel())
            R["ours"][name] = m
            log(f"ours {name}: {m['total']:.3f}s/step, peak {m['peak_alloc_GiB']} GiB, first loss {m['first_loss']:.4f}")
            del opt
            # the planner models the engine as it is: compare the rows that are that engine
            sets = C.sft_row_settings("sft_speed", name, {"seq": B.SEQ, "real_tokens": real})
            if sets is not None:
                R["planner"].append(C.compare(f"7B SFT {name}", C.planner_prediction(folder, "sft", sets),
                                              m["peak_alloc"]))
        section(f"ours/{name}", one, need_s=5 if args.tiny else 25)
    if handle is not None:
        sebp.unpatch(model)
    return model


# --------------------------------------------------------------------------- Unsloth


class UnslothPhase:
    """One phase of .ref/unsloth_bench.py in its own process (Unsloth patches
    transformers on import), its part file read back when it ends."""

    def __init__(self, phase: str, model_dir: str, part_dir: str, site: list[str]):
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != C.ROOT]
        env = dict(os.environ, OUT=part_dir, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([p for p in site if os.path.isdir(p)] + inherited))
        cmd = [sys.executable, str(Path(args.ref) / "unsloth_bench.py"), "--phase", phase, "--dir", model_dir]
        if args.tiny:
            cmd.append("--tiny")
        self.phase, self.part_dir, self.t0 = phase, part_dir, time.perf_counter()
        log(f"unsloth phase {phase}: {' '.join(cmd[1:])}")
        self.proc = subprocess.Popen(cmd, env=env, cwd=tempfile.gettempdir())

    def wait(self, cap_s: float) -> dict:
        try:
            rc = self.proc.wait(timeout=max(1.0, cap_s - (time.perf_counter() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = "timeout"
        try:
            part = json.loads((Path(self.part_dir) / f"part_{self.phase}.json").read_text())
        except (OSError, ValueError) as e:
            part = {"missing": repr(e)}
        return {"rc": rc, "wall_s": round(time.perf_counter() - self.t0, 1), **part}


UNSLOTH_DIR = os.path.join("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir(), "edgetune-q7b")


def start_unsloth_save() -> tuple | None:
    """Start the save phase (random bf16 7B built on the GPU, ~15 GB written to disk) in the
    background: it overlaps our imports and NF4 build, and is waited for before any timing."""
    if args.skip_unsloth:
        return None
    if not os.path.isdir(args.unsloth_site):
        R["notes"].append(f"Unsloth skipped: {args.unsloth_site} missing")
        return None
    part_dir = tempfile.mkdtemp(prefix="unsloth-parts-")
    return UnslothPhase("save", UNSLOTH_DIR, part_dir, [args.gpu_site]), part_dir


def finish_unsloth_save(started) -> None:
    if started is not None:
        R["unsloth"]["save"] = started[0].wait(cap_s=170)
        log(f"unsloth save phase: rc {R['unsloth']['save']['rc']}, {R['unsloth']['save']['wall_s']}s")


def unsloth_rows(started):
    if started is None or R["unsloth"].get("save", {}).get("rc") != 0:
        R["notes"].append("Unsloth phase not run: the save phase did not succeed")
        return
    if DEV != "cuda":
        R["notes"].append("Unsloth phase skipped on the CPU (Unsloth needs a GPU); the save phase ran")
        return
    run = UnslothPhase("unsloth", UNSLOTH_DIR, started[1], [args.unsloth_site, args.gpu_site])
    R["unsloth"]["run"] = run.wait(cap_s=min(260, left() - 10))
    subprocess.run(["rm", "-rf", UNSLOTH_DIR])


# --------------------------------------------------------------------------- table


def table() -> str:
    real = R["config"]["real_tokens"]
    hf_pad = (R["hf"].get("padded") or {}).get("total")
    us_steps = (R["unsloth"].get("run") or {}).get("steps") or {}
    us_pad = (us_steps.get("padded") or {}).get("total")
    first_hf = R["hf"].get("first_loss")
    rows = [("hf/" + k, R["hf"][k]) for k in ("padded", "packed_sdpa") if k in R["hf"]]
    rows += [("ours/" + k, v) for k, v in R["ours"].items()]
    rows += [("unsloth/" + k, v) for k, v in us_steps.items()]
    out = [f"SFT step, Qwen2.5-7B arch NF4, LoRA r16 all-linear, checkpointing, 8 x {B.SEQ} padded "
           f"({real} real tokens); median of {N_MEAS} steps after {N_WARM} warm-up",
           "", "| stack / lever | s/step | real tokens/s | peak allocated GiB | first loss | vs HF padded | vs Unsloth padded |",
           "|---|---|---|---|---|---|---|"]
    for name, m in rows:
        t = m["total"]
        peak = m.get("peak_alloc_GiB", m.get("max_alloc_GiB"))
        first = m.get("first_loss", (m.get("losses") or [None])[0])
        if name == "hf/padded":
            first = first_hf
        fl = "-" if first is None else f"{first:.4f}"
        vs_hf = f"{hf_pad / t:.2f}x" if hf_pad else "-"
        vs_us = f"{us_pad / t:.2f}x" if us_pad else "-"
        out.append(f"| {name} | {t:.3f} | {real / t:,.0f} | {peak} | {fl} | {vs_hf} | {vs_us} |")
    if first_hf is not None:
        diffs = {k: round(v["first_loss"] - first_hf, 4) for k, v in R["ours"].items()}
        out.append(f"\nfirst-loss difference ours - HF (bf16 noise is ~1e-2 at loss ~12): {diffs}")
    if R["errors"]:
        out.append(f"errors: {json.dumps(R['errors'])[:1500]}")
    if R["notes"]:
        out.append(f"notes: {R['notes']}")
    return "\n".join(out)


def main():
    if DEV == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))

    def build():
        C.reset_peak()
        model, secs = B.build_model(B.C7B, quant=True)
        R["build_s"] = round(secs, 1)
        R["mem_after_load_GiB"] = C.gib(torch.cuda.memory_allocated()) if DEV == "cuda" else None
        log(f"built in {secs:.1f}s")
        return model

    started = start_unsloth_save()
    model = section("build", build)
    finish_unsloth_save(started)  # nothing is timed while it writes
    if model is None:
        return
    lens, padded, packed, _ = B.make_sft_data(B.C7B["vocab_size"])
    real = int(lens.sum())
    R["config"].update(lengths=lens.tolist(), real_tokens=real)
    base = section("hf", lambda: hf_rows(model, padded, packed, real), need_s=10 if args.tiny else 60)
    if base is None:
        return
    section("ours", lambda: ours_rows(base, padded, real))
    del model, base
    try:
        C.reset_peak()
    except RuntimeError as e:  # a CUDA error in a row is sticky; Unsloth runs in its own process anyway
        R["notes"].append(f"CUDA state after our rows: {e}"[:300])
    if started is not None:
        section("unsloth", lambda: unsloth_rows(started), need_s=20 if args.tiny else 150)
    R["table"] = table()
    R["wall_s"] = round(time.perf_counter() - T0, 1)
    dump()
    print("\n" + R["table"], flush=True)


if __name__ == "__main__":
    main()
