"""Exact SEBP: a backward pass for linear layers that computes only the active rows.

In a causal LM trained with padding masked out (attention_mask 0, labels -100), the
gradient reaching a block linear's output is exactly zero on padding rows: no real
token attends to them and their own loss terms are masked. For `Y = X Wᵀ (+ s·X Aᵀ Bᵀ)`
with active rows R that leaves, exactly,

    dX[R] = dY[R] W (+ s·dY[R] B A),  dX[not R] = 0,  dW = dY[R]ᵀ X[R],
    dB = s·dY[R]ᵀ (X[R] Aᵀ),  dA = (s·dY[R] B)ᵀ X[R],  db = Σ_R dY.

Prompt rows are NOT zero inside the blocks (later tokens attend to them), so block
linears use R = non-padding rows; only the lm_head may drop prompt rows too
(`sparse_lm_head_loss`, R = rows whose shifted label is not -100).

Trade-offs:
- The forward is the module's own dense forward, bit for bit; only the backward is
  sparse. It saves X (and the weight references) only; a 4-bit base is dequantised
  again in the backward, as bitsandbytes' own backward does.
- The active row ids are computed once per step in `set_active_rows` (one host sync
  there, none per layer). When every row is active the layer takes its normal path:
  dense cuBLAS is already the fastest way to do dense work.
- On CUDA each kind of layer (shape, grads wanted, classes of rows and of active rows)
  runs whichever of two exact paths measured faster on its first backward (`choose_backend`;
  kept between runs by `remember_choices`):
  `sebp_triton`, which gathers rows inside the GEMM loads (no copies), or index_select +
  cuBLAS (copies of X[R] and dY[R] for the layer's backward, a faster GEMM and fewer
  launches). Under TRITON_INTERPRET=1 the Triton path runs; on a plain CPU, index_select.

Use (the engine, engine/methods/sft/sft.py and engine/methods/fgrpo/fgrpo.py):

    with sebp.enabled(model, on) as h:    # after add_lora (patching first would leave the
                                          # LoRA product on PEFT's dense path); on=False: no-op
        for each micro-batch:
            h.set_active_rows(attention_mask.bool())    # [batch, seq], on the model's device
            hidden = decoder(input_ids, attention_mask).last_hidden_state
            loss = sparse_lm_head_loss(hidden, lm_head.weight, labels, chunk_rows=2048)
            loss.backward()       # (model(..., labels=...).loss works too, dense lm_head;
                                  #  the engine wraps this in engine/training/lm_loss.causal_lm_loss)
        with h.lifted():          # generation between updates: the model's own forwards
            ...
    # the original forwards are back, also when the block raised

(`patch` / `set_active_rows` / `unpatch` are the lower-level pieces `enabled` is made of.)

Labels must be -100 on padding (and wherever no loss is wanted); a padding row with a
real label would have a non-zero gradient that SEBP drops. Layers fall back to their own
forward/backward when no rows are set, grad is off, the input is not [batch, seq, ·] of
the mask's shape, every row is active, or the layer is not plain single-adapter LoRA
(DoRA, active dropout, merged, disabled, several adapters).

Under autocast the forward is the module's own (autocast) forward; the backward takes
bf16 dY and X and the fp32 adapter factors and accumulates in fp32, returning dX in X's
dtype and dA/dB in the factors' fp32 - what autograd of the autocast forward returns, up
to bf16 rounding of the rank-r intermediate.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_ATTR = "_sebp_handle"


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class ActiveRows:
    """The active rows of one step's [batch, seq] grid, flattened row-major.

    Built once per micro-batch (`set_active_rows`) and shared by every patched layer: the
    one nonzero() below is the step's only host synchronisation. Layers read `index` and
    `n_active` and never rebuild or re-count them, so a layer's backward enqueues its
    kernels without waiting on the GPU.
    """

    shape: tuple
    index: torch.Tensor  # int32 [n_active], sorted flat row ids (read by the kernels)
    n_active: int

    @property
    def n_total(self) -> int:
        return self.shape[0] * self.shape[1]

    def inactive(self) -> torch.Tensor:
        """int64 ids of the rows outside R (a host sync; diagnostics only, the backward
        zeroes dX with one memset instead of indexing these rows)."""
        keep = torch.ones(self.n_total, dtype=torch.bool, device=self.index.device)
        keep[self.index.long()] = False
        return keep.nonzero().squeeze(1)

    @functools.cached_property
    def long_index(self) -> torch.Tensor:
        """int64 copy of `index` for torch's index ops, made once per step, not per layer."""
        return self.index.long()

    @functools.cached_property
    def position(self) -> torch.Tensor:
        """int32 [n_total]: each row's place in `index`, -1 outside R (4 bytes a row, built
        once per step on the GPU without a sync). Lets one kernel write every row of a
        padded dX from the compact rows (`sebp_triton.scatter_rows`)."""
        pos = torch.full((self.n_total,), -1, dtype=torch.int32, device=self.index.device)
        ids = torch.arange(self.n_active, dtype=torch.int32, device=self.index.device)
        return pos.index_copy_(0, self.long_index, ids)

    @functools.cached_property
    def runs(self) -> tuple:
        """(start, end) of each maximal run of consecutive active rows (a right- or
        left-padded batch: one run a sequence), as Python ints. One copy of `index` to the
        host, once per step (`set_active_rows` builds it when a handle's kernel is `runs`)."""
        ids = self.index.cpu().numpy()
        if ids.size == 0:
            return ()
        breaks = np.flatnonzero(np.diff(ids) != 1)
        starts = ids[np.concatenate(([0], breaks + 1))]
        ends = ids[np.concatenate((breaks, [ids.size - 1]))] + 1
        return tuple(zip(starts.tolist(), ends.tolist()))

    @functools.cached_property
    def gaps(self) -> tuple:
        """(start, end) of each run of inactive rows: what lies between `runs`."""
        out, at = [], 0
        for s, e in self.runs:
            if s > at:
                out.append((at, s))
            at = e
        if at < self.n_total:
            out.append((at, self.n_total))
        return tuple(out)

    def keep(self, dtype, device) -> torch.Tensor:
        """[n_total, 1] of 1 on the active rows, 0 elsewhere, in `dtype` (made once per
        step and dtype): multiplying a rank-r product by it keeps rows R only."""
        cache = self.__dict__.setdefault("_keep", {})
        key = (dtype, torch.device(device))
        if key not in cache:
            k = torch.zeros((self.n_total, 1), dtype=dtype, device=device)
            cache[key] = k.index_fill_(0, self.index.to(device).long(), 1)
        return cache[key]

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "ActiveRows":
        if mask.dim() != 2:
            raise ValueError(f"active-row mask must be [batch, seq], got shape {tuple(mask.shape)}")
        index = mask.reshape(-1).bool().nonzero().squeeze(1)  # the one host sync of the step
        return cls(tuple(mask.shape), index.to(torch.int32), int(index.numel()))


