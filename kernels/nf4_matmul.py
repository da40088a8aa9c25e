"""Y = X · dequant(W)ᵀ straight from bitsandbytes' NF4 storage, for decode batches.

bitsandbytes' own NF4 matmul, for more than one row of X, dequantises the whole weight to
bf16 (2 bytes a parameter written, then read back by cuBLAS) on every call. This kernel
dequantises each weight tile in registers, inside the GEMM's K loop, and feeds it to the
tensor cores: the weight is read once, as its 4-bit codes, and no copy of it is made.

The storage read is the one `bitsandbytes.functional.quantize_4bit(..., quant_type="nf4",
compress_statistics=True)` leaves, as Linear4bit keeps it on CUDA:

- codes: uint8, two 4-bit codes a byte, the weight [N, K] flattened in row order; element
  e is the high nibble of byte e // 2 when e is even, the low nibble when odd.
- absmax: one scale per `blocksize` (64) consecutive elements of that flat order (a
  block may run across the end of a row when K is not a multiple of it), itself
  quantised (double quantisation): uint8 codes into `state2.code` (256 fp32 values),
  times `state2.absmax` (fp32, one per 256 consecutive scales), plus `offset` (fp32).
- the 16 NF4 values (`quant_state.code`, fp32): checked equal to `NF4` once, then
  selected in registers by the code's bits (a select tree, no table load per weight).

A weight is code[c] * (code2[q] * absmax2[b // 256] + offset), computed in fp32 in that
order, then rounded to bf16: what `dequantize_4bit` returns, bit for bit (the kernel is
compiled without multiply-add fusion, which would round the scale differently). The
products accumulate in fp32 and Y is bf16.

The decode step's epilogue, in the same kernel: a bias, and a LoRA product
`mid · Bdᵀ` (mid = X · Aᵀ, [M, R], one small GEMM before the call; Bd = scaling * B,
[N, R]) added in fp32 before Y is rounded. Several weights that read the same X (q|k|v)
write column slices of one Y (`out`, `column`): one launch each, no copy of their codes.

Layout, from what an earlier fused NF4 kernel of this project measured on an H200 (in git
history): the weights are the dot's left operand (a tile of Yᵀ = W · Xᵀ: the long N side
fills the tensor cores' M, the decode batch their N), the NF4 value comes from a select
tree, and the K step is one scale block, so the scale is one load per row and step. That
kernel dequantised the absmax to fp32 beforehand (a copy); this one reads the uint8 codes
and the nested scales in the K loop, once per row and block.

Shapes: the aligned path (K a multiple of the block, as in every model layer) loads a
[BLOCK_N, 32] tile of bytes and one scale per row of the tile per K step; any other K
takes the general path, which gathers each element's byte and scale. When the M x N tiles
are too few to fill the GPU (decode: M is 1-128 rows), K is split over programs into an
fp32 workspace summed in a fixed order by a second small kernel (deterministic, unlike
atomics), which also applies the epilogue.

Nothing here syncs with the host or allocates more than Y, mid and the workspace (sizes
fixed by the shapes): a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The 16 NF4 values as bitsandbytes' quant_state.code holds them (fp32; nf4_weight checks).
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)


@dataclass(frozen=True)
class NF4Weight:
    """Views of one Linear4bit weight's bitsandbytes storage (no copies)."""

    codes: torch.Tensor  # uint8 [ceil(N * K / 2)]
    absmax: torch.Tensor  # uint8 [ceil(N * K / blocksize)]: codes into code2
    code2: torch.Tensor  # fp32 [256]
    absmax2: torch.Tensor  # fp32 [ceil(len(absmax) / blocksize2)]
    offset: torch.Tensor  # fp32 [1]
    n: int
    k: int
    blocksize: int
    blocksize2: int


