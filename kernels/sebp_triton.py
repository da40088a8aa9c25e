"""Triton GEMMs that read only the active rows of a [rows, features] matrix.

Two kernels cover every product of the sparse backward (R = sorted active row ids):

    gathered_mm:  out[i] = P[R[i]] @ Q  (+ D[i] @ E)   written to row R[i] (scatter) or i (compact)
    gathered_tn:  out    = P[R]ᵀ @ Q[R]  or  P[R]ᵀ @ Q  (Q compact, one row per active row)

The row gather happens inside the tile loads (each program loads the row ids of its
tile, then the rows themselves): no gathered copy of X or dY is made, so the extra
memory is the row-id list (4 bytes a row) and the small compact [n_active, r] LoRA
intermediates. Work is proportional to the number of active rows, whatever their
layout (a right-padded batch, a packed one, or scattered prompt rows).

Speed trade-offs:
- Gathered loads cannot use Hopper's bulk tensor copies (TMA needs a box of contiguous
  rows), so they are plain vectorised loads; each row is contiguous along features,
  so they stay coalesced. The dense all-active case goes to cuBLAS instead (sebp.py).
- gathered_tn reduces over rows; when its output has few tiles (LoRA's [N, r] and
  [K, r]) the rows are split over programs into an fp32 buffer summed afterwards
  (deterministic, unlike atomics), so the GPU is filled at small ranks too.
- fp32 operands (PEFT keeps LoRA factors in fp32) use tf32x3 products on the GPU: three
  tensor-core passes give about fp32's accuracy (plain tf32 would cost ~1e-3 relative
  error) at several times the rate of fp32 FMAs. The interpreter uses IEEE products.
- The skinny products (outputs of width r) also split their reduction over programs
  when they have few row tiles, for the same reason as gathered_tn.
- Rows of dX outside R: the caller (sebp.py) clears dX with one memset before the
  scattering GEMM. That writes the rows of R twice, but a memset is one cheap launch at
  full bandwidth, where an indexed zeroing kernel costs a Python-side Triton launch on
  every layer.
- A LoRA scaling factor is applied in the kernels' stores (`alpha`), not by a separate
  multiply: at low active fractions the backward is short enough that each launch counts.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _mm_configs(skinny: bool):
    if _INTERPRET:  # the interpreter runs on numpy: one small tile keeps it fast
        return [triton.Config({"BLOCK_M": 16, "BLOCK_C": 16 if skinny else 32, "BLOCK_K": 16, "GROUP_M": 4})]
    if skinny:
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_C": 16, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bk, w, s in [(64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3), (32, 256, 4, 3)]
        ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_C": bc, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bc, bk, w, s in [
            (128, 256, 64, 8, 3),
            (128, 128, 64, 8, 4),
            (128, 128, 64, 4, 4),
            (64, 256, 64, 4, 4),
            (256, 128, 64, 8, 3),
            (128, 256, 32, 8, 4),
            (64, 128, 64, 4, 4),
        ]
    ]


def _tn_configs(skinny: bool):
    if _INTERPRET:  # both index-load orders are exercised by the tests' two kernels
        return [triton.Config({"BLOCK_A": 16, "BLOCK_B": 16, "BLOCK_I": 16, "GROUP_A": 4, "PREFETCH": not skinny})]
    if skinny:
        return [
            triton.Config({"BLOCK_A": ba, "BLOCK_B": 16, "BLOCK_I": bi, "GROUP_A": 8, "PREFETCH": pf},
                          num_warps=w, num_stages=s)
            for ba, bi, w, s in [(128, 64, 4, 3), (64, 128, 4, 3), (256, 64, 8, 3)]
            for pf in (False, True)
        ]
    return [
        triton.Config({"BLOCK_A": ba, "BLOCK_B": bb, "BLOCK_I": bi, "GROUP_A": 8, "PREFETCH": pf},
                      num_warps=w, num_stages=s)
        for ba, bb, bi, w, s in [
            (128, 256, 64, 8, 3),
            (128, 128, 64, 8, 4),
            (128, 128, 64, 4, 4),
            (256, 128, 64, 8, 3),
            (128, 128, 32, 4, 5),
        ]
        for pf in (False, True)
    ]


@triton.jit(do_not_specialize=["n_rows", "n_split", "rows_bucket"])
def _gathered_mm_kernel(
    P, Idx, Q, D, E, Out,
    n_rows, C, K, R, n_split, alpha,
    stride_pm, stride_pk, stride_qk, stride_qc,
    stride_dm, stride_dr, stride_er, stride_ec, stride_os, stride_om, stride_oc,
    rows_bucket,  # only an autotune key (row_class): best tiles differ between few and many rows
    HAS_EXTRA: tl.constexpr, SCATTER: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    num_c = tl.cdiv(C, BLOCK_C)
    # Grouped order: neighbouring programs share Q's column tiles while they sit in L2.
    per_group = GROUP_M * num_c
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_c = (pid % per_group) // group_size

    offs_i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    i_ok = offs_i < n_rows
    rows = tl.load(Idx + offs_i, mask=i_ok, other=0).to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    p_ptrs = P + rows[:, None] * stride_pm
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    k_begin = 0
    k_end = K
    if SPLIT_K:  # skinny outputs (LoRA's [rows, r]) have few tiles: split the reduction too
        chunk = tl.cdiv(tl.cdiv(K, n_split), BLOCK_K) * BLOCK_K
        k_begin = tl.program_id(1) * chunk
        k_end = tl.minimum(K, k_begin + chunk)
        Out += tl.program_id(1).to(tl.int64) * stride_os
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        p = tl.load(p_ptrs + offs_k[None, :] * stride_pk, mask=i_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(
            Q + offs_k[:, None] * stride_qk + offs_c[None, :] * stride_qc,
            mask=k_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc = tl.dot(p.to(tl.float32), q.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(p, q.to(p.dtype), acc)
    if HAS_EXTRA:  # LoRA's share of dX: (dY[R] B s) @ A, a rank-r update of the same tile
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        d = tl.load(D + offs_i[:, None] * stride_dm + offs_r[None, :] * stride_dr,
                    mask=i_ok[:, None] & r_ok[None, :], other=0.0)
        e = tl.load(E + offs_r[:, None] * stride_er + offs_c[None, :] * stride_ec,
                    mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        acc = tl.dot(d.to(tl.float32), e.to(tl.float32), acc, input_precision=PRECISION)
    acc = acc * alpha  # LoRA's scaling folded into the store: no separate multiply launch
    if SCATTER:
        out_rows = rows
    else:
        out_rows = offs_i.to(tl.int64)
    tl.store(
        Out + out_rows[:, None] * stride_om + offs_c[None, :] * stride_oc,
        acc.to(Out.dtype.element_ty),
        mask=i_ok[:, None] & c_ok[None, :],
    )


@triton.jit(do_not_specialize=["n_rows", "n_split", "rows_bucket"])
def _gathered_tn_kernel(
    P, Idx, Q, Out,
    n_rows, A, B, n_split, alpha,
    stride_pm, stride_pa, stride_qm, stride_qb, stride_os, stride_oa, stride_ob,
    rows_bucket,
    GATHER_Q: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_I: tl.constexpr, GROUP_A: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_a = tl.cdiv(A, BLOCK_A)
    num_b = tl.cdiv(B, BLOCK_B)
    per_group = GROUP_A * num_b
    first_a = (pid // per_group) * GROUP_A
    group_size = tl.minimum(num_a - first_a, GROUP_A)
    pid_a = first_a + (pid % per_group) % group_size
    pid_b = (pid % per_group) // group_size

    offs_a = pid_a * BLOCK_A + tl.arange(0, BLOCK_A)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    a_ok = offs_a < A
    b_ok = offs_b < B
    chunk = tl.cdiv(tl.cdiv(n_rows, n_split), BLOCK_I) * BLOCK_I
    i_begin = split * chunk
    i_end = tl.minimum(n_rows, i_begin + chunk)
    acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    offs_i = i_begin + tl.arange(0, BLOCK_I)
    rows = tl.load(Idx + offs_i, mask=offs_i < i_end, other=0).to(tl.int64)
    for i0 in range(i_begin, i_end, BLOCK_I):
        if not PREFETCH:
            offs_i = i0 + tl.arange(0, BLOCK_I)
            rows = tl.load(Idx + offs_i, mask=offs_i < i_end, other=0).to(tl.int64)
        i_ok = offs_i < i_end
        p = tl.load(P + rows[:, None] * stride_pm + offs_a[None, :] * stride_pa,
                    mask=i_ok[:, None] & a_ok[None, :], other=0.0)
        if GATHER_Q:
            q_rows = rows
        else:
            q_rows = offs_i.to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qm + offs_b[None, :] * stride_qb,
                    mask=i_ok[:, None] & b_ok[None, :], other=0.0)
        if PREFETCH:
            # The next tile's row ids, one iteration ahead: the addresses of the next
            # loads then do not wait on an index load, so the pipeliner can issue them early.
            offs_i = offs_i + BLOCK_I
            rows = tl.load(Idx + offs_i, mask=offs_i < i_end, other=0).to(tl.int64)
        if DOT_FP32:
            acc = tl.dot(tl.trans(p.to(tl.float32)), q.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(tl.trans(p), q.to(p.dtype), acc)
    acc = acc * alpha
    tl.store(
        Out + split * stride_os + offs_a[:, None] * stride_oa + offs_b[None, :] * stride_ob,
        acc.to(Out.dtype.element_ty),
        mask=a_ok[:, None] & b_ok[None, :],
    )


@triton.jit
def _scatter_rows_kernel(Part, Pos, D, E, Out, M, C,
                         stride_pm, stride_dm, stride_dr, stride_er, stride_om,
                         R: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    pos = tl.load(Pos + offs_m, mask=m_ok, other=-1)
    act = m_ok & (pos >= 0)
    src = tl.maximum(pos, 0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    # Rows outside R load nothing (masked) and store zeros: one write of every row of dX.
    acc = tl.load(Part + src[:, None] * stride_pm + offs_c[None, :], mask=act[:, None] & c_ok[None, :],
                  other=0.0).to(tl.float32)
    if HAS_EXTRA:  # LoRA's rank-R share in IEEE fp32 FMAs, summed before it meets the base part
        # Skipped on tiles without an active row (most of them at low fractions): no reads
        # of E, no FMAs, the tile is a plain store of zeros.
        if tl.sum(act.to(tl.int32), axis=0) > 0:
            low = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
            for r in tl.static_range(R):
                d = tl.load(D + src * stride_dm + r * stride_dr, mask=act, other=0.0).to(tl.float32)
                e = tl.load(E + r * stride_er + offs_c, mask=c_ok, other=0.0).to(tl.float32)
                low += d[:, None] * e[None, :]
            acc = acc + low
    tl.store(Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_c[None, :], acc.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & c_ok[None, :])


def scatter_rows(part, pos, out, extra=None):
    """out[m] = part[pos[m]] (+ d[pos[m]] @ e with extra=(d, e)) where pos[m] >= 0, else 0.

    part: [n, C] compact rows (a cuBLAS product on the gathered rows); pos: int32 [M], the
    compact row of each output row or -1 (ActiveRows.position); out: [M, C]; d: [n, r],
    e: [r, C], both small. One pass writes every row of `out` once and reads `part` once:
    it replaces a memset of `out`, an index_copy_ and, for LoRA, an fp32 [n, C] product,
    its add and the casts around them (about 4x the bytes of this pass on a wide dX).
    The rank-r share is summed in fp32 FMAs (no tf32), as the fp32 matmul it replaces."""
    M, C = out.shape
    if part.shape[0] == 0:  # no active row: nothing to read (and no pointer to pass)
        return out.zero_()
    assert part.stride(1) == 1 and out.stride(1) == 1 and pos.numel() == M
    d, e = extra if extra is not None else (part, part)  # placeholders, never read
    if extra is not None:
        assert e.stride(1) == 1
    r = e.shape[0] if extra is not None else 0
    block_m, block_c = (16, 32) if _INTERPRET else (32, 256)
    grid = (triton.cdiv(M, block_m), triton.cdiv(C, block_c))
    _scatter_rows_kernel[grid](part, pos, d, e, out, M, C,
                               part.stride(0), d.stride(0), d.stride(1), e.stride(0), out.stride(0),
                               R=r, HAS_EXTRA=extra is not None, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
    return out


_MM_KEY = ["C", "K", "rows_bucket", "DOT_FP32", "HAS_EXTRA", "SPLIT_K"]
_TN_KEY = ["A", "B", "rows_bucket", "DOT_FP32", "GATHER_Q"]


def _quick_bench(fn, quantiles):
    # Tuning runs once per (shape, row-count bucket); short timings keep the first
    # step of a run from stalling for minutes while still ranking tiles reliably.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _tuned(configs, key):
    return triton.autotune(configs=configs, key=key, do_bench=_quick_bench)(_gathered_mm_kernel if key is _MM_KEY else _gathered_tn_kernel)


_mm_wide = _tuned(_mm_configs(False), _MM_KEY)
_mm_skinny = _tuned(_mm_configs(True), _MM_KEY)
_tn_wide = _tuned(_tn_configs(False), _TN_KEY)
_tn_skinny = _tuned(_tn_configs(True), _TN_KEY)


# Row counts change every step (each batch has its own active rows). What is compiled or
# tuned sees only one of three classes of them, so a run tunes each layer shape's kernels
# at most three times however its batches' lengths vary (a new power of two of rows used to
# cost a tuning of every shape: seconds of stall mid-run), and the kernels are not compiled
# again for a row count (`do_not_specialize`: Triton would otherwise specialise on a
# count's divisibility by 16).
ROW_CLASSES = (128, 2048)


def row_class(n: int) -> int:
    """0: at most 128 rows, 1: at most 2,048, 2: more."""
    return sum(n > b for b in ROW_CLASSES)


def _dot_fp32(*tensors) -> bool:
    # Triton's interpreter multiplies bf16 tiles wrongly (numpy has no bf16): there, upcast
    # them; bf16 x bf16 products are exact in fp32, so only the summation order differs.
    return _INTERPRET or any(t.dtype == torch.float32 for t in tensors)


def _launch(kernel, grid, *args, **kwargs):
    """fp32 products use tf32x3 on the GPU (three tensor-core passes, about fp32's
    accuracy, several times the speed of plain fp32 FMAs); IEEE if a Triton build lacks it."""
    global _PRECISION
    try:
        kernel[grid](*args, PRECISION=_PRECISION, **kwargs)
    except Exception:
        if _PRECISION == "ieee" or not kwargs.get("DOT_FP32"):
            raise
        _PRECISION = "ieee"
        kernel[grid](*args, PRECISION=_PRECISION, **kwargs)


_PRECISION = "ieee" if _INTERPRET else "tf32x3"


def gathered_mm(p, idx, q, out, scatter: bool, extra=None, alpha: float = 1.0):
    """out[R[i] if scatter else i] = alpha · (p[R[i]] @ q (+ d[i] @ e when extra=(d, e))).

    p: [rows, K]; idx: int32 [n]; q: [K, C] (any strides); out: [rows or n, C].
    """
    n, (K, C) = idx.numel(), q.shape
    if n == 0:
        return out
    d, e = extra if extra is not None else (out, out)  # placeholders, never read
    r = e.shape[0] if extra is not None else 1
    block_r = max(16, triton.next_power_of_2(r))
    skinny = C <= 32
    # Few row tiles and a skinny output (LoRA's X[R] Aᵀ, dY[R] B at small f): split the
    # reduction so the whole GPU works, summing fp32 partials afterwards (deterministic).
    n_split = 1
    if skinny and extra is None and not scatter:
        n_split = max(1, min(triton.cdiv(2 * _num_sms(p.device), triton.cdiv(n, 64)), K // 256))
        if _INTERPRET:  # keep the split path under test at the tests' small sizes
            n_split = 2 if K >= 32 else 1
    target = out if n_split == 1 else torch.empty((n_split, n, C), device=p.device, dtype=torch.float32)
    so = 0 if n_split == 1 else target.stride(0)
    som, soc = (out.stride(0), out.stride(1)) if n_split == 1 else (target.stride(1), target.stride(2))
    kernel = _mm_skinny if skinny else _mm_wide
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(C, meta["BLOCK_C"]), n_split)  # noqa: E731
    _launch(
        kernel, grid,
        p, idx, q, d, e, target,
        n, C, K, r, n_split, float(alpha),
        p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        d.stride(0), d.stride(1), e.stride(0), e.stride(1), so, som, soc,
        row_class(n),
        HAS_EXTRA=extra is not None, SCATTER=scatter, DOT_FP32=_dot_fp32(p, q), SPLIT_K=n_split > 1,
        BLOCK_R=block_r,
    )
    if n_split > 1:
        _sum_into(target, out)
    return out


def _sum_into(partials, out):
    # One reduction launch straight into `out` (any strides) when the dtype allows it,
    # instead of a sum into a fresh tensor plus a copy.
    if out.dtype == torch.float32:
        torch.sum(partials, 0, out=out)
    else:
        out.copy_(partials.sum(0))


@functools.lru_cache(maxsize=None)
def _num_sms_of(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device) -> int:
    # Cached: the property lookup is host time on every launch, and launches are what
    # the backward of a layer with few active rows is made of.
    if device.type != "cuda":
        return 4
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())


def gathered_tn(p, idx, q, out, gather_q: bool, alpha: float = 1.0):
    """out[A, B] = alpha · p[R]ᵀ @ (q[R] if gather_q else q); out may be a transposed view."""
    n, A, B = idx.numel(), p.shape[1], q.shape[1]
    if n == 0:
        return out.zero_()
    skinny = B <= 32
    # Split the row reduction only when the output alone cannot fill the GPU.
    tiles = triton.cdiv(A, 128) * triton.cdiv(B, 16 if skinny else 128)
    n_split = max(1, min(triton.cdiv(2 * _num_sms(p.device), tiles), n // 128 if not _INTERPRET else 2))
    target = out if n_split == 1 else torch.empty((n_split, A, B), device=p.device, dtype=torch.float32)
    so, sa, sb = (0, out.stride(0), out.stride(1)) if n_split == 1 else target.stride()
    kernel = _tn_skinny if skinny else _tn_wide
    grid = lambda meta: (triton.cdiv(A, meta["BLOCK_A"]) * triton.cdiv(B, meta["BLOCK_B"]), n_split)  # noqa: E731
    _launch(
        kernel, grid,
        p, idx, q, target,
        n, A, B, n_split, float(alpha),
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), so, sa, sb,
        row_class(n),
        GATHER_Q=gather_q, DOT_FP32=_dot_fp32(p, q),
    )
    if n_split > 1:
        _sum_into(target, out)
    return out
