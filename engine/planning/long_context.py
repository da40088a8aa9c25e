"""Long sequences in the memory planner: what grows with the sequence, the levers that
bound it, and the longest sequence that fits a memory.

Imports no torch (the app calls it). The levers (engine/models/long_context.py,
engine/models/offload.py), each a setting that is off by default:

- model.offload_activations: the checkpointed layer inputs (layers x tokens x hidden)
  wait in pinned host memory; about two are on the GPU at a time;
- model.mlp_chunk_tokens: the MLP runs on that many tokens at a time, each chunk
  recomputed in the backward: its [tokens, intermediate] activations and gradients exist
  for one chunk, and the layer keeps the MLP's input instead;
- model.mask_free_attention: no [tokens, tokens] mask for packed or padded rows, keys and
  values at their grouped width.

The planner's model of the chunked MLP and the mask-free attention is in
engine/planning/long_levers.py (planner.py calls it). `longest` bisects data.max_seq_len
against the planner's total; `refuse_too_long` turns a length far past it into a one-line refusal
naming the lever that makes it fit. The levers apply to the step of a method whose
record has `offload` (the same step runs all of them).
"""

from __future__ import annotations

import copy

from edgetune.engine.planning import planner
from edgetune.engine.planning.long_levers import mlp_share, mlp_tokens

# A lever's suggested chunk when model.mlp_chunk_tokens is off: [4,096, intermediate] is
# 0.15 GB in bf16 at a 7B's width (what smaller chunks cost in speed: bench/long_context.py).
MLP_CHUNK_SUGGESTED = 4096

# The lengths of the table of what grows (docs/performance.md) and the memories that
# `edgetune estimate --fit-seq-len` reports by default, in GiB.
GROWTH_TOKENS = (32768, 131072, 524288)
GROWTH_MODELS = ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-72B")
FIT_MEMORIES_GIB = (24, 48, 80)

# A run longer than the longest length that fits by more than this share is refused
# before loading: the planner aims at +-15%, closer calls are left to the run itself.
REFUSE_MARGIN = 0.15

MAX_TOKENS = 2**20  # data.max_seq_len's upper bound (engine/core/settings.TOKENS)


# --------------------------------------------------------------------------- what grows


def long_config(name: str, tokens: int, sets: list[str] = ()):
    """An SFT config of model `name` at batch 1 on one `tokens`-token row: NF4, LoRA r16 on
    all linear layers, every layer checkpointed, Liger off (the planner's CUDA defaults
    otherwise)."""
    from edgetune.engine.core.settings import resolve

    return resolve(overrides=["method=sft", f"model.name={name}", "model.quant=nf4", "lora.r=16", "lora.alpha=32",
                              "lora.target_modules=all-linear", "model.gradient_checkpointing=true",
                              "model.liger=off", "sft.batch_size=1", "sft.packing=false",
                              f"data.max_seq_len={tokens}", *sets])


def growth(cfg) -> dict:
    """The parts of the planner's prediction for `cfg` (one row, batch 1, CUDA) that grow
    with the sequence, in bytes: the checkpointed layer inputs (on the GPU), one layer's MLP
    activations, attention's workspace for a packed row on sdpa (the boolean mask and the
    keys and values repeated to every head; 0 with mask_free_attention), one loss chunk's
    logits, one layer's recompute, and the total."""
    ctx, _ = planner.make_ctx(cfg, "cuda", cfg.sft.optimizer)
    a, t = ctx.arch, cfg.data.max_seq_len
    k = planner.n_checkpointed(ctx)
    kept = (2 if ctx.offload and k else k) * t * a.hidden * ctx.act_bytes
    attention = 0 if ctx.mask_free else planner.mask_bytes(1, t, True) + t * 2 * (a.q_dim - a.kv_dim) * ctx.act_bytes
    plan = planner.estimate(cfg, device="cuda", detect_gpu=False)
    return {"tokens": t, "checkpointed_inputs": kept, "host_pinned": plan["host_pinned"],
            "mlp": mlp_share(ctx, mlp_tokens(ctx, t)), "attention": attention,
            "logits_chunk": plan["logits_chunk"], "layer_recompute": plan["layer_recompute"], "total": plan["total"]}


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f}"


