"""Fused NF4 dequantise-and-matmul for decode: y = x @ W.T with W in bitsandbytes' NF4.

Used by the fast rollout loop (engine/fast_decode.py) when the base is NF4 and no dense
bf16 copy of the weights is made. x is [M, K] with M the decode batch (1..128), W is
[N, K] stored as bitsandbytes stores it:

- `packed`: uint8, the row-major [N, K] codes flattened, two codes a byte: element 2i in
  the HIGH nibble of byte i, element 2i+1 in the LOW nibble (bitsandbytes' quantize_4bit:
  `(q[::2] << 4) | q[1::2]`). With K even, row n's bytes are packed[n*K/2 : (n+1)*K/2].
- `absmax`: one fp32 scale per `blocksize` (64) consecutive flat elements. bitsandbytes
  double-quantises it (uint8 codes + a second absmax per 256 + an offset); `prepare`
  dequantises it once per generate call with bitsandbytes' own dequantize_blockwise,
  into fp32: 4 bytes per 64 weights (0.5 GB for 7B, 4.5 GB for 72B).
- the weight value is `float32(NF4[code]) * absmax`, rounded to bf16: the exact bf16
  values bitsandbytes' dequantize_4bit(...).to(bfloat16) gives (tests check equality).

Bytes moved per weight and step, at decode sizes (weights dominate; x and y are tiny):
- bitsandbytes' matmul_4bit for M > 1: dequantise into a bf16 temporary, then cuBLAS:
  read 0.5 + write 2 + read 2 = 4.5 B (plus two launches per linear).
- "dequantise each layer once per step into one reused bf16 buffer": the same 4.5 B
  (the buffer saves allocations, not traffic), and the packed bf16 copy costs 2 B read
  per step but 2 B of memory per weight for the whole call (15 GB at 7B, 145 GB at 72B).
- this kernel: 0.5 B + 0.0625 B (fp32 scale) read, no temporary: ~8x fewer bytes than
  the dequantise-then-matmul paths and ~3.5x fewer than the bf16 copy.
The price is arithmetic: each weight is unpacked, looked up and scaled in registers
(~25 integer/float instructions per weight, independent of M), so the kernel is bound by
instruction issue, not by the bytes it reads.

The layout and the lookup were chosen by measurement on one H200 (bench/nf4_matmul.py,
Qwen2.5-7B shapes, M = 16..128; bench/RESULTS.md "NF4 decode"), against the alternatives
they replaced, which lost every cell and were removed:
- the weights as the dot's LEFT operand (a tile of y.T = W @ x.T): the long N side fills
  the MMA's M, the small batch its N; 1.3-2.5x faster than x on the left.
- the code value by a select tree on the code's 4 bits (`_nf4_select`, constants in
  registers): 1.3-3.4x faster than loading it from the 16-value table per weight.
- BLOCK_K a multiple of the 64-weight quantisation block, walked a block at a time, so
  the scale is one load per row and block, not per weight.
Per matmul (CUDA-graph timed) the kernel then takes 0.99x bitsandbytes' time at M = 16 on
q/o and down (1.33x on gate/up), 1.24-1.32x at M = 64, 1.6x on q/o at M = 128; it decodes
a 7B model at 0.97x bitsandbytes' speed (2,507 vs 2,595 tokens/s, 64 x 256 new tokens;
1,043 before these three) and 0.52x the bf16 copy's; 72B at 0.88x (287 vs 328). It stays
opt-in (fast_decode.base_path). Splitting x into contiguous even/odd halves first was
measured slower (one more kernel per product) and dropped.

Tiling: x's row tile (BLOCK_M = 16..128 by M) is re-read from L2 once per N tile; to fill
the GPU when N / BLOCK_N is small, the K loop is split over programs (SPLIT_K), each
writing an fp32 partial that a second small kernel sums in a fixed order (deterministic,
unlike atomics: equal inputs give equal tokens), adding the bias and casting. Even and
odd k are handled as two half-width dots (x's even columns with the high nibbles, odd
with the low ones), so the nibbles never need to be interleaved in registers. The config
is picked per (M bucket, N, K) by timing the candidates once, each replayed in a CUDA
graph (`tune`, `_time`), outside the decode loop's own capture (its warm-up steps); not
with @triton.autotune, because SPLIT_K changes the launch (a workspace and a second
kernel), so whole launches are what must be timed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None
    tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)


@dataclass
class NF4Weight:
    """One NF4 linear weight [N, K] ready for the kernel (views of the module's bytes; only
    `absmax` is new memory)."""

    packed: Tensor  # uint8 [N, K // 2]
    absmax: Tensor  # fp32 [N, K // blocksize]
    code: Tensor  # fp32 [16]
    shape: tuple
    blocksize: int
    dtype: torch.dtype = torch.bfloat16  # compute dtype of the product


def prepare(weight: Tensor, quant_state) -> NF4Weight:
    """An NF4Weight from a Params4bit's data and quant_state; raises ValueError for
    layouts the kernel does not read (FP4, odd K, blocks crossing rows)."""
    import bitsandbytes.functional as bnbF

    if quant_state.quant_type != "nf4":
        raise ValueError(f"quant_type {quant_state.quant_type} (the kernel reads nf4)")
    N, K = quant_state.shape
    bs = quant_state.blocksize
    if K % bs or K % 2:
        raise ValueError(f"in_features {K} is not a multiple of the block size {bs}")
    data = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    if getattr(quant_state, "packing_format_for_cpu", False):
        # bitsandbytes' CPU kernel reorders the codes and keeps a bf16 [K/bs, N] absmax
        # (its own lossy copy): read back the row-major codes and use that absmax, which
        # is what its CPU matmul then computes with.
        packed = _unpack_cpu_format(data, N, K)
        absmax = quant_state.absmax.t().float().contiguous()
    else:
        packed = data.reshape(N, K // 2)
        if quant_state.nested:  # exactly dequantize_4bit's steps
            absmax = bnbF.dequantize_blockwise(quant_state.absmax, quant_state.state2)
            absmax += quant_state.offset
            absmax = absmax.float()
        else:
            absmax = quant_state.absmax.float()
        absmax = absmax.reshape(N, K // bs)
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=data.device)
    return NF4Weight(packed, absmax, code, (N, K), bs)


def _unpack_cpu_format(data: Tensor, N: int, K: int) -> Tensor:
    """Row-major packed codes from bitsandbytes' CPU layout (its inverse, without touching
    the quant_state)."""
    packed = data.reshape(-1, 32)
    qw = torch.cat([packed & 0xF, (packed >> 4) & 0xF], dim=-1)
    qw = qw.reshape(N // 32, K // 2, 32, 2).transpose(-3, -2).reshape(N, K)
    return ((qw[:, ::2] << 4) | qw[:, 1::2]).to(torch.uint8).contiguous()


# --------------------------------------------------------------------------- torch reference


def dequantize_ref(w: NF4Weight) -> Tensor:
    """[N, K] bf16 from the packed codes, as bitsandbytes computes it (fp32 product, then
    one rounding)."""
    N, K = w.shape
    hi = (w.packed >> 4).long()
    lo = (w.packed & 0xF).long()
    codes = torch.stack([hi, lo], -1).reshape(N, K)
    vals = w.code[codes].reshape(N, K // w.blocksize, w.blocksize) * w.absmax[..., None]
    return vals.reshape(N, K).to(w.dtype)


def linear_ref(x: Tensor, w: NF4Weight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ W.T (+ bias) in the compute dtype, the reference for `linear`."""
    y = torch.nn.functional.linear(x.to(w.dtype).float(), dequantize_ref(w).float())
    if bias is not None:
        y = y + bias.float()
    return y.to(w.dtype)