def _as_rows(mask) -> "ActiveRows | None":
    if mask is None or isinstance(mask, ActiveRows):
        return mask
    return ActiveRows.from_mask(mask)


# The `sebp_kernel` setting's values -> the backward each names (Handle.backend):
#   auto     per kind of layer, the faster of indexed and gather, measured on its first backward
#   indexed  Triton GEMMs that read the active rows by index inside their loads (sebp_triton)
#   gather   index_select copies of the active rows, cuBLAS on them, one pass writing dX
#   runs     cuBLAS on each run of consecutive active rows in place (_sparse_backward_runs)
KERNELS = {"auto": "auto", "indexed": "triton", "gather": "torch", "runs": "runs"}


class Handle:
    """What patch() returns: the patched modules and the current step's active rows."""

    def __init__(self, model):
        self.model = model
        self.saved = []  # (module, had_instance_forward, instance_forward)
        self.rows: ActiveRows | None = None
        self.backend = "auto"  # auto | triton | torch | runs (KERNELS: the setting's names for them)

    def __len__(self):
        return len(self.saved)


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend != "auto":
        return backend == "triton"
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------- backward math


def _sparse_backward(g2, x2, rows: ActiveRows, weight, lora, need, backend):
    """Gradients of one linear layer from the active rows only.

    g2 [M, N] output grad, x2 [M, K] input, weight [N, K] dense (or None when no dX and
    no dW are needed), lora = (A [r, K], B [N, r], scaling) or None.
    need = (dx, dw, db, da, dbb) flags. Returns (dx, dw, db, dA, dB) with None where unneeded.

    Host cost matters as much as GPU cost here: at a quarter of the rows active a layer's
    GPU work is a few hundred microseconds, about what a dozen Python-side launches take.
    So every quantity that depends only on the step (row ids, their count) comes from
    `rows`, LoRA's scaling is applied inside the kernels' stores, and dX's inactive rows
    are cleared by one memset (torch.zeros) rather than an indexed kernel.
    """
    args = (g2, x2, rows, weight, lora, need)
    if backend == "runs":
        return _sparse_backward_runs(*args)
    if backend == "auto" and x2.is_cuda:
        from .sebp_triton import row_class

        key = (row_class(x2.shape[0]), x2.shape[1], g2.shape[1], str(x2.dtype), str(g2.dtype),
               lora is not None, tuple(need), row_class(rows.n_active))
        backend = choose_backend(key, {"triton": lambda: _sparse_backward_triton(*args),
                                       "torch": lambda: _sparse_backward_torch(*args)}, device=x2.device)
    if _use_triton(x2, backend):
        return _sparse_backward_triton(*args)
    return _sparse_backward_torch(*args)


