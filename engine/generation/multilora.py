"""K LoRA candidates in one forward pass: rows of the batch pick their own adapter.

While `batched_lora(model_modules, stacks, row_candidate)` is active, every PEFT LoRA
layer computes

    y[b] = base(x[b]) + scaling · B[c_b] A[c_b] x[b]       c_b = row_candidate[b]

with the candidates' factors stacked as A [K, r, in], B [K, out, r]. Callers that only
run forward passes (the rollouts module's `generate`) need not know: they see a batch of
K·P rows. The base layer (the 4-bit matmul, the expensive part) runs once for all rows,
exactly as in plain batched inference; the per-candidate part is two thin batched
matmuls of rank r.

Two layouts:
- candidate-major blocks (rows 0..P-1 use candidate 0, the next P candidate 1, ...):
  the activations are viewed as [K, P·T, in] and multiplied with `bmm`, no copies;
  this is what ESSA uses.
- any other per-row index: the factors are gathered per row ([B, r, in]); this costs
  B adapters of temporary memory per layer, so it is the fallback.

The row count is checked on every call: a caller that splits the batch into
micro-batches would silently mix candidates, so it raises instead.

Decode loops: the plain loop calls the patched forwards. The fast loop
(engine/generation/fast_decode.py) packs the stacks of candidate-major blocks into its q|k|v,
o, gate|up and down packs whenever it packs its base weights (two `bmm`s per pack, as
many kernels as one adapter), and otherwise captures the patched forwards in its CUDA
graph.
Trade-offs: memory of K stacked adapters (A and B per candidate: ~20 MB each at 7B, r 8
on q,k,v,o, fp32; the fast loop's packs copy them again for the call, with B
block-diagonal) and, in the fast loop, a graph per generate call for its K*P rows, so a
different K (the last chunk of a population) is a second capture. The stacks are read
when a call starts: new candidates are new stacks for the next call.
"""

from __future__ import annotations

import contextlib
import types

import torch


def _batched_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    a, b, scaling, rows, blocks = self._multilora
    result = self.base_layer(x, *args, **kwargs)
    n = x.shape[0]
    if n != rows.numel():
        raise RuntimeError(
            f"batched LoRA: the layer got {n} rows but the candidate index has {rows.numel()} "
            "(was the batch split into micro-batches? generate all K x P rows as one batch)"
        )
    # Same dtype handling as PEFT's own LoRA forward: adapter math in the adapter's dtype,
    # the sum in the base output's dtype.
    xa = x.to(a.dtype)
    feat = xa.shape[1:-1]
    if blocks:
        k = a.shape[0]
        xk = xa.reshape(k, -1, xa.shape[-1])  # [K, P*T, in]: contiguous candidate blocks
        out = torch.bmm(torch.bmm(xk, a.transpose(1, 2)), b.transpose(1, 2))
    else:
        xk = xa.reshape(n, -1, xa.shape[-1])  # [B, T, in]
        out = torch.bmm(torch.bmm(xk, a[rows].transpose(1, 2)), b[rows].transpose(1, 2))
    out = (out * scaling).reshape(n, *feat, b.shape[1])
    return result + out.to(result.dtype)


def is_block_layout(row_candidate: torch.Tensor, k: int) -> bool:
    n = row_candidate.numel()
    if n % k:
        return False
    expected = torch.arange(k, device=row_candidate.device).repeat_interleave(n // k)
    return bool(torch.equal(row_candidate, expected))


@contextlib.contextmanager
def batched_lora(modules, stacks, row_candidate, adapter: str = "default", scaling: float | None = None):
    """Inside the block, each LoRA module in `modules` ([(name, module)]: the model's
    LoRA layers, in a fixed order) uses per-row factors from `stacks` ([(A, B)] in the same
    order); `row_candidate` [rows] says which candidate each batch row uses. `scaling`: the
    factor of every module instead of `adapter`'s own (1.0 where the stacks' B carry it)."""
    if len(modules) != len(stacks):
        raise ValueError(f"{len(modules)} LoRA modules but {len(stacks)} stacked factor pairs")
    k = stacks[0][0].shape[0]
    rows = torch.as_tensor(row_candidate, dtype=torch.long)
    if rows.numel() and (rows.min() < 0 or rows.max() >= k):
        raise ValueError(f"row_candidate must be in [0, {k}), got {rows.min()}..{rows.max()}")
    blocks = is_block_layout(rows, k)
    patched = []
    try:
        for (name, m), (a, b) in zip(modules, stacks):
            if getattr(m, "merged", False) or m.lora_variant.get(adapter) is not None:
                raise RuntimeError(f"{name}: batched LoRA needs an unmerged plain LoRA layer")
            dev = a.device
            m._multilora = (a, b, m.scaling[adapter] if scaling is None else scaling, rows.to(dev), blocks)
            # An instance attribute shadows the class's forward; deleting it restores it.
            m.forward = types.MethodType(_batched_forward, m)
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
            del m._multilora