def growth_markdown(models=GROWTH_MODELS, lengths=GROWTH_TOKENS) -> str:
    """The table of docs/performance.md: the planner's parts at each length, plain and with
    every lever on."""
    head = ("| model | tokens | levers | checkpointed inputs (GPU) | one layer's MLP | attention mask + repeated k/v "
            "(packed, sdpa) | logits chunk | one layer's recompute | predicted total |")
    out = [head, "|---|---|---|---|---|---|---|---|---|"]
    for name in models:
        for t in lengths:
            for label, sets in (("none", []), ("all", all_levers())):
                g = growth(long_config(name, t, sets))
                out.append(f"| {name.split('/')[-1]} | {t:,} | {label} | {_gib(g['checkpointed_inputs'])} | "
                           f"{_gib(g['mlp'])} | {_gib(g['attention'])} | {_gib(g['logits_chunk'])} | "
                           f"{_gib(g['layer_recompute'])} | {_gib(g['total'])} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- the longest that fits


# Each lever as the settings that switch it on (the offload's copies back double-buffered).
LEVERS = {
    "model.offload_activations": {"offload_activations": True, "offload_prefetch": True},
    "model.mlp_chunk_tokens": {"mlp_chunk_tokens": MLP_CHUNK_SUGGESTED},
    "model.mask_free_attention": {"mask_free_attention": True},
}


def all_levers() -> list[str]:
    """Every lever on, as key=value overrides (with gradient checkpointing, which offloading needs)."""
    return [f"model.{k}={str(v).lower()}" for on in LEVERS.values() for k, v in on.items()]


def _label(on: dict) -> str:
    return ", ".join(f"model.{k}={str(v).lower()}" for k, v in on.items() if k != "offload_prefetch")


def lever_settings(cfg) -> list[tuple[str, dict]]:
    """(label, model settings) of each long-sequence lever `cfg` does not use yet, then all
    of them together; gradient checkpointing first where it is off (offloading needs it)."""
    m = cfg.model
    out = [] if m.gradient_checkpointing else [{"gradient_checkpointing": True}]
    out += [on for on in LEVERS.values() if not any(getattr(m, k) for k in on if k != "offload_prefetch")]
    labelled = [(_label(on), on) for on in out]
    if len(out) > 1:
        labelled.append((" + ".join(label for label, _ in labelled), {k: v for on in out for k, v in on.items()}))
    return labelled


def _with(cfg, on: dict):
    c = copy.deepcopy(cfg)
    for k, v in on.items():
        setattr(c.model, k, v)
    return c


def _total(cfg, tokens: int) -> int:
    c = copy.deepcopy(cfg)
    c.data.max_seq_len = tokens
    return planner.estimate(c, device="cuda", detect_gpu=False)["total"]


def longest(cfg, memory: int) -> int:
    """The largest data.max_seq_len of `cfg` (all else as set) whose predicted peak on a
    CUDA card fits `memory` bytes; 0 when not even one token fits."""
    if _total(cfg, 1) > memory:
        return 0
    lo, hi = 1, MAX_TOKENS
    if _total(cfg, hi) <= memory:
        return hi
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _total(cfg, mid) <= memory else (lo, mid)
    return lo


def fit_rows(cfg, memories_gib=FIT_MEMORIES_GIB) -> list[dict]:
    """For each memory (GiB): the longest data.max_seq_len as set, and with each lever
    `cfg` does not use yet (lever_settings)."""
    levers = [(label, _with(cfg, sets)) for label, sets in lever_settings(cfg)]
    rows = []
    for gib in memories_gib:
        memory = int(gib * 2**30)
        rows.append({"memory_gib": gib, "as_set": longest(cfg, memory),
                     "levers": {label: longest(c, memory) for label, c in levers}})
    return rows


def fit_text(rows: list[dict], cfg) -> str:
    """fit_rows in lines, for `edgetune estimate --fit-seq-len`."""
    shape = f"sft.batch_size={cfg.sft.batch_size}" + (", packed" if cfg.sft.packing else "")
    out = [f"longest data.max_seq_len that fits (the planner's prediction on a CUDA card, {shape}):"]
    for r in rows:
        out.append(f"  {r['memory_gib']:g} GiB: {r['as_set']:,} tokens as set")
        out += [f"    with {label}: {n:,}" for label, n in r["levers"].items()]
    return "\n".join(out)


def parse_memories(text: str) -> tuple[float, ...]:
    """--fit-seq-len's value: GiB, comma-separated ("24,48,80"), or "" for FIT_MEMORIES_GIB."""
    from edgetune.engine.core.errors import ConfigError

    if not str(text).strip():
        return FIT_MEMORIES_GIB
    try:
        got = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        got = ()
    if not got or any(not 0 < g <= 2**20 for g in got):
        raise ConfigError(f"--fit-seq-len: {text!r} is not a list of GiB (e.g. 24,48,80)")
    return got


def fit_markdown(models=GROWTH_MODELS, memories_gib=FIT_MEMORIES_GIB) -> str:
    """The longest data.max_seq_len per memory of docs/performance.md: each model at batch
    1 (long_config), plain and with every lever on."""
    out = ["| model | levers | " + " | ".join(f"{g:g} GiB" for g in memories_gib) + " |",
           "|---|---|" + "---|" * len(memories_gib)]
    for name in models:
        for label, sets in (("none", []), ("all", all_levers())):
            cfg = long_config(name, 1, sets)
            cells = [f"{longest(cfg, int(g * 2**30)):,}" for g in memories_gib]
            out.append(f"| {name.split('/')[-1]} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------- refusing before loading


def refuse_too_long(cfg, device: str, memory: int | None = None) -> None:
    """Raise a one-line ConfigError when data.max_seq_len is more than REFUSE_MARGIN past
    the longest length that fits the card's memory (`memory`, default: the card's), naming
    the lever that makes it fit (or the longest length, when none does). Only on a CUDA
    card, for a method whose step runs the levers; a shape the planner cannot read, or one
    where no length fits (the weights alone), is left to the run."""
    from edgetune.engine.core.errors import ConfigError, EdgetuneError
    from edgetune.engine.core.methods import METHODS as RECORDS
    from edgetune.engine.core.units import size

    if not device.startswith("cuda") or not RECORDS[cfg.method].offload:
        return
    if memory is None:
        got = planner.gpu_memory_torch() or planner.gpu_memory()
        memory = got[1] if got else None
    if not memory:
        return
    n = cfg.data.max_seq_len
    try:
        if _total(cfg, n) <= memory:
            return
        fits = longest(cfg, memory)
        if not fits or n <= fits * (1 + REFUSE_MARGIN):
            return
        for label, sets in lever_settings(cfg):
            if _total(_with(cfg, sets), n) <= memory:
                raise ConfigError(f"data.max_seq_len={n:,} does not fit the GPU's {size(memory)} (the longest that "
                                  f"fits as set: {fits:,} tokens): set {label} (edgetune estimate --fit-seq-len)")
        raise ConfigError(f"data.max_seq_len={n:,} does not fit the GPU's {size(memory)} even with every long-sequence "
                          f"lever: the longest that fits as set is {fits:,} tokens (edgetune estimate --fit-seq-len)")
    except ConfigError:
        raise
    except EdgetuneError:
        return
