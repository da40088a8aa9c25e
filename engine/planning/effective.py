"""What a run will actually do: every `auto` setting decided in one place.

`decide(cfg, device, arch, gpu_free)` turns the resolved settings, the device the run is
on and the model's architecture into the effective settings. The engine's methods call it
once the model is loaded (and record the result in the run's config.yaml), the memory
planner calls it before anything is loaded, and the app shows the planner's answer before
Start, so the three cannot disagree. It imports no torch (the app's process calls it).

`arch` is the model's shape as engine/core/arch.Arch describes it (model_type, layers,
hidden, intermediate, kv_dim, projections()); None where it is not known yet, which only
the Liger, ESSA and checkpointing decisions need.

`model.gradient_checkpointing: auto` needs the memory a run would take with k layers
checkpointed: the planner has that model of memory and hands it to `checkpoint_split`
here as a function (engine/planning/planner.checkpoint_split does, before the weights load); the
policy - which k, what budget - is decided here only.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Any, Callable

from edgetune.engine.core.arch import PROJECTIONS
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.runfolder import atomic_write_text

# Rows of the labelled-rows-only loss projected through lm_head at once (engine/training/lm_loss.py):
# 512 rows of a 152k vocabulary hold ~0.9 GB of fp32 logits, softmax and gradient, and a
# 512 x 3,584 x 152k product still runs at full GEMM rate.
LOSS_CHUNK_ROWS = 512

# Model families whose RMSNorm + SwiGLU MLP Liger-Kernel 0.8.5 patches (engine/models/liger.py).
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2")

# Model families transformers has no sdpa attention for (Gemma 2: its attention logits are
# soft-capped, which sdpa cannot do): `auto` gives them eager attention, or flex_attention
# for packed rows on CUDA (flex applies the soft-cap in its score function).
NO_SDPA_FAMILIES = ("gemma2",)

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

GiB = 2**30

# gradient_checkpointing: auto with no model.memory_budget_gib plans to the card's free
# memory minus this share of it (at least BUDGET_MARGIN_MIN): room for the planner's error
# (bench/planner_check.py measures it) and for other processes that start on the card
# during the run.
BUDGET_MARGIN_SHARE = 0.10
BUDGET_MARGIN_MIN = 1 * GiB


@dataclass(frozen=True)
class Effective:
    """The decided value of every setting that can be `auto`, for one run."""

    device: str  # cpu | cuda | cuda:N
    dtype: str  # compute dtype: bf16 | fp16 | fp32
    autocast: bool  # 16-bit autocast around training and scoring forwards (engine/models/model.autocast)
    attn_implementation: str
    liger: bool  # Liger-Kernel's RMSNorm / SwiGLU / RoPE in the SFT step
    sebp: bool  # the sparse backward in SFT and F-GRPO's update
    fused_lora: bool  # LoRA's branch inside the base layer's GEMMs in the SFT step (kernels/lora_fused.py)
    optimizer: str  # adamw | adamw_8bit | paged_adamw_8bit
    fused_optimizer: bool  # AdamW as one fused kernel (CUDA)
    packing: bool  # SFT rows laid end to end (engine/data/packing.py)
    loss_chunk_rows: int
    candidates_per_batch: int  # ESSA: candidates sharing one forward pass (1 = one after another)
    nf4_kernel: str  # rollouts of an NF4 base through kernels/nf4_matmul.py: off | auto | on (see nf4_decode_base)
    # decoder layers (the first ones) that recompute their activations in the backward
    # (model.gradient_checkpointing); None = all of them, their number not known here
    checkpointed_layers: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_dtype(asked: str, device: str) -> str:
    """auto = bf16 on CUDA, fp32 on the CPU (bf16 on a CPU is slow, and hides small
    adapter changes below its resolution)."""
    if asked == "auto":
        return "bf16" if device.startswith("cuda") else "fp32"
    return asked


def optimizer_name(asked: str) -> str:
    """auto = AdamW: LoRA's few parameters make its 8 bytes of state cheap, and the 8-bit
    optimizers' per-tensor kernels slow every step (bench/README.md)."""
    return "adamw" if asked == "auto" else asked


def attention(asked: str, packing: bool, device: str, model_type: str = "") -> str:
    """auto = flex_attention for packed SFT rows on CUDA (its block mask skips the
    cross-row blocks that sdpa's dense boolean mask computes; bench/README.md), sdpa
    otherwise; eager for a family without sdpa (NO_SDPA_FAMILIES)."""
    if asked != "auto":
        return asked
    if packing and device.startswith("cuda"):
        return "flex_attention"
    return "eager" if model_type in NO_SDPA_FAMILIES else "sdpa"


