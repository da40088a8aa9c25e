#!/usr/bin/env python3
"""Where the 7B SFT step's time goes: each GPU kernel of a profiled step put in one of the
step's parts, with its time, what it achieved and the floor of that part.

Model and batch are sft_speed.py's (random-init Qwen2.5-7B architecture in NF4, LoRA r16 /
alpha 32 on all 7 projections, 8 rows of 4,340 real tokens, padded to 1,024 for the padded
rows). Rows:

  padded             the engine's step on the padded batch, SEBP off
  padded_sebp        the same with SEBP (kernels/sebp.py): padding rows skipped in the backward
  packed             packed rows, Liger, flex_attention, all layers checkpointed (sft-qlora-7b)
  packed_no_ckpt     the same without gradient checkpointing (sft-fast-7b)
  padded_sebp_runs   padded_sebp with sft.sebp_kernel=runs (cuBLAS on each run of active rows in place)
  padded_sebp_runs_fused  the same with sft.fused_lora (kernels/lora_fused.py: LoRA's branch added in the GEMMs)
  packed_fused       packed with sft.fused_lora

Each row: two warm-up steps, then two steps under torch.profiler. Every kernel is put in a
part by its name and the operator that launched it (a GEMM with a rank-16 side is a LoRA
product, one with the vocabulary is the head, any other is a base layer's), and in a phase
(forward, backward, optimizer) by the annotation range it ran in. "GPU idle" is the step's
wall time less the time some kernel was running: launch gaps and host work.

Floors: each part's least time on this card: its FLOPs over the measured bf16 GEMM rate
(a 4,096 x 3,584 x 18,944 product timed here) or its least bytes over the measured copy
bandwidth, whichever is larger. Base GEMMs count the forward, the recompute under
checkpointing and the input-gradient product (no weight gradient: the base is frozen);
with SEBP the input-gradient product covers the real rows only. NF4 dequantisation reads
0.5 byte and writes 2 bytes a weight, once per use (forward, recompute, backward).

    PYTHONPATH=$PWD/.gpu-site python bench/sft_profile.py      # GPU: $OUT/sft_profile.json + .md
    python bench/sft_profile.py --tiny                          # CPU: the plumbing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402  (also makes edgetune importable)
import torch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--ref", default=str(C.ROOT / "bench" / "reference"))
ap.add_argument("--rows", default="padded,padded_sebp,padded_sebp_runs,padded_sebp_runs_fused,packed,packed_fused,"
                                  "packed_no_ckpt")
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

B = C.load_baseline(args.ref)
DEV = B.DEV
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
R: dict = {"config": {"arch": B.C7B, "seq": B.SEQ, "batch": B.BATCH, "tiny": args.tiny}, "rows": {}, "notes": [],
           "errors": {}}
T0 = time.perf_counter()
RANK = 16


def log(*a):
    print(f"[profile {time.perf_counter() - T0:6.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------- ceilings


def ceilings() -> dict:
    """This card's bf16 GEMM rate on a base layer's shape and its copy bandwidth."""
    if DEV != "cuda":
        return {"tflops": 1.0, "gbps": 50.0}
    from triton.testing import do_bench

    m, k, n = 4096, 3584, 18944
    a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=DEV, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    x = torch.randn(2**28 // 2, device=DEV, dtype=torch.bfloat16)  # 256 MiB
    y = torch.empty_like(x)
    ms_copy = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return {"tflops": round(2 * m * k * n / ms / 1e9, 1), "gbps": round(2 * x.numel() * 2 / ms_copy / 1e6, 1),
            "gemm_shape": [m, k, n]}


# --------------------------------------------------------------------------- classification

PARTS = ["nf4_dequant", "base_gemm", "lora_gemm", "head_gemm", "attention", "norms_activations", "sebp_gather",
         "loss", "optimizer", "copies_casts", "other"]


def part_of(kernel: str, op: str, dims) -> str:
    k, o = kernel.lower(), (op or "").lower()
    flat = [d for shape in (dims or []) if isinstance(shape, list) for d in shape if isinstance(d, int)]
    if "dequantize" in k or "kdequant" in k or "dequantize" in o:
        return "nf4_dequant"
    if "sebp" in k or "gathered" in k or "scatter_rows" in k or "sebp" in o:
        return "sebp_gather"
    if "adam" in k or "multi_tensor" in k or "optimizer" in o or "adam" in o:
        return "optimizer"
    if any(s in k for s in ("flash", "fmha", "flex", "attention", "attn", "triton_tem_fused")) or "attention" in o:
        return "attention"
    if any(s in k for s in ("cross_entropy", "log_softmax", "logsumexp", "nll")) or "cross_entropy" in o:
        return "loss"
    gemm = any(s in k for s in ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "sm90", "sm80", "_mm_", "matmul")) or \
        o in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")
    if gemm:
        vocab = B.C7B["vocab_size"]
        if vocab in flat:
            return "head_gemm"
        if RANK in flat:
            return "lora_gemm"
        return "base_gemm"
    if any(s in k for s in ("rms", "norm", "silu", "swiglu", "rope", "rotary", "liger", "gelu", "mul_kernel",
                            "add_kernel", "elementwise", "vectorized", "reduce")):
        return "norms_activations"
    if any(s in k for s in ("copy", "cast", "fill", "memset", "memcpy", "cat", "index", "gather", "scatter")):
        return "copies_casts"
    return "other"


def analyse(trace_path: Path, n_steps: int) -> dict:
    """Kernels of the trace by part and phase; GPU busy time; per step."""
    tr = json.loads(trace_path.read_text())
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    ops = {}
    for e in ev:
        if e.get("cat") == "cpu_op" and "args" in e:
            ext = e["args"].get("External id")
            if ext is not None:
                ops[ext] = (e.get("name"), e["args"].get("Input Dims"))
    phases = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in ev
              if e.get("cat") == "gpu_user_annotation" and e.get("name") in ("forward", "backward", "optimizer")]
    if not phases:  # CPU ranges (the step synchronises at each phase's end)
        phases = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in ev
                  if e.get("cat") == "user_annotation" and e.get("name") in ("forward", "backward", "optimizer")]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("user_annotation", "cpu_op")
             and e.get("name") == "profiled_step"]
    kernels = [e for e in ev if e.get("cat") == "kernel" or (e.get("cat") == "gpu_memcpy") or
               (e.get("cat") == "gpu_memset")]
    by_part: dict = {p: 0.0 for p in PARTS}
    by_phase_part: dict = {}
    names: dict = {}
    intervals = []
    for k in kernels:
        ext = k.get("args", {}).get("External id")
        op, dims = ops.get(ext, (None, None))
        part = part_of(k.get("name", ""), op, dims)
        dur = float(k.get("dur", 0))
        by_part[part] += dur
        ph = next((n for n, a, b in phases if a <= k["ts"] <= b), "outside")
        by_phase_part.setdefault(ph, {}).setdefault(part, 0.0)
        by_phase_part[ph][part] += dur
        key = (part, k.get("name", "")[:90])
        names[key] = names.get(key, 0.0) + dur
        intervals.append((k["ts"], k["ts"] + dur))
    intervals.sort()
    busy, cur = 0.0, None
    for a, b in intervals:
        if cur is None or a > cur[1]:
            if cur:
                busy += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur:
        busy += cur[1] - cur[0]
    wall = sum(b - a for a, b in steps) if steps else None
    per = lambda us: round(us / n_steps / 1000, 2)  # noqa: E731  (µs over n steps -> ms a step)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:40]
    return {"ms_per_step": {p: per(v) for p, v in by_part.items()},
            "phase_ms_per_step": {ph: {p: per(v) for p, v in d.items()} for ph, d in by_phase_part.items()},
            "kernel_busy_ms": per(busy), "wall_ms": per(wall) if wall else None,
            "gpu_idle_ms": per(wall - busy) if wall else None,
            "top_kernels": [{"part": p, "kernel": n, "ms": per(v)} for (p, n), v in top]}


# --------------------------------------------------------------------------- floors


def linear_params() -> int:
    a = B.C7B
    h, i, kv = a["hidden_size"], a["intermediate_size"], a["num_key_value_heads"] * a["hidden_size"] // a[
        "num_attention_heads"]
    return a["num_hidden_layers"] * (h * h * 2 + h * kv * 2 + 3 * h * i)


def floors(tokens_fwd: int, tokens_bwd: int, real: int, lens: list[int], ckpt: bool, ceil: dict) -> dict:
    """Least ms of each part on this card (see the module docstring)."""
    a = B.C7B
    P = linear_params()
    fl = ceil["tflops"] * 1e12 / 1e3  # FLOP a ms
    by = ceil["gbps"] * 1e9 / 1e3  # bytes a ms
    fwd_passes = 2 if ckpt else 1
    base = 2 * P * (tokens_fwd * fwd_passes + tokens_bwd)
    deq = 2.5 * P * (fwd_passes + 1)
    h, i, L = a["hidden_size"], a["intermediate_size"], a["num_hidden_layers"]
    d_in = 5 * h + h + i  # q k v gate up read x (h), o reads h, down reads i
    kv = a["num_key_value_heads"] * h // a["num_attention_heads"]
    d_out = h + kv + kv + h + i + i + h
    lora_bytes = 2 * L * (tokens_fwd * (d_in + 3 * d_out) * fwd_passes + tokens_bwd * (d_in + 3 * d_out))
    attn = 2 * h * L * sum(n * n for n in lens) * (fwd_passes + 2.5)
    head = 2 * 2 * real * a["vocab_size"] * h
    lora_params = L * RANK * (d_in + d_out)
    act_bytes = 2 * L * tokens_fwd * (6 * h + 4 * i) * (fwd_passes + 2)
    return {"base_gemm": round(base / fl, 1), "nf4_dequant": round(deq / by, 1), "lora_gemm": round(lora_bytes / by, 1),
            "attention": round(attn / fl, 1), "head_gemm": round(head / fl, 1),
            "optimizer": round(lora_params * 28 / by, 2), "norms_activations": round(act_bytes / by, 1),
            "_flops": {"base_gemm": base, "attention": attn, "head_gemm": head},
            "_bytes": {"nf4_dequant": deq, "lora_gemm": lora_bytes, "norms_activations": act_bytes}}


# --------------------------------------------------------------------------- the step


def step(model, opt, batch, handle):
    from torch.profiler import record_function

    from edgetune.kernels import sebp

    from edgetune.engine.models.model import autocast

    from edgetune.engine.training.lm_loss import causal_lm_loss

    with record_function("profiled_step"):
        if handle is not None:
            sebp.set_active_rows(handle, batch["attention_mask"].bool())
        with record_function("forward"):
            with autocast(model):
                loss, _ = causal_lm_loss(model, batch, chunk_rows=512)
            C.sync()
        with record_function("backward"):
            loss.backward()
            C.sync()
        with record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            C.sync()
    return float(loss.detach())


@contextlib.contextmanager
def row_levers(model, name):
    """The row's SEBP kernel (`_sebp_runs` in its name: runs, else auto) and fused LoRA
    (`_fused`: kernels/lora_fused under SEBP's patch, as the engine nests them); yields the
    model's SEBP handle, and leaves the model as it found it."""
    from edgetune.kernels import lora_fused, sebp

    with contextlib.ExitStack() as stack:
        if "_fused" in name:
            sebp.unpatch(model)
            stack.callback(sebp.patch, model)
            stack.enter_context(lora_fused.enabled(model, True))
            stack.callback(sebp.unpatch, model)
        handle = sebp.patch(model)
        handle.backend = sebp.KERNELS["runs" if "_sebp_runs" in name else "auto"]
        stack.callback(setattr, handle, "backend", "auto")
        yield handle


def main():
    from torch.profiler import ProfilerActivity, profile

    from edgetune.kernels import sebp

    from edgetune.engine.core.settings import LoraSettings

    from edgetune.engine.data.packing import collate_packed

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.loop import make_optimizer

    ceil = ceilings()
    R["ceilings"] = ceil
    log(f"ceilings {ceil}")
    base, secs = B.build_model(B.C7B, quant=True)
    log(f"built in {secs:.1f}s")
    lens, padded, _, _ = B.make_sft_data(B.C7B["vocab_size"])
    lens = lens.tolist()
    real = int(sum(lens))
    R["config"].update(lengths=lens, real_tokens=real)
    model = model_lib.add_lora(base, LoraSettings(r=RANK, alpha=32, dropout=0.0, target_modules=list(C.TARGETS)),
                               gradient_checkpointing=True)
    model.train()

    class Row:
        def __init__(self, ids):
            self.input_ids, self.labels = ids, ids

    rows = [Row(padded["input_ids"][i, :n].tolist()) for i, n in enumerate(lens)]
    to_dev = lambda b: {k: v.to(DEV) for k, v in b.items()}  # noqa: E731
    b_padded, b_packed = to_dev(padded), to_dev(collate_packed(rows))
    handle = sebp.patch(model)
    liger_on = False
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    for name in args.rows.split(","):
        stack = contextlib.ExitStack()
        try:
            handle = stack.enter_context(row_levers(model, name))
            packed = name.startswith("packed")
            if packed and not liger_on and DEV == "cuda":
                from edgetune.engine.models import liger

                R["notes"].append(f"liger: {liger.apply(model, 'on')}")
                model.get_base_model().set_attn_implementation("flex_attention")
                liger_on = True
            ckpt = 0 if name.endswith("no_ckpt") else None
            model_lib.checkpoint_first_layers(model.get_base_model(), ckpt)
            use_sebp = name.startswith("padded_sebp") or packed
            if not use_sebp:
                sebp.set_active_rows(handle, None)
            h = handle if use_sebp else None
            batch = b_packed if packed else b_padded
            C.reinit_lora(model, seed=0)
            opt = make_optimizer(model.parameters(), "auto", 1e-4, 0.0, DEV)
            C.reset_peak()
            times = []
            for _ in range(3):  # warm-up (compilation, autotuning, SEBP's backend choice)
                t = time.perf_counter()
                step(model, opt, batch, h)
                times.append(time.perf_counter() - t)
            n = 2
            with profile(activities=acts, record_shapes=True) as prof:
                t = time.perf_counter()
                for _ in range(n):
                    step(model, opt, batch, h)
                prof_wall = (time.perf_counter() - t) / n
            path = Path(tempfile.mkdtemp()) / f"{name}.json"
            prof.export_chrome_trace(str(path))
            plain = []
            for _ in range(3):  # the same step unprofiled: what the profiler itself adds
                t = time.perf_counter()
                step(model, opt, batch, h)
                plain.append(time.perf_counter() - t)
            res = analyse(path, n)
            tok_fwd = int(batch["input_ids"].numel())
            tok_bwd = real if use_sebp else tok_fwd
            res.update(warmup_s=[round(x, 3) for x in times], profiled_step_s=round(prof_wall, 4),
                       plain_step_s=round(statistics.median(plain), 4), peak_GiB=C.gib(C.peak()),
                       tokens=tok_fwd, checkpointing=ckpt is None, sebp=use_sebp,
                       sebp_kernel="runs" if "_sebp_runs" in name else "auto", fused_lora="_fused" in name,
                       floors_ms=floors(tok_fwd, tok_bwd, real, lens if packed else [B.SEQ] * B.BATCH, ckpt is None,
                                        ceil))
            R["rows"][name] = res
            del opt
            log(f"{name}: plain {res['plain_step_s']} s, profiled {res['profiled_step_s']} s, parts "
                f"{res['ms_per_step']}, idle {res['gpu_idle_ms']} ms")
        except Exception as e:  # noqa: BLE001 - one row must not lose the others
            import traceback

            traceback.print_exc()
            R["errors"][name] = f"{type(e).__name__}: {e}"[:1000]
        finally:
            stack.close()
        C.write_json(OUT / "sft_profile.json", R)
    md = table()
    (OUT / "sft_profile.md").write_text(md)
    print(md)


def table() -> str:
    ceil = R.get("ceilings", {})
    out = [f"Measured ceilings: bf16 GEMM {ceil.get('tflops')} TFLOP/s ({ceil.get('gemm_shape')}), copy "
           f"{ceil.get('gbps')} GB/s (read + write)."]
    for name, r in R["rows"].items():
        fl = r["floors_ms"]
        out += ["", f"### {name}: {r['plain_step_s'] * 1000:.0f} ms a step unprofiled, {r['wall_ms']} ms profiled; "
                    f"{r['tokens']} tokens, checkpointing {r['checkpointing']}, SEBP {r['sebp']} (kernel "
                    f"{r.get('sebp_kernel', 'auto')}), fused LoRA {r.get('fused_lora', False)}, peak {r['peak_GiB']} GiB",
                "", "| part | ms a step | share of kernel time | achieved | floor ms | over floor |", "|---|---|---|---|---|---|"]
        busy = r["kernel_busy_ms"] or 1
        for p in PARTS:
            ms = r["ms_per_step"].get(p, 0)
            if not ms:
                continue
            ach = ""
            if p in fl.get("_flops", {}) and ms:
                ach = f"{fl['_flops'][p] / (ms / 1e3) / 1e12:.0f} TFLOP/s"
            elif p in fl.get("_bytes", {}) and ms:
                ach = f"{fl['_bytes'][p] / (ms / 1e3) / 1e9:.0f} GB/s (least bytes)"
            f = fl.get(p)
            over = f"{ms / f:.1f}x" if f else ""
            out.append(f"| {p} | {ms:.1f} | {100 * ms / busy:.0f}% | {ach} | {f if f is not None else ''} | {over} |")
        out.append(f"| GPU idle (launch gaps, host) | {r['gpu_idle_ms']} | | | 0 | |")
        out.append("")
        out.append("phases (ms a step): " + "; ".join(
            f"{ph}: {sum(d.values()):.0f} (" + ", ".join(f"{p} {v:.0f}" for p, v in sorted(d.items(), key=lambda kv: -kv[1])
                                                         if v >= 1) + ")" for ph, d in r["phase_ms_per_step"].items()))
    return "\n".join(out)


if __name__ == "__main__":
    main()
