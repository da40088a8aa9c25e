"""Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (Triton) for the decoder blocks.

Why: on a GPU these replace several memory-bound elementwise ops per block (RMSNorm's
fp32 upcast/variance/scale, SiLU(gate) * up, the rotate-half RoPE) with one kernel
each, which saves activation memory and some step time at no change in the math
(the result equals the transformers code up to float rounding; tests/test_liger.py
checks the loss and every LoRA gradient on a Qwen2 and a Llama).

What is NOT used: Liger's cross-entropy and fused-linear-cross-entropy. Our loss
(engine/training/lm_loss.py) already projects only the labelled rows through lm_head, which is
the part those kernels would save; and their forward replaces the model's forward.
Nor Liger's GEGLU / LayerNorm / ReLU^2 (other model families): untested here.

How: through the library's own per-model-type dispatch
(`liger_kernel.transformers.monkey_patch._apply_liger_kernel_to_instance`, table
`MODEL_TYPE_TO_APPLY_LIGER_FN`) with `model=<the HF model>`, so the existing modules
are patched in place: each RMSNorm and MLP keeps its class, weights and children and
gets Liger's `forward` bound on the instance. Liger's SwiGLU forward calls
`self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))`, i.e. the projections
stay module calls, so PEFT's LoRA layers (and kernels/sebp.py's patch of their
forward) are still the ones that run.

Trade-offs / side effects, process-wide:
  * RoPE cannot be patched per instance: the attention forward calls the module-level
    function `apply_rotary_pos_emb` of transformers' modeling file, and Liger replaces
    that function in the module (e.g. `transformers.models.qwen2.modeling_qwen2`).
    Every model of the same family in this process then uses Liger's RoPE, which
    needs a CUDA tensor (or TRITON_INTERPRET=1). A worker process trains one model, so
    we accept that; do not `apply()` in a process that also runs a CPU model of the
    same family.
  * Liger's instance path also rebinds the module-level classes (e.g. `Qwen2RMSNorm`,
    `Qwen2MLP`) to its own, which would make models built later in the process Liger
    models too. We restore those class names right after: the instance is patched
    already, later models are not.
  * Liger's SwiGLU is SiLU only; for a config whose `hidden_act` is not silu/swish the
    MLP is left alone (Liger's instance patch does not check this itself).
  * The kernels are Triton: CUDA only in practice; on the CPU they run only under the
    Triton interpreter (TRITON_INTERPRET=1, slow, for tests).
"""

from __future__ import annotations

import inspect
import os
import sys

from edgetune.engine.core.errors import ModelError

PARTS = ("rms_norm", "swiglu", "rope")
# Every other switch Liger's apply functions have, off: only the three above are used.
_OFF = dict(cross_entropy=False, fused_linear_cross_entropy=False, geglu=False, layer_norm=False,
            relu_squared=False)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _on_cuda(model) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cuda"


def _why_not(base) -> tuple[str, object]:
    """("", apply_fn) when Liger can patch this model, else (reason, None)."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not _on_cuda(base):
        dev = next(base.parameters()).device.type
        return f"it needs a CUDA GPU (Liger's kernels are Triton; the model is on {dev})", None
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as e:  # ImportError, or its own version check against transformers
        return f"liger_kernel is not usable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", None
    mt = getattr(getattr(base, "config", None), "model_type", None)
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(mt)
    if fn is None or not set(PARTS) & set(inspect.signature(fn).parameters):
        return f"liger_kernel has no kernels for model_type {mt!r}", None
    return "", fn


def apply(model, setting: str) -> str:
    """Patch `model` (a PEFT model or a plain HF causal LM) in place with Liger's fused
    RMSNorm / SwiGLU / RoPE. setting: "auto" (only on CUDA, when liger_kernel imports and
    knows the model_type), "on" (ModelError if it cannot), "off".

    Returns what was done, for the log: "applied: rms_norm, swiglu, rope" or "off: <reason>".
    """
    if setting not in ("auto", "on", "off"):
        raise ModelError(f"model.liger: {setting!r} is not one of auto, on, off")
    if setting == "off":
        return "off: model.liger is off"
    base = _base(model)
    if setting == "auto" and not _on_cuda(base):
        return "off: the model is not on a CUDA GPU"
    reason, fn = _why_not(base)
    if reason:
        if setting == "on":
            raise ModelError(f"model.liger is on but {reason}")
        return f"off: {reason}"

    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    accepted = inspect.signature(fn).parameters
    parts = {p: p in accepted for p in PARTS}
    skipped = ""
    act = getattr(base.config.get_text_config(), "hidden_act", "silu")
    if parts["swiglu"] and act not in ("silu", "swish"):
        parts["swiglu"] = False
        skipped = f" (swiglu skipped: hidden_act {act!r})"

    modeling = sys.modules[type(base).__module__]
    before = dict(vars(modeling))
    _apply_liger_kernel_to_instance(base, **parts, **_OFF)
    for name, old in before.items():  # see the module docstring: classes back, RoPE stays
        if isinstance(old, type) and getattr(modeling, name) is not old:
            setattr(modeling, name, old)
    return "applied: " + ", ".join(p for p in PARTS if parts[p]) + skipped