# SEBP under `auto`: off. On the padded 7B bench step it is a little faster, but on a user's
# padded run (rows of the data's own lengths) it measures its backend per new batch shape, and
# those steps and the longer start cost more than it saves; with packing (the SFT default)
# it has nothing to skip. Measured: bench/README.md#the-user-path-on-an-h100--measured-once
SEBP_AUTO = False


# Fused LoRA (kernels/lora_fused.py) under `sft.fused_lora: auto`: on CUDA. bench/sft_speed.py
# on an H100 measured the 7B step faster with it, padded (under SEBP) and packed
# (bench/README.md#sft-step-7b-nf4-qlora); on the CPU it is not measured: off.
FUSED_LORA_AUTO = True


# The NF4 decode matmul (kernels/nf4_matmul.py) under `model.nf4_kernel: auto`: on, for the
# layers without a bf16 copy. bench/rollouts.py on an H100 (7B, 64 rows a decode) measured it
# faster than bitsandbytes, alone and beside a copy of half the layers, and the copy faster
# than the kernel (bench/README.md#rollouts-generation-for-f-grpo-and-essa).
NF4_KERNEL_AUTO = True
NF4_KERNEL_MAX_ROWS = 128  # the decode batches it is tiled for; more rows: bitsandbytes / the copy
# From how many rows a bf16 copy of a layer (where the free memory holds it) decodes faster
# than the kernel on its codes: measured at 64 rows; below that, not measured, the copy is kept.
COPY_OVER_KERNEL_FROM_ROWS = 1


def rollout_nf4_kernel(asked: str, device: str) -> str:
    """Effective.nf4_kernel: the setting on CUDA; off elsewhere (a Triton GPU kernel)."""
    return asked if device.startswith("cuda") else "off"


def nf4_decode_base(nf4_kernel: str, rows: int, layers: int, layers_fit: int) -> tuple[int, str]:
    """How the fast rollout loop (engine/generation/fast_decode.py) computes an NF4 base for
    one decode of `rows` rows: (how many decoder layers, from the first, get a bf16 copy;
    how the other layers compute from their 4-bit codes: "module" = bitsandbytes,
    "nf4kernel" = kernels/nf4_matmul.py). `layers_fit`: the layers whose copy the free
    memory holds (`layers` when the whole copy fits). nf4_kernel (Effective.nf4_kernel):
    off = a copy where it fits, bitsandbytes for the rest; on = the kernel for every layer,
    no copy; auto = off until NF4_KERNEL_AUTO, then the kernel for up to
    NF4_KERNEL_MAX_ROWS rows in place of bitsandbytes, and a copy only where it fits and
    beats the kernel (COPY_OVER_KERNEL_FROM_ROWS)."""
    if nf4_kernel == "on":
        return 0, "nf4kernel"
    if nf4_kernel == "auto" and NF4_KERNEL_AUTO and rows <= NF4_KERNEL_MAX_ROWS:
        return (layers_fit if rows >= COPY_OVER_KERNEL_FROM_ROWS else 0), "nf4kernel"
    return layers_fit, "module"


def _switch(asked: str, default: bool) -> bool:
    return default if asked == "auto" else asked == "on"


def liger_applies(asked: str, device: str, method: str, arch) -> bool:
    """auto = on for SFT on CUDA when Liger is installed and knows the model family; on is
    honoured wherever asked (engine/models/liger.py refuses in one line where it cannot)."""
    if asked != "auto" or not RECORDS[method].packing:
        return RECORDS[method].packing and asked == "on"
    return (device.startswith("cuda") and arch is not None and arch.model_type in LIGER_FAMILIES
            and importlib.util.find_spec("liger_kernel") is not None)


def liger_off_reason(asked: str, device: str, method: str, arch) -> str:
    """Why `liger_applies` says no, in words for the run log ("" when it applies)."""
    if liger_applies(asked, device, method, arch):
        return ""
    if not RECORDS[method].packing:
        used = " and ".join(m.label for m in RECORDS.values() if m.packing)
        return f"Liger is used in {used} only, not {RECORDS[method].label}"
    if asked != "auto":
        return f"model.liger is {asked}"
    if not device.startswith("cuda"):
        return f"the run is on {device}, not CUDA"
    if arch is None or arch.model_type not in LIGER_FAMILIES:
        return (f"model type {arch.model_type if arch else '?'!r} is not one whose RMSNorm + SwiGLU "
                f"it patches ({', '.join(LIGER_FAMILIES)})")
    return "liger_kernel is not installed"