# (class of the rows in the batch and of the active rows (sebp_triton.row_class: three
# classes); input and output widths; dtypes; LoRA or not; grads wanted) -> the faster
# backend on this GPU. The key is what changes the ranking: the layer's shape and how many
# rows there are and are active. Classes instead of counts keep a padded run, whose every
# batch has its own length, to at most three measurements per layer shape instead of one
# per new length (each a stall of the step that meets it).
_CHOICE: dict = {}
_CHOICES_IN: list = [None, None]  # [folder remember_choices was given, the file read from it]


def remember_choices(folder) -> None:
    """Keep the backend choices in a JSON file under `folder`, one file per GPU model and
    torch / Triton version (the ranking depends on all of them), so that a later run
    measures nothing an earlier one measured. The file is read at the first choice (on the
    GPU the layer runs on, so nothing touches a device before the run does) and rewritten
    after each new one. An unreadable file is started anew."""
    _CHOICES_IN[:] = [os.fspath(folder), None]


def _choices_file(device) -> str | None:
    import json
    import re

    folder, path = _CHOICES_IN
    if folder is None or path is not None:
        return path
    import triton

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    tag = f"{name}-torch{torch.__version__}-triton{triton.__version__}"
    path = os.path.join(folder, re.sub(r"[^A-Za-z0-9._+-]+", "-", tag) + ".json")
    _CHOICES_IN[1] = path
    try:
        with open(path) as f:
            stored = json.load(f)
        for k, v in stored.items():
            if v in ("triton", "torch"):
                _CHOICE.setdefault(tuple(tuple(x) if isinstance(x, list) else x for x in json.loads(k)), v)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return path


