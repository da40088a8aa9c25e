"""What a run will actually do: every `auto` setting decided in one place.

`decide(cfg, device, arch, gpu_free)` turns the resolved settings, the device the run is
on and the model's architecture into the effective settings. The engine's methods call it
once the model is loaded (and record the result in the run's config.yaml), the memory
planner calls it before anything is loaded, and the app shows the planner's answer before
Start, so the three cannot disagree. It imports no torch (the app's process calls it).

`arch` is the model's shape as engine/planner.Arch describes it (model_type, layers,
hidden, intermediate, kv_dim, projections()); None where it is not known yet, which only
the Liger and ESSA decisions need.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Any

from .runfolder import atomic_write_text

# Rows of the labelled-rows-only loss projected through lm_head at once (engine/lm_loss.py):
# 512 rows of a 152k vocabulary hold ~0.9 GB of fp32 logits, softmax and gradient, and a
# 512 x 3,584 x 152k product still runs at full GEMM rate.
LOSS_CHUNK_ROWS = 512

# Model families whose RMSNorm + SwiGLU MLP Liger-Kernel 0.8.5 patches (engine/liger.py).
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Effective:
    """The decided value of every setting that can be `auto`, for one run."""

    device: str  # cpu | cuda | cuda:N
    dtype: str  # compute dtype: bf16 | fp16 | fp32
    autocast: bool  # 16-bit autocast around training and scoring forwards (engine/model.autocast)
    attn_implementation: str
    liger: bool  # Liger-Kernel's RMSNorm / SwiGLU / RoPE in the SFT step
    sebp: bool  # the sparse backward in SFT and F-GRPO's update
    optimizer: str  # adamw | adamw_8bit | paged_adamw_8bit
    fused_optimizer: bool  # AdamW as one fused kernel (CUDA)
    packing: bool  # SFT rows laid end to end (engine/packing.py)
    loss_chunk_rows: int
    candidates_per_batch: int  # ESSA: candidates sharing one forward pass (1 = one after another)

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
    optimizers' per-tensor kernels cost 30-50 ms a 7B step (bench/RESULTS.md)."""
    return "adamw" if asked == "auto" else asked


def attention(asked: str, packing: bool, device: str) -> str:
    """auto = flex_attention for packed SFT rows on CUDA (its block mask skips the
    cross-row blocks that sdpa's dense boolean mask computes: 1.13x the step,
    bench/RESULTS.md), sdpa otherwise."""
    if asked != "auto":
        return asked
    return "flex_attention" if packing and device.startswith("cuda") else "sdpa"


def _switch(asked: str, default: bool) -> bool:
    return default if asked == "auto" else asked == "on"


def liger_applies(asked: str, device: str, method: str, arch) -> bool:
    """auto = on for SFT on CUDA when Liger is installed and knows the model family; on is
    honoured wherever asked (engine/liger.py refuses in one line where it cannot)."""
    if asked != "auto" or method != "sft":
        return method == "sft" and asked == "on"
    return (device.startswith("cuda") and arch is not None and arch.model_type in LIGER_FAMILIES
            and importlib.util.find_spec("liger_kernel") is not None)


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
    if cfg.method != "essa" or s.evaluation != "batched":
        return 1
    if s.candidates_per_batch:
        return min(s.candidates_per_batch, s.population)
    if not device.startswith("cuda"):
        return s.population
    if gpu_free is None or arch is None:
        return 1
    per_candidate = essa_candidate_bytes(cfg, arch, dtype, prompt_tokens)
    return max(1, min(s.population, int(0.5 * gpu_free // per_candidate)))


def decide(cfg, device: str, arch=None, gpu_free: int | None = None,
           prompt_tokens: int | None = None) -> Effective:
    """The effective settings of `cfg` on `device` ("cpu", "cuda", "cuda:N": already
    resolved from model.device) for a model of shape `arch`. ESSA's batched evaluation
    sizes itself to `gpu_free` (bytes free on the card once the model is loaded) and
    `prompt_tokens` (the longest prompt; default data.max_seq_len, what the planner knows)."""
    m = cfg.model
    cuda = device.startswith("cuda")
    dtype = compute_dtype(m.dtype, device)
    method_settings = {"sft": cfg.sft, "fgrpo": cfg.fgrpo}.get(cfg.method)
    packing = cfg.method == "sft" and bool(cfg.sft.packing)
    optimizer = optimizer_name(method_settings.optimizer) if method_settings else "none"  # ESSA: no gradients
    return Effective(
        device=device, dtype=dtype, autocast=cuda and dtype in ("bf16", "fp16"),
        attn_implementation=attention(m.attn_implementation, packing, device),
        liger=liger_applies(m.liger, device, cfg.method, arch),
        sebp=_switch(method_settings.sebp, cuda) if method_settings else False,
        optimizer=optimizer, fused_optimizer=cuda and optimizer == "adamw", packing=packing,
        loss_chunk_rows=LOSS_CHUNK_ROWS,
        candidates_per_batch=essa_candidates_per_batch(cfg, device, arch, dtype, gpu_free, prompt_tokens),
    )


def config_yaml(cfg, eff: Effective) -> str:
    """config.yaml of a run: the settings as asked, then what was decided (read back, the
    `effective` block is ignored: it is a record, not a setting)."""
    import yaml

    return cfg.to_yaml() + yaml.safe_dump({"effective": eff.to_dict()}, sort_keys=False)


def record(run_dir, cfg, eff: Effective) -> None:
    """Rewrite the run's config.yaml with the decided values (atomically)."""
    atomic_write_text(run_dir.config_path, config_yaml(cfg, eff))