def lora_targets(target_modules) -> tuple[str, ...]:
    """The projections a `lora.target_modules` value names ("all-linear": all of them)."""
    if target_modules in ("all-linear", None, ""):
        return PROJECTIONS
    names = target_modules.split(",") if isinstance(target_modules, str) else list(target_modules)
    names = {str(n).strip() for n in names}
    return tuple(p for p in PROJECTIONS if p in names)


def essa_candidate_bytes(cfg, arch, dtype: str, prompt_tokens: int | None = None) -> int:
    """GPU memory one more candidate in a shared forward pass takes: per prompt row its KV
    cache and the prefill's widest activation, plus the candidate's stacked LoRA factors
    (fp32). `prompt_tokens`: the longest prompt (the engine knows it from the data; by
    default data.max_seq_len, the longest an RL prompt may be)."""
    s, elt = cfg.essa, DTYPE_BYTES[dtype]
    prompt = prompt_tokens or cfg.data.max_seq_len
    tokens = prompt + s.max_new_tokens
    per_row = (2 * arch.layers * arch.kv_dim * tokens * elt
               + prompt * (3 * arch.intermediate + 4 * arch.hidden) * elt)
    targets = lora_targets(cfg.lora.target_modules)
    adapter = 4 * cfg.lora.r * arch.layers * sum(
        (i + o) * copies for name, (i, o, copies) in arch.projections().items() if name in targets)
    return s.prompts_per_generation * per_row + adapter