def _store_choices(path) -> None:
    import json

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({json.dumps(list(k)): v for k, v in _CHOICE.items()}, f, indent=0)
        os.replace(tmp, path)
    except OSError:  # a cache that cannot be written costs a measurement next time, nothing more
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _cuda_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def choose_backend(key, candidates: dict, timer=_cuda_ms, reps: int = 3, device=None) -> str:
    """The faster of the row-gathering Triton kernels and index_select + cuBLAS for this
    kind of layer and row count, measured once (both give the exact gradients; which is
    faster depends on the shape and the fraction: the gathered GEMMs save the copies, the
    cuBLAS path has the faster GEMM and fewer Python-side launches). The first backward of
    each key runs every candidate 1 + reps times and waits for the GPU (once per key, like
    Triton's autotuning); every later one is a dictionary lookup."""
    path = _choices_file(device) if device is not None else None
    choice = _CHOICE.get(key)
    if choice is None:
        best = {}
        for name, fn in candidates.items():
            fn()  # warm-up: compiles and autotunes the Triton kernels on their first use
            best[name] = min(timer(fn) for _ in range(reps))
        choice = min(best, key=best.get)
        _CHOICE[key] = choice
        if path is not None:
            _store_choices(path)
    return choice


def _sparse_backward_triton(g2, x2, rows, weight, lora, need):
    """Row-gathering Triton GEMMs: no gathered copy of X or dY (memory = the row ids and
    the compact [n_active, r] LoRA intermediates). Launches for LoRA over a frozen base:
    dY[R]B, X[R]Aᵀ, dB, dA, the dX memset and dX: six (plus split-K reductions)."""
    from .sebp_triton import gathered_mm, gathered_tn

    M, K = x2.shape
    idx = rows.index if rows.index.device == x2.device else rows.index.to(x2.device)
    want_dx, want_dw, want_db, want_da, want_dbb = need
    dx = dw = db = da = dbb = None
    dh = None
    if lora is not None and (want_dx or want_da or want_dbb):
        A, B, s = lora
        r = A.shape[0]
        dh = torch.empty((rows.n_active, r), device=x2.device, dtype=torch.float32)
        gathered_mm(g2, idx, B, dh, scatter=False, alpha=s)  # s·dY[R] B
        if want_dbb:
            h = torch.empty((rows.n_active, r), device=x2.device, dtype=torch.float32)
            gathered_mm(x2, idx, A.t(), h, scatter=False)
            dbb = torch.empty_like(B)
            gathered_tn(g2, idx, h, dbb, gather_q=False, alpha=s)
        if want_da:
            da = torch.empty_like(A)
            gathered_tn(x2, idx, dh, da.t(), gather_q=False)
    if want_dx:
        w = weight.to(g2.dtype)
        # One memset (full bandwidth, one cheap launch) for the rows outside R; the GEMM
        # then overwrites the rows of R.
        dx = torch.zeros((M, K), device=x2.device, dtype=x2.dtype)
        extra = (dh, lora[0]) if dh is not None else None
        gathered_mm(g2, idx, w, dx, scatter=True, extra=extra)
    if want_dw:
        dw = torch.empty_like(weight)
        gathered_tn(g2, idx, x2, dw, gather_q=True)
    if want_db:  # Σ_R dY as dY[R]ᵀ · 1, through the same gathered reduction
        ones = torch.ones((rows.n_active, 1), device=g2.device, dtype=torch.float32)
        db = torch.empty((g2.shape[1], 1), device=g2.device, dtype=torch.float32)
        db = gathered_tn(g2, idx, ones, db, gather_q=False).squeeze(1)
    return dx, dw, db, da, dbb


