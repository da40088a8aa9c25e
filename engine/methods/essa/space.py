"""ESSA's search space: offsets to the top singular values of every LoRA factor.

Each LoRA factor of the warm-start adapter (A: [r, in], B: [out, r]) is decomposed once,
W = U diag(s) Vᵀ, and U, V stay frozen. A candidate is one flat vector x holding, for
every factor, offsets to its k = floor(alpha · r) largest singular values:

    W(x) = U diag(s + [x_f, 0, ...]) Vᵀ  =  W0 + U[:, :k] diag(x_f) Vᵀ[:k]

We build the right-hand form. It is the same matrix, but x = 0 returns the warm-start
weight bit for bit (no SVD round trip), and the work is a rank-k update: for a 7B model
at rank 8 that is ~1,800 numbers in and ~40 M multiply-adds out, negligible next to one
generated token.

Memory: U[:, :k] and Vᵀ[:k] are kept per factor (the same size as the adapter itself),
plus a copy of the warm-start weights. Stacking K candidates (for batched evaluation)
costs K adapters' worth of memory: for a 7B model at rank 8 on q, k, v, o that is
~20 MB per candidate in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from edgetune.engine.core.errors import ConfigError


@dataclass
class Factor:
    """One LoRA weight (A or B of one module) and its frozen singular directions."""

    module: str  # qualified module name, for messages and checkpoints
    which: str  # "A" or "B"
    weight: torch.nn.Parameter  # the live LoRA weight, written in place
    w0: torch.Tensor  # warm-start weight
    u: torch.Tensor  # [rows, k] left singular vectors of the searched values
    vh: torch.Tensor  # [k, cols] right singular vectors
    s: torch.Tensor  # [k] warm-start singular values (for reports; W0 already holds them)

    @property
    def k(self) -> int:
        return self.s.numel()


def lora_modules(model, adapter: str = "default") -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every PEFT LoRA layer that carries `adapter`, in model order."""
    out = []
    for name, m in model.named_modules():
        la = getattr(m, "lora_A", None)
        if isinstance(la, torch.nn.ModuleDict) and adapter in la and hasattr(m, "base_layer"):
            out.append((name, m))
    return out


class SVDSpace:
    """Maps flat offset vectors to LoRA weights (in place) or to stacked per-candidate
    factors (for `multilora`). Built once from the adapter as it is now (the warm start)."""

    def __init__(self, model, alpha: float = 1.0, adapter: str = "default"):
        self.adapter = adapter
        self.modules = lora_modules(model, adapter)
        if not self.modules:
            raise ConfigError("ESSA needs a LoRA adapter on the model; none was found")
        self.factors: list[Factor] = []
        for name, m in self.modules:
            for which, lin in (("A", m.lora_A[adapter]), ("B", m.lora_B[adapter])):
                w = lin.weight
                rank = min(w.shape)
                k = math.floor(alpha * rank + 1e-9)
                if k == 0:
                    raise ConfigError(
                        f"essa.alpha = {alpha} searches floor({alpha} x rank {rank}) = 0 singular values "
                        f"per LoRA factor: the search space is empty (raise essa.alpha to >= {1 / rank:.3g} "
                        "or lora.r)"
                    )
                # fp64 SVD: the directions must be orthonormal to fp32 precision even
                # when the warm start has near-equal singular values.
                u, s, vh = torch.linalg.svd(w.detach().double(), full_matrices=False)
                self.factors.append(Factor(
                    module=name, which=which, weight=w, w0=w.detach().clone(),
                    u=u[:, :k].to(w.dtype).contiguous(), vh=vh[:k].to(w.dtype).contiguous(),
                    s=s[:k].to(w.dtype),
                ))
        self.dim = sum(f.k for f in self.factors)
        self._offsets = []  # start of each factor's slice of x
        o = 0
        for f in self.factors:
            self._offsets.append(o)
            o += f.k

    # -- one candidate

    def _slice(self, x: torch.Tensor, i: int) -> torch.Tensor:
        o = self._offsets[i]
        return x[..., o:o + self.factors[i].k]

    def _as_tensor(self, x) -> torch.Tensor:
        x = torch.as_tensor(x, dtype=torch.float64)
        if x.shape[-1] != self.dim:
            raise ValueError(f"candidate has {x.shape[-1]} numbers, the search space {self.dim}")
        return x

    def factor_weights(self, x) -> list[torch.Tensor]:
        """The weight of every factor for offsets x (x = 0 gives the warm start exactly)."""
        x = self._as_tensor(x)
        out = []
        for i, f in enumerate(self.factors):
            d = self._slice(x, i).to(device=f.u.device, dtype=f.u.dtype)
            out.append(f.w0 + (f.u * d) @ f.vh)
        return out

    @torch.no_grad()
    def write(self, x) -> None:
        """Copy candidate x into the live LoRA weights (no new parameters, no graph)."""
        for f, w in zip(self.factors, self.factor_weights(x)):
            f.weight.copy_(w)

    @torch.no_grad()
    def restore(self) -> None:
        for f in self.factors:
            f.weight.copy_(f.w0)

    # -- K candidates at once

    @torch.no_grad()
    def stacked(self, xs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per LoRA module (order of `self.modules`): (A [K, r, in], B [K, out, r])."""
        xs = self._as_tensor(xs)
        if xs.dim() != 2:
            raise ValueError("stacked() expects a [K, dim] batch of candidates")
        per_factor = []
        for i, f in enumerate(self.factors):
            d = self._slice(xs, i).to(device=f.u.device, dtype=f.u.dtype)  # [K, k]
            # W0 + U diag(d_k) Vh for every k, as one batched matmul
            per_factor.append(f.w0 + torch.matmul(f.u * d[:, None, :], f.vh))
        return [(per_factor[2 * j], per_factor[2 * j + 1]) for j in range(len(self.modules))]

    def values(self) -> np.ndarray:
        """The warm start's searched singular values, in the order of x."""
        return np.concatenate([f.s.double().cpu().numpy() for f in self.factors])

    def describe(self) -> dict:
        return {"modules": len(self.modules), "factors": len(self.factors), "dim": self.dim}