def nf4_weight(data: torch.Tensor, quant_state) -> NF4Weight:
    """An NF4Weight of a Params4bit's `data` and `quant_state`; ValueError (one line) for
    storage the kernel does not read: not NF4, absmax not double-quantised, or repacked
    by bitsandbytes for its CPU kernel (on a layer's first forward on a CPU)."""
    qs = quant_state
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError("the NF4 weight was repacked by bitsandbytes for its CPU kernel")
    if qs.quant_type != "nf4":
        raise ValueError(f"quant_type {qs.quant_type} (the kernel reads nf4)")
    if not qs.nested:
        raise ValueError("absmax is not double-quantised (the kernel reads compress_statistics=True storage)")
    if len(qs.shape) != 2:
        raise ValueError(f"weight shape {tuple(qs.shape)} is not 2-D")
    if not torch.equal(qs.code.detach().float().cpu(), torch.tensor(NF4)):
        raise ValueError("the quant_state's NF4 table is not bitsandbytes' 16 values")
    n, k = qs.shape
    codes = (data if data.dtype == torch.uint8 else data.view(torch.uint8)).reshape(-1)
    s2 = qs.state2
    if codes.numel() * 2 < n * k or qs.absmax.dtype != torch.uint8 or s2.code.numel() != 256:
        raise ValueError("NF4 storage does not match its quant_state")
    offset = qs.offset if torch.is_tensor(qs.offset) else torch.tensor(float(qs.offset), device=codes.device)
    return NF4Weight(codes=codes, absmax=qs.absmax.reshape(-1), code2=s2.code.float(), absmax2=s2.absmax.float(),
                     offset=offset.reshape(1).float(), n=n, k=k, blocksize=qs.blocksize,
                     blocksize2=s2.blocksize)


def dequantize(w: NF4Weight) -> torch.Tensor:
    """bf16 [N, K] of the weight through the kernel (Y = I · Wᵀ, an exact product): for tests."""
    eye = torch.eye(w.k, device=w.codes.device, dtype=torch.bfloat16)
    return nf4_matmul(eye, w).t().contiguous()


# --------------------------------------------------------------------------- kernels