def _sparse_backward_torch(g2, x2, rows, weight, lora, need):
    """The same math through index_select and dense matmuls on the gathered rows (CPU,
    and on CUDA the cuBLAS path `choose_backend` compares). Each of X[R] and dY[R] is
    gathered once; the copies cost n_active x (K + N) elements of memory for the layer's
    backward. dX: cuBLAS writes dY[R] W compactly, then on CUDA (and under the Triton
    interpreter) one `scatter_rows` pass adds LoRA's rank-r share in fp32 and writes every
    row of dX once (zeros outside R). With K wide (a down_proj) that pass moves about a
    quarter of the bytes of the memset + fp32 add + casts + index_copy_ it replaces."""
    M, K = x2.shape
    same = rows.index.device == x2.device
    idx = rows.long_index if same else rows.index.to(x2.device).long()
    want_dx, want_dw, want_db, want_da, want_dbb = need
    dx = dw = db = da = dbb = None
    gr = g2.index_select(0, idx)
    xr = x2.index_select(0, idx) if (want_dw or (lora is not None and (want_da or want_dbb))) else None
    dh = None
    if lora is not None and (want_dx or want_da or want_dbb):
        A, B, s = lora
        grf = gr.to(A.dtype)
        dh = (grf @ B) * s
        if want_dbb or want_da:
            xrf = xr.to(A.dtype)
            if want_dbb:
                dbb = (grf.t() @ (xrf @ A.t())) * s
            if want_da:
                da = dh.t() @ xrf
            del xrf  # an fp32 [n_active, K] copy: freed before dX's buffers are allocated
        if not want_dw:
            xr = None
    if want_dx:
        part = gr @ weight.to(g2.dtype)
        if _use_triton(x2, "auto"):
            from .sebp_triton import scatter_rows

            pos = rows.position if same else rows.position.to(x2.device)
            dx = torch.empty((M, K), device=x2.device, dtype=x2.dtype)
            extra = (dh, lora[0].contiguous()) if dh is not None else None
            scatter_rows(part, pos, dx, extra=extra)
        else:
            if dh is not None:
                part = part.float() + dh.float() @ lora[0].float()
            dx = torch.zeros((M, K), device=x2.device, dtype=x2.dtype)
            dx.index_copy_(0, idx, part.to(dx.dtype))
        del part
    if want_dw:
        dw = (gr.t() @ xr.to(g2.dtype)).to(weight.dtype)
    if want_db:
        db = gr.float().sum(0)
    return dx, dw, db, da, dbb


def _sparse_backward_runs(g2, x2, rows, weight, lora, need):
    """The same math with cuBLAS reading the active rows where they lie: each run of
    consecutive active rows (`rows.runs`, one a sequence in a padded batch) is a contiguous
    view of dY and of dX, so dX[run] = dY[run] W is one GEMM writing straight into dX, with
    no gathered copy of dY or X, no scatter, no Triton compile or autotuning (nothing that
    depends on the row count but the launch sizes). Rows outside R: zeroed by a memset of
    the gaps, or written as zeros by LoRA's product below.

    LoRA's rank-r products run over every row, multiplied by the 0/1 row mask
    (`rows.keep`): dh = s·(dY B)·keep, h = s·(X Aᵀ)·keep. dA = dhᵀ X and dB = dYᵀ h then
    sum over R only (0 · a finite value is exactly 0), and dX starts as dh A, zero outside
    R, to which each run's base GEMM adds (addmm_, the add inside the GEMM's epilogue).
    These products are skinny (r columns), so reading the padding rows costs bandwidth
    only; they run in dY's dtype (bf16 under autocast, as autograd of the autocast forward
    computes them), accumulating in fp32 inside the GEMM, with dA, dB returned in the
    factors' dtype. Autocast is off inside: the products run in the dtypes chosen here."""
    with torch.autocast(g2.device.type, enabled=False):
        return _runs_backward(g2, x2, rows, weight, lora, need)


