"""LoRA's branch inside the GEMMs: y = x Wᵀ + b + s·(x Aᵀ) Bᵀ in two GEMMs, no separate adds.

PEFT's LoRA layer runs the base layer, then lora_B(lora_A(x)), multiplies that by the
scaling and adds it to the base output: besides the three GEMMs, a multiply and an add
kernel that each read and write the whole [rows, out] output (the backward has their
mirror images, and a sum of the base's and the branch's dX). Here the rank-r product
accumulates into the base output inside the GEMM's epilogue:

    forward:   h = x Aᵀ;  y = x Wᵀ (+ b);  y += s·h Bᵀ            (addmm_, alpha = s)
    backward:  dh = s·dY B;  dX = dh A;  dX += dY W               (addmm_)
               dA = dhᵀ x;  dB = s·dYᵀ h;  db = Σ dY

so each [rows, out] and [rows, in] tensor is written once and read once more by the
accumulating GEMM, where PEFT's path writes and reads it about three times. A 4-bit base is
dequantised in the forward and again in the backward (bitsandbytes does the same for
training batches); the products run in the autocast dtype when autocast is on (as autograd
of PEFT's autocast forward does), accumulating in fp32 inside the GEMMs.

Use (after add_lora; before SEBP's patch, which then wraps these forwards):

    with lora_fused.enabled(model, on) as fused:
        ... training steps ...
        with fused.lifted():   # generation: the model's own forwards
            ...

Layers that are not plain single-adapter LoRA over nn.Linear or a 4-bit base (DoRA,
dropout active in training, merged, disabled, several adapters) keep PEFT's forward.
"""

from __future__ import annotations

import contextlib

import torch

from .sebp import base_parts, is_lora_layer, lora_parts


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class FusedLoraFn(torch.autograd.Function):
    """y = x Wᵀ (+ bias) + s·(x Aᵀ) Bᵀ; weight None: a 4-bit base, `dense` dequantises it."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, dense, scaling):
        ct = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(ct)
            w = (weight if weight is not None else dense()).to(ct)
            a, b = lora_a.to(ct), lora_b.to(ct)
            h = x2 @ a.t()
            y = torch.addmm(bias.to(ct), x2, w.t()) if bias is not None else x2 @ w.t()
            y.addmm_(h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, h, weight, lora_a, lora_b)
        ctx.dense, ctx.scaling, ctx.x_dtype, ctx.has_bias = dense, scaling, x.dtype, bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x2, h, weight, lora_a, lora_b = ctx.saved_tensors
        nx, nw, nb, na, nbb, _, _ = ctx.needs_input_grad
        s, ct = ctx.scaling, x2.dtype
        dx = dw = db = da = dbb = None
        with torch.autocast(gy.device.type, enabled=False):
            g2 = gy.reshape(-1, gy.shape[-1]).to(ct)
            dh = torch.mm(g2, lora_b.to(ct)).mul_(s) if (nx or na) else None
            if nx:
                w = (weight if weight is not None else ctx.dense()).to(ct)
                dx = dh @ lora_a.to(ct)
                dx.addmm_(g2, w)
                dx = dx.view(*gy.shape[:-1], dx.shape[-1]).to(ctx.x_dtype)
            if na:
                da = (dh.t() @ x2).to(lora_a.dtype)
            if nbb:
                dbb = (g2.t() @ h).mul_(s).to(lora_b.dtype)
            if nw and weight is not None:
                dw = (g2.t() @ x2).to(weight.dtype)
            if nb and ctx.has_bias:
                db = g2.sum(0)
        return dx, dw, db, da, dbb, None, None


def _make_forward(module, original):
    def forward(x, *args, **kwargs):
        parts = lora_parts(module) if not args and not kwargs else None
        base = base_parts(module.get_base_layer()) if parts is not None else None
        if base is None:
            return original(x, *args, **kwargs)
        a, b, s = parts
        weight, bias, dense = base
        if bias is not None and bias.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            return original(x)
        return FusedLoraFn.apply(x, weight, bias, a, b, dense, s)

    return forward


class Enabled:
    """What `enabled()` yields: the fused forward on every eligible LoRA layer (on), or
    nothing (off); `lifted()` puts PEFT's forwards back for a block."""

    def __init__(self, model, on: bool):
        self.model, self.on, self.saved = model, bool(on), []
        if self.on:
            self._apply()

    def _apply(self) -> None:
        for m in self.model.modules():
            if is_lora_layer(m) and hasattr(m, "lora_A") and base_parts(m.get_base_layer()) is not None:
                had = "forward" in m.__dict__
                original = m.__dict__["forward"] if had else m.forward
                self.saved.append((m, had, original))
                m.forward = _make_forward(m, original)

    def _remove(self) -> None:
        for m, had, original in reversed(self.saved):
            if had:
                m.forward = original
            else:
                del m.forward
        self.saved = []

    @property
    def patched(self) -> int:
        return len(self.saved)

    @contextlib.contextmanager
    def lifted(self):
        if not self.saved:
            yield self
            return
        self._remove()
        try:
            yield self
        finally:
            self._apply()


@contextlib.contextmanager
def enabled(model, on: bool = True):
    """The fused LoRA forward and backward for the duration of a `with` block (off: a
    no-op); PEFT's forwards are back at its end, also when the block raises."""
    h = Enabled(model, on)
    try:
        yield h
    finally:
        h._remove()