@triton.jit
def _round_bf16(v):
    """fp32 holding the bf16 nearest to v (ties to even). The interpreter's own conversion
    to bf16 truncates, and its dot multiplies bf16 bit patterns as integers, so there the
    kernel rounds with this and multiplies bf16 values held in fp32 (exact products)."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(v, EMULATE: tl.constexpr):
    """v rounded to bf16: bf16 on the GPU, bf16 values in fp32 under the interpreter."""
    if EMULATE:
        return _round_bf16(v.to(tl.float32))
    return v.to(tl.bfloat16)


@triton.jit
def _nf4_value(c):
    """NF4[c] for 4-bit codes c, by a select tree on c's bits (constants in registers, no
    table load per weight)."""
    b0, b1, b2, b3 = (c & 1) != 0, (c & 2) != 0, (c & 4) != 0, (c & 8) != 0
    lo = tl.where(b2,
                  tl.where(b1, tl.where(b0, 0.0, -0.09105003625154495),
                           tl.where(b0, -0.18477343022823334, -0.28444138169288635)),
                  tl.where(b1, tl.where(b0, -0.39491748809814453, -0.5250730514526367),
                           tl.where(b0, -0.6961928009986877, -1.0)))
    hi = tl.where(b2,
                  tl.where(b1, tl.where(b0, 1.0, 0.7229568362236023),
                           tl.where(b0, 0.5626170039176941, 0.44070982933044434)),
                  tl.where(b1, tl.where(b0, 0.33791524171829224, 0.24611230194568634),
                           tl.where(b0, 0.16093020141124725, 0.07958029955625534)))
    return tl.where(b3, hi, lo)


@triton.jit
def _weight_tile(q_ptr, aq_ptr, code2_ptr, am2_ptr, offset, rn, k0, N, K,
                 BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """bf16 [BLOCK_N, BLOCK_K] of W at rows rn, columns k0 .. k0 + BLOCK_K."""
    if ALIGNED:  # BLOCK_K == BLOCKSIZE and K % BLOCKSIZE == 0: one scale per row of the tile
        rn64 = rn.to(tl.int64)
        rj = tl.arange(0, BLOCK_K // 2)
        nmask = rn < N
        byte = tl.load(q_ptr + rn64[:, None] * (K // 2) + k0 // 2 + rj[None, :], mask=nmask[:, None], other=0)
        byte = byte.to(tl.int32)
        codes = tl.join((byte >> 4) & 0xF, byte & 0xF).reshape(BLOCK_N, BLOCK_K)  # k = 2j (high), 2j + 1
        blk = rn64 * (K // BLOCKSIZE) + k0 // BLOCKSIZE
        aq = tl.load(aq_ptr + blk, mask=nmask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + aq) * tl.load(am2_ptr + blk // BLOCKSIZE2, mask=nmask, other=0.0) + offset
        w = _nf4_value(codes) * scale[:, None]
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        e = rn.to(tl.int64)[:, None] * K + rk[None, :]
        m = (rn[:, None] < N) & (rk[None, :] < K)
        byte = tl.load(q_ptr + e // 2, mask=m, other=0).to(tl.int32)
        codes = (byte >> ((1 - (e % 2).to(tl.int32)) * 4)) & 0xF
        blk = e // BLOCKSIZE
        aq = tl.load(aq_ptr + blk, mask=m, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + aq) * tl.load(am2_ptr + blk // BLOCKSIZE2, mask=m, other=0.0) + offset
        w = _nf4_value(codes) * scale
    return _to_bf16(w, EMULATE)


@triton.jit
def _epilogue(acc, rm, rn, M, N, bias_ptr, mid_ptr, bd_ptr, y_ptr, stride_mid, stride_bd, stride_y,
              HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R: tl.constexpr, LORA_PREC: tl.constexpr,
              EMULATE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (Yᵀ's tile) + bias + Bd · midᵀ, rounded to bf16 into Y's rows
    rm, columns rn."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    if HAS_LORA:
        rr = tl.arange(0, R)
        bd = tl.load(bd_ptr + rn[:, None] * stride_bd + rr[None, :], mask=rn[:, None] < N, other=0.0)
        mid_t = tl.load(mid_ptr + rm[None, :] * stride_mid + rr[:, None], mask=rm[None, :] < M, other=0.0)
        if EMULATE:
            bd, mid_t = bd.to(tl.float32), mid_t.to(tl.float32)
        if LORA_PREC == 1:
            acc += tl.dot(bd, mid_t, input_precision="ieee")
        elif LORA_PREC == 2:  # fp32 factors: three tf32 passes, about fp32's accuracy (plain tf32 loses ~1e-3)
            acc += tl.dot(bd, mid_t, input_precision="tf32x3")
        else:  # 16-bit factors
            acc += tl.dot(bd, mid_t)
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], _to_bf16(acc, EMULATE).to(tl.bfloat16), mask=mask)


@triton.jit
def _nf4_mm_kernel(x_ptr, q_ptr, aq_ptr, code2_ptr, am2_ptr, offset_ptr, bias_ptr, mid_ptr, bd_ptr,
                   y_ptr, ws_ptr, M, N, K, stride_x, stride_mid, stride_bd, stride_y, k_tiles_per_split,
                   BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, ALIGNED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R: tl.constexpr, LORA_PREC: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EMULATE: tl.constexpr):
    """A [BLOCK_N, BLOCK_M] tile of Yᵀ = W · Xᵀ: the weights are the dot's left operand, so
    the long N side fills the tensor cores' M and the small batch their N."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offset = tl.load(offset_ptr)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t0 = pid_k * k_tiles_per_split
    t1 = tl.minimum(t0 + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in range(t0, t1):
        k0 = t * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        x_t = tl.load(x_ptr + rm[None, :] * stride_x + rk[:, None], mask=(rm[None, :] < M) & (rk[:, None] < K),
                      other=0.0)
        x_t = _to_bf16(x_t, EMULATE)
        w = _weight_tile(q_ptr, aq_ptr, code2_ptr, am2_ptr, offset, rn, k0, N, K,
                         BLOCKSIZE, BLOCKSIZE2, ALIGNED, BLOCK_N, BLOCK_K, EMULATE)
        if EMULATE:
            acc = tl.dot(w, x_t, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x_t, acc)
    if SPLIT == 1:
        _epilogue(acc, rm, rn, M, N, bias_ptr, mid_ptr, bd_ptr, y_ptr, stride_mid, stride_bd, stride_y,
                  HAS_BIAS, HAS_LORA, R, LORA_PREC, EMULATE)
    else:
        mask = (rn[:, None] < N) & (rm[None, :] < M)
        tl.store(ws_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None], acc, mask=mask)