def _runs_backward(g2, x2, rows, weight, lora, need):
    M, K = x2.shape
    want_dx, want_dw, want_db, want_da, want_dbb = need
    dx = dw = db = da = dbb = None
    ct = g2.dtype
    runs = rows.runs
    xc = x2 if x2.dtype == ct else None
    dh = None
    if lora is not None and (want_dx or want_da or want_dbb):
        A, B, s = lora
        keep = rows.keep(ct, g2.device)
        a = A.to(ct)
        dh = (g2 @ B.to(ct)).mul_(keep).mul_(s)
        if want_da or want_dbb:
            xc = x2.to(ct)
        if want_dbb:
            h = (xc @ a.t()).mul_(keep)
            dbb = (g2.t() @ h).mul_(s).to(B.dtype)
            del h
        if want_da:
            da = (dh.t() @ xc).to(A.dtype)
    if want_dx:
        w = weight.to(ct)
        if dh is not None:
            out = dh @ a  # LoRA's share on every row: zero outside R, as dh is
            for s_, e_ in runs:
                out[s_:e_].addmm_(g2[s_:e_], w)
        else:
            out = torch.empty((M, K), device=g2.device, dtype=ct)
            for s_, e_ in rows.gaps:
                out[s_:e_].zero_()
            for s_, e_ in runs:
                torch.mm(g2[s_:e_], w, out=out[s_:e_])
        dx = out if out.dtype == x2.dtype else out.to(x2.dtype)
    if want_dw:  # a trainable base (rare): per run, summed in fp32
        if xc is None:
            xc = x2.to(ct)
        acc = torch.zeros(weight.shape, device=g2.device, dtype=torch.float32)
        for s_, e_ in runs:
            acc += g2[s_:e_].t() @ xc[s_:e_]
        dw = acc.to(weight.dtype)
    if want_db:
        db = (rows.keep(ct, g2.device).t() @ g2).squeeze(0).float()
    return dx, dw, db, da, dbb


