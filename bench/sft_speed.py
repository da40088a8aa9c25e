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
  hf/padded, hf/packed_sdpa   bench/reference/baseline.py's add_lora + train_bench, unchanged
                              (autocast bf16, HF loss over full logits, fused AdamW)
  ours/before                 the engine's step before autocast became its default:
                              add_lora on the same base (after the HF adapter is unloaded), SEBP,
                              logits only at labelled rows in 2,048-row chunks, no
                              autocast (fp32 LoRA products), paged 8-bit AdamW; padded
  ours/autocast               bf16 autocast, fused AdamW, 512-row loss chunks; no SEBP
  ours/+sebp                  + kernels/sebp.patch: padding rows skipped in every backward
                              (= the engine's default step on a padded batch)
  ours/+sebp_runs             +sebp with sft.sebp_kernel=runs: cuBLAS on each run of active rows in
                              place (no copies, nothing tuned per row count); against +sebp
  ours/+sebp_indexed          +sebp with sft.sebp_kernel=indexed: every layer through the
                              row-gathering Triton GEMMs; against +sebp
  ours/+sebp_runs+fused_lora  + sft.fused_lora (kernels/lora_fused.py): LoRA's scaled branch added
                              inside the GEMMs; against +sebp_runs
  ours/+packing               + engine/data/packing.collate_packed: one row, no padding at all
                              (SEBP then has nothing to skip)
  ours/+liger                 + Liger-Kernel's fused RMSNorm / SwiGLU / RoPE
                              (engine/models/liger.py; liger-kernel 0.8.5 carried in .gpu-site)
  ours/+flex                  + flex_attention (a BlockMask from the packed position ids
                              instead of sdpa with a dense [N, N] boolean mask)
  ours/+flex+fused_lora       +flex with sft.fused_lora; against +flex
  ours/+ckpt_auto_12, _24     + model.gradient_checkpointing=auto with model.memory_budget_gib
                              12 / 24: the planner's split (engine/planning/planner.checkpoint_split), the
                              first k layers checkpointed, the others keep their activations
  ours/+no_ckpt               + model.gradient_checkpointing=false: no recomputation, every
                              layer's activations kept (the speed/memory trade the planner prices)
  unsloth/padded, /packed     bench/reference/unsloth_bench.py's own phases in separate processes
                              (Unsloth patches transformers on import): save a random
                              bf16 7B to disk, then Unsloth's 4-bit load + LoRA + steps
Every "ours" row starts from a freshly initialised adapter (B = 0), so its first loss is
the base model's loss and must match the HF first loss within bf16 noise.

Repeats: the rows are timed in rounds, every row once per round (A B C ... A B C ...), so
drift of the clocks, the host or the allocator during the call lands on every row alike;
two rounds always, a third when the time left allows. Each run starts from a fresh
adapter and optimizer with the allocator's cache emptied (warm-up, then timed steps);
Liger's patch is switched off and on between rows (LigerSwitch). A row reports the
median of its run medians and their spread (min / max); a lever counts as faster only
when each of its runs beats the same round's run of the row before it.
Each run also records what could make it move: torch.compile's counters during it
(frames, graphs, recompiles, cache hits; TORCH_LOGS=recompiles prints the reasons), the
allocator (cudaMalloc calls, retries, reserved vs allocated at the peak), the GPU's SM
clock, power and throttle reasons sampled every 0.2 s, the host's steal time, and how
long the host waited for the GPU at the phase ends (`sync_wait`: ~0 = host-bound).
`flex_shapes` then trains on packed rows of lengths the flex kernels have not seen,
counting recompilations per new shape (what a real packed run meets every step).

    python bench/sft_speed.py --tiny    # CPU, tiny config, seconds (Unsloth phase skipped)
    PYTHONPATH=$PWD/.gpu-site python bench/sft_speed.py   # GPU: $OUT/sft_speed.json + table
Unsloth needs `.unsloth-site/` (a folder with Unsloth installed: `pip install --target
.unsloth-site unsloth`) and bitsandbytes in `.gpu-site/`; it is skipped when the folder is missing.
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
ap.add_argument("--ref", default=str(C.ROOT / "bench" / "reference"), help="folder holding baseline.py, unsloth_bench.py")
ap.add_argument("--unsloth-site", default=str(C.ROOT / ".unsloth-site"))
ap.add_argument("--gpu-site", default=str(C.ROOT / ".gpu-site"), help="slim bitsandbytes (and peft) for subprocesses")
ap.add_argument("--skip-unsloth", action="store_true")
ap.add_argument("--rows", default="", help="our rows to time, comma-separated (before, autocast, +sebp, +sebp_runs, "
                "+sebp_indexed, +sebp_runs+fused_lora, +packing, +liger, +flex, +flex+fused_lora, +ckpt_auto_12, "
                "+ckpt_auto_24, +no_ckpt, flex_shapes); all by default")
ap.add_argument("--time-limit", type=float, default=560.0, help="seconds for the whole script")
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

T0 = time.perf_counter()
B = C.load_baseline(args.ref)
DEV = B.DEV
N_WARM, N_MEAS = (1, 2) if args.tiny else (2, 4)
RUNS = 2  # rounds always run; up to RUNS_MAX when time is left
RUNS_MAX = 3
WANTED = {r.strip() for r in args.rows.split(",") if r.strip()}
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
R: dict = {"config": {"arch": B.C7B, "seq": B.SEQ, "batch": B.BATCH, "lora": "r16 a32 all 7 projections",
                      "warmups": N_WARM, "timed": N_MEAS, "runs": RUNS, "tiny": args.tiny},
           "env": B.R["env"], "hf": {}, "ours": {}, "unsloth": {}, "planner": [], "errors": {}, "notes": []}


BUDGET = C.Budget("sft_speed", args.time_limit, OUT / "sft_speed.json", R, T0)
left, log, dump, section = BUDGET.left, BUDGET.log, BUDGET.dump, BUDGET.section


# --------------------------------------------------------------------------- HF baseline


def hf_rows(model, padded, packed, real):
    pm, opt, trainable, _ = B.add_lora(model)
    R["hf"]["trainable_params"] = trainable
    with torch.no_grad(), B.autocast():
        R["hf"]["first_loss"] = float(pm(**padded).loss)  # the first step's loss (adapter B = 0)
    runs: dict = {}
    for _ in range(RUNS):  # interleaved: padded, packed, padded, packed
        for key, batch in (("padded", padded), ("packed_sdpa", packed)):
            C.reset_peak()
            with Probe() as probe:
                m = B.train_bench(pm, opt, [batch], n_warm=N_WARM, n_meas=N_MEAS)
            m.update({"peak_alloc": C.peak(), "peak_alloc_GiB": C.gib(C.peak()), **probe.found})
            runs.setdefault(key, []).append(m)
            m = merge_runs(runs[key])
            m["real_tok_per_s"] = real / m["total"]
            R["hf"][key] = m
            log(f"hf {key}: {m['total']:.3f}s/step (runs {m['run_medians']}), peak {m['peak_alloc_GiB']} GiB")
    del opt
    return pm.unload()  # the base again, Linear4bit layers restored, for our rows


# --------------------------------------------------------------------------- repeats


def gpu_clocks() -> dict:
    """SM clock (MHz), power (W), temperature (C) as nvidia-smi reads them now."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5).stdout
        sm, power, temp = (float(x) for x in out.splitlines()[0].split(","))
        return {"sm_mhz": sm, "power_w": power, "temp_c": temp}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {}


def compile_counters() -> dict:
    """torch.compile's counters (dynamo frames, unique graphs, recompiles, AOT / inductor
    cache hits and misses), flattened: their difference over a run is what it compiled."""
    from torch._dynamo.utils import counters

    return {f"{group}.{k}": int(v) for group, c in counters.items() for k, v in c.items()
            if isinstance(v, (int, float))}


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].values())) if "stats" in counters else 0


class Sampler:
    """The GPU's SM clock, power and clock-throttle reasons every 0.2 s in a thread
    (NVML, cheap calls), so a slow run shows whether the card or the host was slow."""

    def __init__(self):
        self.samples, self.stop = [], None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no NVML here: no samples
            self.nv = None

    def __enter__(self):
        import threading

        if self.nv is None or DEV != "cuda":
            return self
        self.stop = threading.Event()

        def loop():
            nv = self.nv
            while not self.stop.wait(0.2):
                try:
                    reasons = (nv.nvmlDeviceGetCurrentClocksEventReasons(self.h)
                               if hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
                               else nv.nvmlDeviceGetCurrentClocksThrottleReasons(self.h))
                    self.samples.append((nv.nvmlDeviceGetClockInfo(self.h, nv.NVML_CLOCK_SM),
                                         nv.nvmlDeviceGetPowerUsage(self.h) / 1000.0,
                                         nv.nvmlDeviceGetUtilizationRates(self.h).gpu, int(reasons)))
                except Exception:  # noqa: BLE001
                    return

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.stop is not None:
            self.stop.set()
            self.thread.join()
        return False

    def summary(self) -> dict:
        import statistics

        if not self.samples:
            return {}
        sm, pw, util, reasons = zip(*self.samples)
        acc = 0
        for r in reasons:
            acc |= r
        # NVML bits: 0x1 idle, 0x2 application clocks, 0x4 software power cap, 0x8 HW slowdown,
        # 0x20 / 0x40 software / HW thermal, 0x80 power brake
        return {"n": len(sm), "sm_mhz_min": min(sm), "sm_mhz_median": statistics.median(sm),
                "power_w_median": round(statistics.median(pw), 1), "util_pct_median": statistics.median(util),
                "throttle_reasons_or": hex(acc),
                "share_power_or_thermal_capped": round(sum(bool(r & 0xEC) for r in reasons) / len(sm), 3)}


def mem_state() -> dict:
    """The caching allocator's state: reserved vs allocated (what fragmentation wastes),
    segments, cudaMalloc calls and retries."""
    if DEV != "cuda":
        return {}
    st = torch.cuda.memory_stats()
    g = lambda k: st.get(k, 0)  # noqa: E731
    return {"reserved": g("reserved_bytes.all.current"), "allocated": g("allocated_bytes.all.current"),
            "reserved_peak": g("reserved_bytes.all.peak"), "allocated_peak": g("allocated_bytes.all.peak"),
            "inactive_split": g("inactive_split_bytes.all.current"), "inactive_split_peak":
            g("inactive_split_bytes.all.peak"), "segments": g("segment.all.current"),
            "mallocs": g("num_device_alloc"), "retries": g("num_alloc_retries")}


class Probe:
    """What moved during a timed run: torch.compile work (dynamo's counters), the caching
    allocator (cudaMalloc calls, retries, fragmentation), the GPU clock / power / throttle
    reasons sampled during the run, and the host (CPU seconds per wall second, CPU time
    stolen by the hypervisor, garbage collections)."""

    def __enter__(self):
        import gc

        import psutil

        self.gc0 = [g["collections"] for g in gc.get_stats()]
        self.cpu0, self.sys0, self.wall0 = time.process_time(), psutil.cpu_times(), time.perf_counter()
        self.frames, self.counters = compiled_frames(), compile_counters()
        self.mem = mem_state()
        self.clock0 = gpu_clocks() if DEV == "cuda" else {}
        self.sampler = Sampler().__enter__()
        return self

    def __exit__(self, *exc):
        self.sampler.__exit__()
        mem = mem_state()
        c1 = compile_counters()
        self.found = {
            "dynamo_frames_during_run": compiled_frames() - self.frames,
            "compile_counters_during_run": {k: v - self.counters.get(k, 0) for k, v in c1.items()
                                            if v != self.counters.get(k, 0)},
            "cuda_mallocs_during_run": mem.get("mallocs", 0) - self.mem.get("mallocs", 0),
            "alloc_retries_during_run": mem.get("retries", 0) - self.mem.get("retries", 0),
            "allocator_at_start": {k: C.gib(v) if k not in ("segments", "mallocs", "retries") else v
                                   for k, v in self.mem.items()},
            # 1 - allocated/reserved at the run's peak: the share of the reserved memory
            # that the allocator held without handing it out (fragmentation, cached blocks)
            "fragmentation_at_peak": round(1 - mem["allocated_peak"] / mem["reserved_peak"], 3)
            if mem.get("reserved_peak") else None,
            "inactive_split_peak_GiB": C.gib(mem.get("inactive_split_peak")) if mem else None,
            "segments_at_end": mem.get("segments"),
            "clock_before": self.clock0, "clock_after": gpu_clocks() if DEV == "cuda" else {},
            "gpu_during_run": self.sampler.summary(),
            "peak_reserved_GiB": C.gib(torch.cuda.max_memory_reserved()) if DEV == "cuda" else None,
        }
        import gc

        import psutil

        wall = time.perf_counter() - self.wall0
        now = psutil.cpu_times()
        busy = lambda t: t.user + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)  # noqa: E731
        self.found.update(
            # this process's CPU seconds per wall second (Python + launch threads; a
            # synchronize spins, so this is ~1 whether the host or the GPU is the bottleneck),
            # the whole machine's busy cores, and cores' time stolen by the hypervisor
            process_cpu_per_wall=round((time.process_time() - self.cpu0) / wall, 3),
            machine_busy_cores=round((busy(now) - busy(self.sys0)) / wall, 2),
            steal_cores=round((getattr(now, "steal", 0) - getattr(self.sys0, "steal", 0)) / wall, 3),
            gc_collections=[g["collections"] - c for g, c in zip(gc.get_stats(), self.gc0)])
        return False


def merge_runs(runs: list[dict]) -> dict:
    """One row from several runs: the median of the run medians, their spread, each run."""
    import statistics

    med = [r["total"] for r in runs]
    out = {k: statistics.median(r[k] for r in runs) for k in ("total", "fwd", "bwd", "opt") if k in runs[0]}
    out.update(run_medians=[round(x, 4) for x in med], spread=round((max(med) - min(med)) / out["total"], 4),
               runs=runs, peak_alloc=max(r.get("peak_alloc") or 0 for r in runs) or None)
    out["peak_alloc_GiB"] = C.gib(out["peak_alloc"])
    for k in ("first_loss", "losses"):
        if k in runs[0]:
            out[k] = runs[0][k]
    return out


def add_run(name: str, run: dict, real: int) -> dict:
    runs = (R["ours"].get(name) or {}).get("runs", []) + [run]
    m = merge_runs(runs)
    m["real_tok_per_s"] = real / m["total"]
    m["tokens_in_batch"] = run.get("tokens_in_batch")
    for k in ("checkpointed_layers", "budget_GiB"):
        if k in run:
            m[k] = run[k]
    R["ours"][name] = m
    return m


# A row measured against another than the one listed before it: the variants of one lever
# (SEBP's backward kernels, fused LoRA) sit beside the row they vary, and the chain of the
# others goes on past them.
VS = {"+sebp_runs": "+sebp", "+sebp_indexed": "+sebp", "+sebp_runs+fused_lora": "+sebp_runs",
      "+packing": "+sebp", "+flex+fused_lora": "+flex", "+ckpt_auto_12": "+flex"}


def lever_verdicts() -> dict:
    """Each lever row against the row before it (or its VS row): faster in every same-numbered run?"""
    names = list(R["ours"])
    out = {}
    for prev, cur in zip(names, names[1:]):
        if VS.get(cur) in R["ours"]:
            prev = VS[cur]
        a, b = R["ours"][prev]["run_medians"], R["ours"][cur]["run_medians"]
        n = min(len(a), len(b))
        out[cur] = {"vs": prev, "faster_in_every_run": n >= 2 and all(b[i] < a[i] for i in range(n)),
                    "runs_compared": n, "change": round(R["ours"][cur]["total"] / R["ours"][prev]["total"] - 1, 4)}
    return out


# --------------------------------------------------------------------------- ours


class Row:
    def __init__(self, ids, labels):
        self.input_ids, self.labels = ids, labels


class LigerSwitch:
    """engine/models/liger.py's patch applied once, then switched off and on again between rows:
    Liger binds its forwards into the instances' __dict__ and replaces functions of the
    modeling module (RoPE); the switch records both and puts either set back. Each row's
    first loss (fresh adapter) checks that the model is the same after switching."""

    _NAMES = ("forward", "_get_name", "extra_repr")

    def __init__(self, model):
        self.inst, self.funcs, self.on = [], [], False
        if DEV != "cuda":  # --tiny: the rows still run (the plumbing is what is checked)
            R["notes"].append("liger not applied on the CPU (Triton kernels need a GPU)")
            return
        from edgetune.engine.models import liger

        base = model.get_base_model()
        mod = sys.modules[type(base).__module__]
        missing = object()
        funcs0 = dict(vars(mod))
        inst0 = {id(m): {k: m.__dict__.get(k, missing) for k in self._NAMES} for m in base.modules()}
        R["notes"].append(f"liger: {liger.apply(model, 'on')}")
        for m in base.modules():
            for k in self._NAMES:
                old, new = inst0[id(m)][k], m.__dict__.get(k, missing)
                if new is not old:
                    self.inst.append((m, k, None if old is missing else old, new))
        self.funcs = [(mod, k, funcs0[k], v) for k, v in vars(mod).items()
                      if callable(v) and not isinstance(v, type) and k in funcs0 and funcs0[k] is not v]
        self.on = True
        R["notes"].append(f"liger switch: {len(self.inst)} instance methods, "
                          f"{[k for _, k, _, _ in self.funcs]} module functions")

    def set(self, on: bool) -> None:
        if on == self.on or not (self.inst or self.funcs):
            return
        for m, k, old, new in self.inst:
            if on:
                m.__dict__[k] = new
            elif old is None:
                m.__dict__.pop(k, None)
            else:
                m.__dict__[k] = old
        for mod, k, old, new in self.funcs:
            setattr(mod, k, new if on else old)
        self.on = on


def set_attention(model, flex: bool):
    if DEV != "cuda":  # flex_attention has no backward on the CPU
        return
    model.get_base_model().set_attn_implementation("flex_attention" if flex else "sdpa")


def auto_split(budget_gib: float, real: int) -> int:
    """The planner's checkpointed-layer count for the packed 7B step under a budget: what
    the engine's model.load does for gradient_checkpointing: auto."""
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.planning import planner

    sets = C.sft_row_settings("sft_speed", f"+ckpt_auto_{budget_gib:g}", {"seq": B.SEQ, "real_tokens": real})
    cfg = resolve(overrides=[f"model.name={C.arch_folder(B.C7B)}", "model.quant=nf4", "lora.r=16", "lora.alpha=32",
                             *sets])
    split = planner.checkpoint_split(cfg, device="cuda")
    R["notes"].append(split["note"])
    return split["checkpointed"]


def ours_rows(base, padded, real):
    import contextlib

    from edgetune.kernels import lora_fused, sebp

    from edgetune.engine.core.settings import LoraSettings

    from edgetune.engine.data import collate
    from edgetune.engine.data.packing import collate_packed

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.loop import make_optimizer

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
    splits = {b: auto_split(b, real) for b in (12, 24)}
    # (name, batch, SEBP, Liger, flex_attention, checkpointed layers (None = all), step settings)
    levers = [("before", b_padded, True, False, False, None, C.STEP_BEFORE),
              ("autocast", b_padded, False, False, False, None, {}),
              ("+sebp", b_padded, True, False, False, None, {}),
              ("+sebp_runs", b_padded, True, False, False, None, {"sebp_kernel": "runs"}),
              ("+sebp_indexed", b_padded, True, False, False, None, {"sebp_kernel": "indexed"}),
              ("+sebp_runs+fused_lora", b_padded, True, False, False, None, {"sebp_kernel": "runs", "fused_lora": True}),
              ("+packing", b_packed, True, False, False, None, {}),
              ("+liger", b_packed, True, True, False, None, {}), ("+flex", b_packed, True, True, True, None, {}),
              ("+flex+fused_lora", b_packed, True, True, True, None, {"fused_lora": True}),
              ("+ckpt_auto_12", b_packed, True, True, True, splits[12], {}),
              ("+ckpt_auto_24", b_packed, True, True, True, splits[24], {}),
              ("+no_ckpt", b_packed, True, True, True, 0, {})]
    if WANTED:
        levers = [lv for lv in levers if lv[0] in WANTED]
    if DEV == "cpu":  # the row-gathering Triton kernels need a GPU (or the interpreter, for tests)
        levers = [lv for lv in levers if lv[6].get("sebp_kernel") != "indexed"]
        R["notes"].append("+sebp_indexed skipped on the CPU (Triton kernels need a GPU)")
    folder = C.arch_folder(B.C7B)
    handle = sebp.patch(model)
    switch = LigerSwitch(model)

    def timed(name, batch, use_sebp, use_liger, flex, ckpt, how):
        nonlocal handle
        with contextlib.ExitStack() as stack:
            if how.get("fused_lora"):  # the fused forwards under SEBP's patch, as the engine nests them
                sebp.unpatch(model)
                stack.callback(lambda: sebp.patch(model))
                stack.enter_context(lora_fused.enabled(model, True))
                stack.callback(sebp.unpatch, model)
                handle = sebp.patch(model)
            handle.backend = sebp.KERNELS[how.get("sebp_kernel", "auto")]
            stack.callback(setattr, handle, "backend", "auto")
            timed_row(name, batch, use_sebp, use_liger, flex, ckpt, how, handle)
        handle = sebp.patch(model)  # the model's handle (patch is idempotent): a new one after a fused row

    def timed_row(name, batch, use_sebp, use_liger, flex, ckpt, how, handle):
        model_lib.checkpoint_first_layers(model.get_base_model(), ckpt)
        set_attention(model, flex)
        switch.set(use_liger)
        if not use_sebp:
            sebp.set_active_rows(handle, None)  # dense backward everywhere for this row
        h = handle if use_sebp else None
        kw = {k: v for k, v in how.items() if k not in ("optimizer", "sebp_kernel", "fused_lora")}
        C.reinit_lora(model, seed=0)
        opt = make_optimizer(model.parameters(), how.get("optimizer", "auto"), 1e-4, 0.0, DEV)
        C.reset_peak()
        with Probe() as probe:
            m = C.time_steps(lambda: C.engine_step(model, opt, batch, h, **kw), N_WARM, N_MEAS, log)
        m.update(probe.found, tokens_in_batch=int(batch["input_ids"].numel()), round_started_s=round(
            time.perf_counter() - T0, 1))
        if ckpt is not None:
            m["checkpointed_layers"] = ckpt
        row = add_run(name, m, real)
        del opt
        cc = m["compile_counters_during_run"]
        log(f"ours {name}: run {len(row['runs'])} {m['total']:.3f}s/step (sync wait {m.get('sync_wait', 0):.3f}), "
            f"peak {m['peak_alloc_GiB']} GiB (reserved {m['peak_reserved_GiB']}, fragmentation "
            f"{m['fragmentation_at_peak']}), first loss {m['first_loss']:.4f}, compile counters {cc}, cudaMallocs "
            f"{m['cuda_mallocs_during_run']}, GPU {m['gpu_during_run']}, process CPU/wall "
            f"{m['process_cpu_per_wall']}, steal {m['steal_cores']}, gc {m['gc_collections']}")

    # Every row once per round, rounds one after another (A B C ... A B C ...): clock,
    # host or allocator drift during the call then lands on every row alike. The first
    # round's warm-up steps pay torch.compile (flex_attention) once; later rounds compile
    # nothing (counted per run). A third round runs when the time left allows it.
    round_s = []
    for rnd in range(RUNS_MAX):
        need = (round_s[-1] * 1.2 if round_s else 0) + (90 if not args.tiny else 5)
        if rnd >= RUNS and left() < need:
            R["notes"].append(f"round {rnd + 1} skipped: {left():.0f}s left, a round needs ~{need:.0f}s")
            break
        t_round = time.perf_counter()
        for name, batch, use_sebp, use_liger, flex, ckpt, how in levers:
            section(f"ours/{name}/round{rnd + 1}", lambda: timed(name, batch, use_sebp, use_liger, flex, ckpt, how),
                    need_s=5 if args.tiny else 20)
        round_s.append(time.perf_counter() - t_round)
        R["rounds_s"] = [round(x, 1) for x in round_s]
    # the planner models the engine as it is: compare the rows that are that engine
    for name in R["ours"]:
        sets = C.sft_row_settings("sft_speed", name, {"seq": B.SEQ, "real_tokens": real})
        if sets is not None:
            R["planner"].append(C.compare(f"7B SFT {name}", C.planner_prediction(folder, "sft", sets),
                                          R["ours"][name]["peak_alloc"]))
    R["levers"] = lever_verdicts()
    switch.set(True)
    set_attention(model, True)
    # after Unsloth's rows (which need the time more): the model stays on the GPU till then
    if WANTED and "flex_shapes" not in WANTED:
        return model
    LATER.append(lambda: section("flex_shapes", lambda: flex_shapes(model, rows, handle, make_optimizer,
                                                                    collate_packed), need_s=10 if args.tiny else 40))
    return model


LATER: list = []


def flex_shapes(model, rows, handle, make_optimizer, collate_packed):
    """The packed flex step on batches of lengths not seen yet (a real run's every step):
    per step the time and the frames torch.compile compiled (a recompilation per shape
    costs seconds each time; dynamo marks the length dynamic after the second one)."""
    from edgetune.engine.models import model as model_lib

    model_lib.checkpoint_first_layers(model.get_base_model(), None)
    C.reinit_lora(model, seed=0)
    opt = make_optimizer(model.parameters(), "auto", 1e-4, 0.0, DEV)
    out = []
    for n_rows in (7, 6, 5, 8, 7, 4):
        if left() < (15 if args.tiny else 25):
            R["notes"].append(f"flex_shapes stopped at {len(out)} steps: time")
            break
        batch = {k: v.to(DEV) for k, v in collate_packed(rows[:n_rows]).items()}
        with Probe() as probe:
            t0 = time.perf_counter()
            loss, ph = C.engine_step(model, opt, batch, handle)
            total = time.perf_counter() - t0
        out.append({"tokens": int(batch["input_ids"].numel()), "s": round(total, 3), "fwd": round(ph["fwd"], 3),
                    "bwd": round(ph["bwd"], 3), "dynamo_frames": probe.found["dynamo_frames_during_run"]})
        log(f"flex shape {out[-1]}")
        R["flex_shapes"] = out
    del opt


# --------------------------------------------------------------------------- Unsloth


class UnslothPhase:
    """One phase of bench/reference/unsloth_bench.py in its own process (Unsloth patches
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
    for key in ("run", "run2")[:RUNS]:
        if key == "run2" and left() < 130:
            R["notes"].append(f"Unsloth's second run skipped: {left():.0f}s left")
            break
        part_dir = tempfile.mkdtemp(prefix="unsloth-parts-")
        run = UnslothPhase("unsloth", UNSLOTH_DIR, part_dir, [args.unsloth_site, args.gpu_site])
        R["unsloth"][key] = run.wait(cap_s=min(260, left() - 10))
        dump()
    subprocess.run(["rm", "-rf", UNSLOTH_DIR])


def unsloth_merged() -> dict:
    """Unsloth's rows with the same run statistics as ours (its steps' medians per run)."""
    out = {}
    for key in ("run", "run2"):
        for row, m in ((R["unsloth"].get(key) or {}).get("steps") or {}).items():
            out.setdefault(row, []).append({"total": m["total"], "fwd": m.get("fwd"), "bwd": m.get("bwd"),
                                            "opt": m.get("opt"), "peak_alloc": int((m.get("max_alloc_GiB") or 0) * C.GiB),
                                            "first_loss": (m.get("losses") or [None])[0], "all_totals": m.get("all_totals")})
    return {row: merge_runs(runs) for row, runs in out.items()}


# --------------------------------------------------------------------------- table


def table() -> str:
    real = R["config"]["real_tokens"]
    hf_pad = (R["hf"].get("padded") or {}).get("total")
    us_steps = unsloth_merged()
    us_pad = (us_steps.get("padded") or {}).get("total")
    levers = R.get("levers") or {}
    first_hf = R["hf"].get("first_loss")
    rows = [("hf/" + k, R["hf"][k]) for k in ("padded", "packed_sdpa") if k in R["hf"]]
    rows += [("ours/" + k, v) for k, v in R["ours"].items()]
    rows += [("unsloth/" + k, v) for k, v in us_steps.items()]
    out = [f"SFT step, Qwen2.5-7B arch NF4, LoRA r16 all-linear, checkpointing, 8 x {B.SEQ} padded "
           f"({real} real tokens); each run the median of {N_MEAS} steps after {N_WARM} warm-up; s/step the median "
           "of the runs; spread (max - min) / median",
           "", "| stack / lever | s/step | runs (s) | min / max (spread) | real tokens/s | peak allocated GiB | first loss "
               "| vs HF padded | vs Unsloth padded | faster than the row before in every run |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in rows:
        t = m["total"]
        peak = m.get("peak_alloc_GiB", m.get("max_alloc_GiB"))
        first = m.get("first_loss", (m.get("losses") or [None])[0])
        if name == "hf/padded":
            first = first_hf
        fl = "-" if first is None else f"{first:.4f}"
        vs_hf = f"{hf_pad / t:.2f}x" if hf_pad else "-"
        vs_us = f"{us_pad / t:.2f}x" if us_pad else "-"
        runs = " / ".join(f"{x:.3f}" for x in m.get("run_medians", [t]))
        rm = m.get("run_medians", [t])
        spread = f"{min(rm):.3f} / {max(rm):.3f} ({100 * m['spread']:.1f}%)" if "spread" in m else "-"
        lv = levers.get(name.removeprefix("ours/"))
        faster = "-" if lv is None or not name.startswith("ours/") else \
            f"{'yes' if lv['faster_in_every_run'] else 'NO'} ({100 * lv['change']:+.1f}%)"
        if name.startswith("ours/+ckpt_auto"):
            name += f" ({m.get('checkpointed_layers')} of {B.C7B['num_hidden_layers']} layers checkpointed)"
        out.append(f"| {name} | {t:.3f} | {runs} | {spread} | {real / t:,.0f} | {peak} | {fl} | {vs_hf} | {vs_us} "
                   f"| {faster} |")
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
    ours = section("ours", lambda: ours_rows(base, padded, real))
    del model, base
    if ours is not None:  # flex_shapes trains it after Unsloth's rows; its activations go now
        for p in ours.parameters():
            p.grad = None
    try:
        C.reset_peak()
    except RuntimeError as e:  # a CUDA error in a row is sticky; Unsloth runs in its own process anyway
        R["notes"].append(f"CUDA state after our rows: {e}"[:300])
    if started is not None:
        section("unsloth", lambda: unsloth_rows(started), need_s=20 if args.tiny else 150)
    for fn in LATER:
        fn()
    R["table"] = table()
    R["wall_s"] = round(time.perf_counter() - T0, 1)
    dump()
    print("\n" + R["table"], flush=True)


if __name__ == "__main__":
    main()