@triton.jit
def _split_sum_kernel(ws_ptr, bias_ptr, mid_ptr, bd_ptr, y_ptr, M, N, stride_mid, stride_bd, stride_y,
                      HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R: tl.constexpr, LORA_PREC: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for s in range(SPLIT):  # a fixed order: the same sum at every call
        acc += tl.load(ws_ptr + (s * M + rm[None, :]) * N + rn[:, None], mask=mask, other=0.0)
    _epilogue(acc, rm, rn, M, N, bias_ptr, mid_ptr, bd_ptr, y_ptr, stride_mid, stride_bd, stride_y,
              HAS_BIAS, HAS_LORA, R, LORA_PREC, EMULATE)


# --------------------------------------------------------------------------- wrapper


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(M: int, N: int, aligned: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows: rows padded to 16 (the
    tensor cores' smallest tile), up to 64; N tiles of 64 (decode's weights are wide: more
    tiles fill the GPU). The aligned path's K step is one scale block."""
    if _INTERPRET:  # the interpreter runs on numpy: small tiles keep it quick
        return 32, 64, 64, 1, 1
    bm = min(64, max(16, triton.next_power_of_2(M)))
    return bm, 64, 64, 4, 4


def padded_rank(r: int) -> int:
    """The LoRA rank the epilogue computes with: a power of 2 of at least 16 (the dot's
    smallest); a pack's factors padded with zeros to it once skip the padding per call."""
    return max(16, triton.next_power_of_2(r))


def nf4_matmul(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None, mid: torch.Tensor | None = None,
               bd: torch.Tensor | None = None, out: torch.Tensor | None = None, column: int = 0,
               split_k: int | None = None) -> torch.Tensor:
    """bf16 X · dequant(W)ᵀ (+ bias) (+ mid · bdᵀ) for X [M, K] of any float dtype (rounded to
    bf16 as it is read, as Linear4bit casts to its bf16 compute dtype). mid [M, R] and bd
    [N, R] (fp32 or bf16, the same dtype): a LoRA product added before rounding. out: a
    bf16 [M, >= column + N] to write columns column .. column + N of (returned); else a new
    [M, N]. split_k: K split over this many programs (None: enough to fill the GPU)."""
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"X is {tuple(x.shape)}, the weight is [{w.n}, {w.k}]")
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N, K = x.shape[0], w.n, w.k
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
        column = 0
    if out.dtype != torch.bfloat16 or out.shape[0] != M or out.shape[1] < column + N or out.stride(1) != 1:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; needs bf16 [{M}, >= {column + N}]")
    y = out[:, column:column + N]
    aligned = K % w.blocksize == 0 and w.blocksize == 64
    bm, bn, bk, warps, stages = _tiles(M, N, aligned)
    grid_m, grid_n, k_tiles = triton.cdiv(M, bm), triton.cdiv(N, bn), triton.cdiv(K, bk)
    if split_k is None:
        split_k = 1 if _INTERPRET else max(1, min(k_tiles // 4, (2 * _sm_count(x.device)) // (grid_m * grid_n)))
    per = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    split = triton.cdiv(k_tiles, per)
    lora = mid is not None
    if lora:
        if bd is None or mid.shape[0] != M or bd.shape[0] != N or bd.shape[1] != mid.shape[1]:
            raise ValueError("LoRA: mid must be [M, R] and bd [N, R]")
        r = padded_rank(mid.shape[1])
        if r != mid.shape[1]:  # the dot's R must be a power of 2 of at least 16: zero columns
            mid = torch.nn.functional.pad(mid, (0, r - mid.shape[1]))
            bd = torch.nn.functional.pad(bd, (0, r - bd.shape[1]))
        mid, bd = mid.contiguous(), bd.contiguous()
    else:
        r = 16
    prec = 0 if not lora or mid.dtype != torch.float32 else 1 if _INTERPRET else 2  # see _epilogue
    ws = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if split > 1 else out
    flags = dict(HAS_BIAS=bias is not None, HAS_LORA=lora, R=r, LORA_PREC=prec, SPLIT=split, EMULATE=_INTERPRET)
    b = bias if bias is not None else out
    mid_, bd_ = (mid, bd) if lora else (out, out)
    smid, sbd = (mid.stride(0), bd.stride(0)) if lora else (0, 0)
    _nf4_mm_kernel[(grid_n, grid_m, split)](
        x, w.codes, w.absmax, w.code2, w.absmax2, w.offset, b, mid_, bd_, y, ws,
        M, N, K, x.stride(0), smid, sbd, y.stride(0), per,
        BLOCKSIZE=w.blocksize, BLOCKSIZE2=w.blocksize2, ALIGNED=aligned, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False, **flags)
    if split > 1:
        _split_sum_kernel[(grid_n, grid_m)](ws, b, mid_, bd_, y, M, N, smid, sbd, y.stride(0),
                                            BLOCK_M=bm, BLOCK_N=bn, num_warps=4, **flags)
    return out