class SparseLinearFn(torch.autograd.Function):
    """y = forward(x) (the module's own dense forward); backward from active rows only.

    weight/bias: the plain base parameters (None for a 4-bit base, which `dense_weight`
    dequantises in the backward); lora_a/lora_b: the adapter weights or None.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, spec):
        y = spec.forward(x)
        ctx.spec = spec
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        spec = ctx.spec
        M = spec.rows.n_total
        x2 = x.reshape(M, x.shape[-1]).contiguous()
        g2 = gy.reshape(M, gy.shape[-1]).contiguous()
        nx, nw, nb, na, nbb, _ = ctx.needs_input_grad
        w = weight
        if nx and w is None:
            w = spec.dense_weight()
        lora = (lora_a, lora_b, spec.scaling) if lora_a is not None else None
        dx, dw, db, da, dbb = _sparse_backward(
            g2, x2, spec.rows, w, lora, (nx, nw and weight is not None, nb and ctx.has_bias, na, nbb), spec.backend
        )
        if dx is not None:
            dx = dx.view(x.shape)
        if db is not None:
            db = db.to(gy.dtype)
        return dx, dw, db, da, dbb, None


@dataclass
class _Spec:
    forward: object
    rows: ActiveRows
    dense_weight: object = None
    scaling: float = 1.0
    backend: str = "auto"


# --------------------------------------------------------------------------- module kinds


def is_lora_layer(m) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return isinstance(m, LoraLayer)


def _is_4bit(m) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(m, bnb.nn.Linear4bit)


def _dequant(base):
    import bitsandbytes.functional as bnbf

    w = base.weight
    return bnbf.dequantize_4bit(w.data, w.quant_state)


def base_parts(base):
    """(weight tensor or None, bias, dense_weight fn) for a supported base, else None."""
    if _is_4bit(base):
        return None, base.bias, lambda: _dequant(base)
    if type(base) is nn.Linear:  # not subclasses: Linear8bitLt and friends hold other weights
        return base.weight, base.bias, None
    return None


def lora_parts(m):
    """(A, B, scaling) when the layer runs plain single-adapter LoRA, else None."""
    if m.disable_adapters or m.merged:
        return None
    active = [a for a in m.active_adapters if a in m.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(name, False):
        return None
    drop = m.lora_dropout[name]
    if m.training and not isinstance(drop, nn.Identity) and getattr(drop, "p", 0) > 0:
        return None  # the backward would need the dropout mask
    a, b = m.lora_A[name], m.lora_B[name]
    if not isinstance(a, nn.Linear) or not isinstance(b, nn.Linear) or b.bias is not None or a.bias is not None:
        return None
    return a.weight, b.weight, m.scaling[name]


def _rows_for(handle, x):
    rows = handle.rows
    if rows is None or not torch.is_grad_enabled() or x.dim() != 3 or tuple(x.shape[:2]) != rows.shape:
        return None
    if rows.n_active == rows.n_total:
        return None  # all active: the dense backward is the same work, and cuBLAS does it best
    return rows


def _make_forward(handle, module, original):
    lora_layer = is_lora_layer(module)

    def forward(x, *args, **kwargs):
        rows = _rows_for(handle, x) if not args and not kwargs else None
        if rows is None:
            return original(x, *args, **kwargs)
        if lora_layer:
            parts = lora_parts(module)
            base = base_parts(module.get_base_layer())
            if parts is None or base is None:
                return original(x)
            a, b, s = parts
            weight, bias, dense = base
            spec = _Spec(original, rows, dense, s, handle.backend)
            return SparseLinearFn.apply(x, weight, bias, a, b, spec)
        weight, bias, dense = base_parts(module)
        spec = _Spec(original, rows, dense, 1.0, handle.backend)
        return SparseLinearFn.apply(x, weight, bias, None, None, spec)

    return forward


# --------------------------------------------------------------------------- public API


def _targets(model):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inside_lora = set()
    for m in model.modules():
        if is_lora_layer(m):
            inside_lora.update(id(c) for c in m.modules() if c is not m)
    out = []
    for name, m in model.named_modules():
        if m is head or name.split(".")[-1] == "lm_head" or id(m) in inside_lora:
            continue
        if is_lora_layer(m):
            if hasattr(m, "lora_A") and base_parts(m.get_base_layer()) is not None:
                out.append(m)
        elif base_parts(m) is not None:
            out.append(m)
    return out


def patch(model) -> Handle:
    """Route every block linear (nn.Linear, bnb Linear4bit, PEFT LoRA over either) of
    `model` through SparseLinearFn. The lm_head is left alone. Idempotent."""
    existing = getattr(model, _ATTR, None)
    if isinstance(existing, Handle):
        return existing
    handle = Handle(model)
    for m in _targets(model):
        had = "forward" in m.__dict__
        original = m.__dict__["forward"] if had else m.forward
        handle.saved.append((m, had, original))
        m.forward = _make_forward(handle, m, original)
    object.__setattr__(model, _ATTR, handle)
    return handle


def unpatch(model) -> None:
    handle = getattr(model, _ATTR, None)
    if not isinstance(handle, Handle):
        return
    for m, had, original in handle.saved:
        if had:
            m.forward = original
        else:
            del m.forward
    object.__delattr__(model, _ATTR)


def set_active_rows(model_or_handle, mask: torch.Tensor | None) -> None:
    """Tell the patched layers which rows have a non-zero gradient this step
    ([batch, seq] bool, e.g. attention_mask.bool() with right or left padding, or an
    ActiveRows built earlier), or None to use the dense backward everywhere. The row ids
    are computed here, once: every layer of the step reuses them."""
    handle = model_or_handle if isinstance(model_or_handle, Handle) else getattr(model_or_handle, _ATTR, None)
    if not isinstance(handle, Handle):
        raise ValueError("set_active_rows: the model is not patched (call sebp.patch(model) first)")
    handle.rows = _as_rows_for(mask, handle.backend)


def _as_rows_for(mask, backend):
    rows = _as_rows(mask)
    if rows is not None and backend == "runs":
        rows.runs  # noqa: B018 - built here, once per step, not in the first layer's backward
    return rows


class Enabled:
    """What `enabled()` yields: SEBP switched on or off for one training run, one object
    the training loops hold whatever the setting. When off every method is a no-op."""

    def __init__(self, model, on: bool, backend: str = "auto"):
        self.model = model
        self.on = bool(on)
        self.backend = KERNELS.get(backend, backend)
        self._patch: Handle | None = None
        if self.on:
            self._apply()

    def _apply(self) -> None:
        if isinstance(getattr(self.model, _ATTR, None), Handle):
            raise ValueError("sebp.enabled: the model is already patched (one SEBP handle per model)")
        self._patch = patch(self.model)
        self._patch.backend = self.backend

    def _remove(self) -> None:
        if self._patch is not None:
            unpatch(self.model)
            self._patch = None

    @property
    def patched(self) -> bool:
        return self._patch is not None

    def set_active_rows(self, mask: torch.Tensor | None) -> None:
        """This micro-batch's [batch, seq] rows with a gradient (see `set_active_rows`);
        nothing when SEBP is off or lifted."""
        if self._patch is not None:
            self._patch.rows = _as_rows_for(mask, self._patch.backend)

    @contextlib.contextmanager
    def lifted(self):
        """The model's own forwards inside the block (generation: the rollouts' packed fast
        path refuses patched layers), SEBP back after it, with no active rows set. Patching
        is a loop over the modules: lifting costs nothing next to a generation."""
        if self._patch is None:
            yield self
            return
        self._remove()
        try:
            yield self
        finally:
            self._apply()


@contextlib.contextmanager
def enabled(model, on: bool = True, backend: str = "auto"):
    """SEBP for the duration of a `with` block, the one way the engine switches it:

        with sebp.enabled(model, eff.sebp) as h:
            for each micro-batch:
                h.set_active_rows(batch["attention_mask"].bool())
                ... forward, backward ...
            with h.lifted():
                ... generate ...

    Patch after add_lora. The patch comes off at the end of the block, also when the
    block raises; with `on` False nothing is patched and the handle does nothing."""
    h = Enabled(model, on, backend)
    try:
        yield h
    finally:
        h._remove()


# --------------------------------------------------------------------------- lm_head


def _ce_sum(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, softcap) -> torch.Tensor:
    logits = F.linear(h, weight).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, y, reduction="sum")


def sparse_lm_head_loss(hidden_states, lm_head_weight, labels, num_items_in_batch=None,
                        ignore_index: int = -100, shift_labels=None, logit_softcapping=None,
                        chunk_rows: int | None = None):
    """transformers' ForCausalLMLoss, with logits computed only where the shifted label
    is not ignore_index: mean (or sum / num_items_in_batch) cross-entropy over those rows.

    Rows without a target get no logits at all (and exactly zero gradient): with masked
    prompts this skips most of the largest matmul of a small model. The logits of the
    kept rows are computed in the weight's dtype and upcast to fp32, as transformers does.
    With `chunk_rows`, the kept rows are projected `chunk_rows` at a time and each chunk's
    logits are recomputed in the backward instead of stored (checkpointing): peak logits
    memory chunk_rows x vocab instead of rows x vocab, for a second lm_head matmul.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    keep = (targets != ignore_index).nonzero().squeeze(1)
    h, y = hidden.index_select(0, keep), targets.index_select(0, keep)
    if not chunk_rows or keep.numel() <= chunk_rows:
        loss = _ce_sum(h, lm_head_weight, y, logit_softcapping)
    else:
        from torch.utils.checkpoint import checkpoint

        loss = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, keep.numel(), chunk_rows):
            args = (h[s : s + chunk_rows], lm_head_weight, y[s : s + chunk_rows], logit_softcapping)
            loss = loss + (checkpoint(_ce_sum, *args, use_reentrant=False) if torch.is_grad_enabled()
                           else _ce_sum(*args))
    if num_items_in_batch is None:
        return loss / keep.numel()  # 0/0 = nan with no target, like transformers' mean
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