# --------------------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit
    def _to_bf16(v, EMULATE: tl.constexpr):
        """fp32 -> bf16, round to nearest even. The GPU's conversion does exactly that; the
        interpreter's truncates, so under EMULATE it is done on the bits (finite values)."""
        if EMULATE:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(tl.bfloat16)

    @triton.jit
    def _nf4_select(c):
        """NF4 code value of each 4-bit code c (int32 0..15) by a select tree on its bits:
        registers only, no memory access per weight (the table's fp32 values as constants)."""
        b0 = (c & 1) != 0
        b1 = (c & 2) != 0
        b2 = (c & 4) != 0
        b3 = (c & 8) != 0
        a0 = tl.where(b0, -0.6961928009986877, -1.0)
        a1 = tl.where(b0, -0.39491748809814453, -0.5250730514526367)
        a2 = tl.where(b0, -0.18477343022823334, -0.28444138169288635)
        a3 = tl.where(b0, 0.0, -0.09105003625154495)
        a4 = tl.where(b0, 0.16093020141124725, 0.07958029955625534)
        a5 = tl.where(b0, 0.33791524171829224, 0.24611230194568634)
        a6 = tl.where(b0, 0.5626170039176941, 0.44070982933044434)
        a7 = tl.where(b0, 1.0, 0.7229568362236023)
        m0 = tl.where(b1, a1, a0)
        m1 = tl.where(b1, a3, a2)
        m2 = tl.where(b1, a5, a4)
        m3 = tl.where(b1, a7, a6)
        return tl.where(b3, tl.where(b2, m3, m2), tl.where(b2, m1, m0))

    @triton.jit
    def _nf4_values(b, s, EMULATE: tl.constexpr):
        """bf16 weights of loaded bytes b (high nibble = even k, low = odd k) with their
        blocks' fp32 absmax s (same shape, or broadcastable): code value times absmax in fp32,
        one rounding, which is bitsandbytes' dequantize_4bit(...).to(bfloat16) bit for bit."""
        hi = _nf4_select(((b >> 4) & 0xF).to(tl.int32))
        lo = _nf4_select((b & 0xF).to(tl.int32))
        return _to_bf16(hi * s, EMULATE), _to_bf16(lo * s, EMULATE)

    @triton.jit
    def _nf4_mm_kernel(
        X, Wq, S, Bias, Y, P,
        M, N, K, stride_xm, stride_ym, stride_ps,
        BS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
    ):
        """y = x @ W.T with the weights as the dot's LEFT operand: a [BLOCK_N, M] tile of
        y.T = W @ x.T. At decode sizes M is small and N large, so the weight tile
        takes the MMA's long side (and, dequantised in registers, it can stay in
        registers as the left operand instead of going through shared memory); x.T is
        the small right operand (its even and odd columns read with stride 2: splitting x
        into two contiguous halves first was measured slower, one more kernel per
        product). BLOCK_K is a multiple of the quantisation block BS and each step walks
        it one block at a time, so the scale is one load per row and block."""
        num_m = tl.cdiv(M, BLOCK_M)
        pid = tl.program_id(0)
        pid_m = pid % num_m
        pid_n = pid // num_m
        pid_k = tl.program_id(1)
        HB: tl.constexpr = BS // 2  # bytes per row and block
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, HB)
        m_ok = offs_m < M
        n_ok = offs_n < N
        chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_begin = pid_k * chunk
        k_end = tl.minimum(K, k_begin + chunk)
        nl = offs_n.to(tl.int64)
        row_b = Wq + nl[:, None] * (K // 2)  # [BLOCK_N, 1]
        row_s = S + nl[:, None] * (K // BS)
        x_off = offs_m.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            for u in tl.static_range(BLOCK_K // BS):
                kk = k0 + u * BS
                kb = kk // 2 + offs_j  # byte = column of the even/odd halves
                k_ok = 2 * kb < k_end
                wmask = n_ok[:, None] & k_ok[None, :]
                b = tl.load(row_b + kb[None, :], mask=wmask, other=0)  # [BLOCK_N, HB], rows contiguous
                s_ok = n_ok[:, None] & (tl.full((BLOCK_N, 1), kk, tl.int32) < k_end)  # a ragged last step
                s = tl.load(row_s + kk // BS, mask=s_ok, other=0.0)  # [BLOCK_N, 1]
                w_hi, w_lo = _nf4_values(b, s, EMULATE)
                xmask = k_ok[:, None] & m_ok[None, :]
                x_even = tl.load(X + x_off + 2 * kb[:, None], mask=xmask, other=0.0).to(tl.bfloat16)  # [HB, BLOCK_M]
                x_odd = tl.load(X + x_off + 2 * kb[:, None] + 1, mask=xmask, other=0.0).to(tl.bfloat16)
                if EMULATE:
                    acc = tl.dot(w_hi.to(tl.float32), x_even.to(tl.float32), acc, input_precision="ieee")
                    acc = tl.dot(w_lo.to(tl.float32), x_odd.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w_hi, x_even, acc)
                    acc = tl.dot(w_lo, x_odd, acc)
        out_mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            y_ptrs = Y + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
            tl.store(y_ptrs, _to_bf16(acc, EMULATE), mask=out_mask)
        else:
            p_ptrs = P + pid_k * stride_ps + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
            tl.store(p_ptrs, acc, mask=out_mask)

    @triton.jit
    def _split_sum_kernel(P, Bias, Y, M, N, stride_ps, stride_ym,
                          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          EMULATE: tl.constexpr):
        """Y (bf16) = sum over splits of P (fixed order) + bias."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(P + s * stride_ps + offs, mask=ok, other=0.0)
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=ok, other=0.0).to(tl.float32)
        m = offs // N
        tl.store(Y + m.to(tl.int64) * stride_ym + n, _to_bf16(acc, EMULATE), mask=ok)

    @triton.jit
    def _nf4_dequant_kernel(Wq, S, Out, N, K, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
        """The kernel's bf16 weights written out [N, K] (for the bit-exactness test)."""
        HALF: tl.constexpr = BLOCK_K // 2
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kb = tl.program_id(1) * HALF + tl.arange(0, HALF)
        ke = 2 * kb
        mask = (ke < K)[:, None] & (offs_n < N)[None, :]
        b = tl.load(Wq + offs_n[None, :] * (K // 2) + kb[:, None], mask=mask, other=0)
        s = tl.load(S + offs_n[None, :] * (K // BS) + (kb // (BS // 2))[:, None], mask=mask, other=0.0)
        w_hi, w_lo = _nf4_values(b, s, EMULATE)
        o = Out + offs_n[None, :] * K + ke[:, None]
        tl.store(o, w_hi, mask=mask)
        tl.store(o + 1, w_lo, mask=mask)


def block_m(M: int) -> int:
    """Batch tile: the dot's short side (tl.dot needs at least 16); one tile takes up to
    128 rows, more take several (each re-reads the weight tile, mostly from L2)."""
    return 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): narrow N tiles with K split over
# programs won the sweep on an H200 (many programs per SM hide the lookup's latency).
CONFIGS = [
    (64, 64, 2, 4, 4), (64, 64, 4, 4, 4), (64, 64, 8, 4, 4), (64, 64, 16, 4, 4),
    (64, 128, 2, 4, 3), (64, 128, 4, 4, 3), (64, 128, 8, 4, 3),
    (128, 64, 4, 4, 4), (128, 64, 2, 8, 4), (128, 128, 2, 8, 3), (128, 128, 4, 8, 3),
]
INTERPRET_CONFIG = (32, 64, 1, 4, 1)  # small tiles keep the numpy interpreter fast (tests pass others too)
_best: dict = {}  # (M bucket, N, K) -> config


def _launch(x: Tensor, w: NF4Weight, bias: Tensor | None, y: Tensor, cfg: tuple) -> None:
    BN, BK, SK, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    if BK % w.blocksize:
        raise ValueError(f"BLOCK_K {BK} is not a multiple of the block size {w.blocksize}")
    BM = block_m(M)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN), SK)
    part = torch.empty(SK, M, N, dtype=torch.float32, device=x.device) if SK > 1 else y
    b = bias if bias is not None else y
    _nf4_mm_kernel[grid](x, w.packed, w.absmax, b, y, part, M, N, K, x.stride(0), y.stride(0),
                         part.stride(0) if SK > 1 else 0, BS=w.blocksize, HAS_BIAS=bias is not None, SPLIT_K=SK,
                         BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, EMULATE=_INTERPRET, num_warps=warps, num_stages=stages)
    if SK > 1:
        BLOCK = 1024
        _split_sum_kernel[(triton.cdiv(M * N, BLOCK),)](part, b, y, M, N, part.stride(0), y.stride(0),
                                                       HAS_BIAS=bias is not None, SPLIT_K=SK, BLOCK=BLOCK,
                                                       EMULATE=_INTERPRET)


def _time(fn) -> float:
    """GPU ms of one launch, replayed in a CUDA graph as the decode loop runs it: plain
    do_bench also counts Triton's host-side launch cost, which at these kernel lengths
    (tens of microseconds) is as long as the kernel and ranked configs wrongly."""
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=20))
    except Exception:  # noqa: BLE001 - no graph capture here: the host-bound timing
        return float(triton.testing.do_bench(fn, warmup=5, rep=20))


def tune(x: Tensor, w: NF4Weight, bias: Tensor | None, y: Tensor) -> tuple:
    """The fastest config for this (M bucket, N, K), timed once (`_time`)
    (a few ms per shape; must not run inside CUDA-graph capture)."""
    key = (block_m(x.shape[0]), w.shape[0], w.shape[1])
    if _INTERPRET or x.device.type != "cuda":
        return INTERPRET_CONFIG
    if key not in _best:
        times = {}
        for cfg in CONFIGS:
            try:
                times[cfg] = _time(lambda: _launch(x, w, bias, y, cfg))
            except Exception:  # noqa: BLE001 - a config the GPU cannot hold (shared memory)
                continue
        _best[key] = min(times, key=times.get)
    return _best[key]


def linear(x: Tensor, w: NF4Weight, bias: Tensor | None = None, out: Tensor | None = None,
           config: tuple | None = None) -> Tensor:
    """y = x @ W.T (+ bias) in w.dtype (bf16), fp32 accumulation. x: [M, K] (any float
    dtype; cast to bf16 as Linear4bit's compute dtype does). out: optional [M, N] view
    with unit column stride (a column slice of a wider output, for packed q|k|v)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    M, K = x.shape
    N = w.shape[0]
    if K != w.shape[1]:
        raise ValueError(f"x has {K} features, the weight {w.shape[1]}")
    x = x.to(w.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = out if out is not None else torch.empty(M, N, dtype=w.dtype, device=x.device)
    if y.stride(1) != 1:
        raise ValueError("out needs unit column stride")
    _launch(x, w, bias, y, config or tune(x, w, bias, y))
    return y


def dequantize(w: NF4Weight) -> Tensor:
    """The kernel's own bf16 weights [N, K] (what `linear` multiplies with)."""
    N, K = w.shape
    out = torch.empty(N, K, dtype=w.dtype, device=w.packed.device)
    BN, BK = 32, 64
    _nf4_dequant_kernel[(triton.cdiv(N, BN), triton.cdiv(K, BK))](w.packed, w.absmax, out, N, K, BS=w.blocksize,
                                                                  BLOCK_N=BN, BLOCK_K=BK, EMULATE=_INTERPRET)
    return out


def available(device) -> bool:
    """Whether the kernel can run on `device`: compiled on CUDA, or on the CPU under
    TRITON_INTERPRET=1 (tests)."""
    return triton is not None and (device.type == "cuda" or _INTERPRET)