def essa_candidates_per_batch(cfg, device: str, arch, dtype: str, gpu_free: int | None,
                              prompt_tokens: int | None = None) -> int:
    """ESSA's K. sequential: 1. batched: essa.candidates_per_batch when set (at most the
    population); else the whole population on the CPU, and on CUDA as many as fit in half
    of `gpu_free` (the free memory once the model is loaded), one when that is unknown."""
    s = cfg.essa
    if not RECORDS[cfg.method].population or s.evaluation != "batched":
        return 1
    if s.candidates_per_batch:
        return min(s.candidates_per_batch, s.population)
    if not device.startswith("cuda"):
        return s.population
    if gpu_free is None or arch is None:
        return 1
    per_candidate = essa_candidate_bytes(cfg, arch, dtype, prompt_tokens)
    return max(1, min(s.population, int(0.5 * gpu_free // per_candidate)))


def budget_bytes(cfg, gpu_free: int | None) -> int | None:
    """The memory a run may plan to: model.memory_budget_gib, else free memory minus the margin."""
    if cfg.model.memory_budget_gib:
        return int(cfg.model.memory_budget_gib * GiB)
    if gpu_free is None:
        return None
    return int(gpu_free - max(BUDGET_MARGIN_MIN, BUDGET_MARGIN_SHARE * gpu_free))


def copy_budget(cfg) -> int | None:
    """Bytes the process may hold while rollouts take their opportunistic bf16 copy of the
    base (engine/generation/fast_decode.py): model.memory_budget_gib when set, so that a run told to
    stay small stays small; None = the card's free memory decides."""
    return int(cfg.model.memory_budget_gib * GiB) if cfg.model.memory_budget_gib else None


def checkpoint_split(cfg, layers: int, gpu_free: int | None = None,
                     planned_total: Callable[[int], int] | None = None, min_layers: int = 0) -> dict:
    """How many of the first decoder layers a run checkpoints (model.gradient_checkpointing):
    true all, false none; auto the fewest k >= min_layers whose `planned_total(k)` (bytes,
    the planner's prediction) fits `budget_bytes(cfg, gpu_free)`, and all of them when no
    budget or no prediction is known or none fits. The first layers are the ones
    checkpointed: their recompute comes last in the backward, when the later layers' kept
    activations are already freed. Keys: layers, checkpointed, budget, planned_total, note."""
    gc = cfg.model.gradient_checkpointing
    if gc != "auto":
        return {"layers": layers, "checkpointed": layers if gc else 0, "budget": None, "planned_total": None,
                "note": f"gradient checkpointing {'on' if gc else 'off'}"}
    budget = budget_bytes(cfg, gpu_free)
    chosen, total = layers, None
    if budget is not None and planned_total is not None:
        for k in range(min_layers, layers + 1):
            t = planned_total(k)
            if t <= budget:
                chosen, total = k, t
                break
    if budget is None or planned_total is None:
        note = f"gradient checkpointing auto: no GPU memory known, all {layers} layers checkpointed"
    elif total is None:
        note = (f"gradient checkpointing auto: even all {layers} layers checkpointed exceed the "
                f"{budget / GiB:.1f} GiB budget; all are checkpointed")
    else:
        src = "model.memory_budget_gib" if cfg.model.memory_budget_gib else "free GPU memory minus a margin"
        which = f"{chosen} of {layers} decoder layers checkpointed (the first {chosen})" if chosen else \
            f"none of the {layers} decoder layers checkpointed"
        note = (f"gradient checkpointing auto: {which}, {layers - chosen} keep their activations: "
                f"{total / GiB:.1f} GiB planned of the {budget / GiB:.1f} GiB budget ({src})")
    return {"layers": layers, "checkpointed": chosen, "budget": budget, "planned_total": total, "note": note}


def checkpointed_layers(cfg, arch, checkpointed: int | None) -> int | None:
    """Effective.checkpointed_layers: ESSA's search has no backward (none; its warm start
    is an SFT run of its own); else `checkpointed`, the split already made (the planner's,
    or what the engine loaded the model with); else what `checkpoint_split` decides with
    no memory known (auto: all)."""
    if not RECORDS[cfg.method].gradients:
        return 0
    if checkpointed is not None:
        return checkpointed
    if arch is None:
        return 0 if cfg.model.gradient_checkpointing is False else None
    return checkpoint_split(cfg, arch.layers)["checkpointed"]


def decide(cfg, device: str, arch=None, gpu_free: int | None = None,
           prompt_tokens: int | None = None, checkpointed: int | None = None) -> Effective:
    """The effective settings of `cfg` on `device` ("cpu", "cuda", "cuda:N": already
    resolved from model.device) for a model of shape `arch`. ESSA's batched evaluation
    sizes itself to `gpu_free` (bytes free on the card once the model is loaded) and
    `prompt_tokens` (the longest prompt; default data.max_seq_len, what the planner knows).
    `checkpointed`: the layers `checkpoint_split` chose for this run (see
    `checkpointed_layers`)."""
    m = cfg.model
    cuda = device.startswith("cuda")
    dtype = compute_dtype(m.dtype, device)
    method_settings = getattr(cfg, cfg.method) if RECORDS[cfg.method].gradients else None
    packing = RECORDS[cfg.method].packing and bool(getattr(cfg, cfg.method).packing)
    optimizer = optimizer_name(method_settings.optimizer) if method_settings else "none"  # ESSA: no gradients
    return Effective(
        device=device, dtype=dtype, autocast=cuda and dtype in ("bf16", "fp16"),
        attn_implementation=attention(m.attn_implementation, packing, device, arch.model_type if arch else ""),
        liger=liger_applies(m.liger, device, cfg.method, arch),
        sebp=_switch(method_settings.sebp, SEBP_AUTO and cuda) if method_settings else False,
        fused_lora=_switch(getattr(method_settings, "fused_lora", "off"), FUSED_LORA_AUTO and cuda),
        optimizer=optimizer, fused_optimizer=cuda and optimizer == "adamw", packing=packing,
        loss_chunk_rows=LOSS_CHUNK_ROWS,
        candidates_per_batch=essa_candidates_per_batch(cfg, device, arch, dtype, gpu_free, prompt_tokens),
        nf4_kernel=rollout_nf4_kernel(m.nf4_kernel, device),
        checkpointed_layers=checkpointed_layers(cfg, arch, checkpointed),
    )


def config_yaml(cfg, eff: Effective) -> str:
    """config.yaml of a run: the settings as asked, then what was decided (read back, the
    `effective` block is ignored: it is a record, not a setting)."""
    import yaml

    return cfg.to_yaml() + yaml.safe_dump({"effective": eff.to_dict()}, sort_keys=False)


def record(run_dir, cfg, eff: Effective) -> None:
    """Rewrite the run's config.yaml with the decided values (atomically; rank 0 only)."""
    from edgetune.engine.core import distributed

    if not distributed.is_main():
        return
    atomic_write_text(run_dir.config_path, config_yaml(cfg, eff))
