"""The NF4 decode matmul (kernels/nf4_matmul.py) against bitsandbytes on freshly quantised
weights (the storage Linear4bit keeps on CUDA): its dequantised weights bit for bit, and
its products against dequantize_4bit + a matmul, on shapes whose K and N are not multiples
of the block, 1 and 128 rows, and the 7B / 72B layer shapes scaled down. Under
TRITON_INTERPRET=1 on the CPU (tests/conftest.py), compiled with EDGETUNE_TEST_GPU=1."""

import pytest
import torch

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def quantised(n: int, k: int, seed: int = 0):
    import bitsandbytes.functional as bnbF

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).to(DEV)
    q, qs = bnbF.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    return q, qs, bnbF.dequantize_4bit(q, qs)


def reference(x, dense, bias=None, mid=None, bd=None):
    """fp32 X·Wᵀ (+ bias + mid·bdᵀ) of X rounded to bf16 (Linear4bit's compute dtype) and
    bitsandbytes' dequantised W: the kernel's sum up to the order of its additions."""
    y = x.to(torch.bfloat16).double() @ dense.double().t()
    if bias is not None:
        y = y + bias.double()
    if mid is not None:
        y = y + mid.double() @ bd.double().t()
    return y


def assert_products(y, ref, x, dense):
    # each output is the exact sum rounded once to bf16 (half an ulp: at most 2^-8 of it), give or
    # take the fp32 accumulation's error (a few 2^-24 of the sum of |terms|)
    terms = x.to(torch.bfloat16).double().abs() @ dense.double().abs().t()
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6 * terms).all()
    # and bit for bit the rounded exact sum wherever that is not at a rounding boundary
    same = y.double() == ref.to(torch.bfloat16).double()
    assert same.float().mean() > 0.98, same.float().mean()


@pytest.mark.parametrize("n,k", [(264, 64), (240, 70), (33, 70)])
def test_dequantised_weights_are_bitsandbytes_bit_for_bit(n, k):
    # (264, 64): the aligned path over 264 absmax blocks, two blocks of the nested absmax;
    # (240, 70): blocks running across rows, 263 of them; (33, 70): an odd count of codes.
    # (bitsandbytes' CPU build dequantises a K that is a multiple of 32 but not of 64 as if
    # each row started a block, unlike its quantiser and its CUDA kernel: no such K here.)
    from edgetune.kernels.nf4_matmul import dequantize, nf4_weight

    q, qs, dense = quantised(n, k)
    assert qs.nested and qs.absmax.dtype == torch.uint8 and qs.state2.blocksize == 256
    got = dequantize(nf4_weight(q, qs))
    assert got.dtype == torch.bfloat16 and torch.equal(got, dense)


@pytest.mark.parametrize("rows,n,k", [
    (1, 96, 200),  # one row; K and N not multiples of the block
    (128, 40, 128),  # 128 rows, the aligned path
    (64, 56, 296),  # a 7B down_proj (3584 x 18944) scaled down 64x: K is 4.625 blocks
    (16, 128, 462),  # a 72B down_proj (8192 x 29568) scaled down 64x
    (16, 148, 128),  # 72B q|k|v (8192 + 2 x 1024 by 8192) scaled down 64x
])
def test_products_match_bitsandbytes_dequantise_and_matmul(rows, n, k):
    from edgetune.kernels.nf4_matmul import nf4_matmul, nf4_weight

    q, qs, dense = quantised(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(DEV)  # fp32 in, as the CPU's stream
    y = nf4_matmul(x, nf4_weight(q, qs))
    assert y.shape == (rows, n)
    assert_products(y, reference(x, dense), x, dense)


def test_bias_and_lora_epilogue_into_a_column_slice():
    # two weights that read the same X write their columns of one Y, each with its bias and
    # its rows of the packed LoRA (mid = X·Aᵀ once, Bd = scaling * B block-diagonal)
    from edgetune.kernels.nf4_matmul import nf4_matmul, nf4_weight

    g = torch.Generator().manual_seed(3)
    k, rows, r = 128, 5, 8
    parts = [quantised(48, k, seed=1), quantised(24, k, seed=2)]
    x = torch.randn(rows, k, generator=g).to(DEV)
    a = torch.randn(2 * r, k, generator=g).to(DEV) * 0.1
    bd = torch.zeros(72, 2 * r)
    bd[:48, :r] = torch.randn(48, r, generator=g)
    bd[48:, r:] = torch.randn(24, r, generator=g)
    bd = bd.to(DEV)
    bias = torch.randn(72, generator=g).to(torch.bfloat16).to(DEV)
    mid = x @ a.t()
    out = torch.full((rows, 72), float("nan"), dtype=torch.bfloat16, device=DEV)
    col = 0
    for (q, qs, _), n in zip(parts, (48, 24)):
        ret = nf4_matmul(x, nf4_weight(q, qs), bias[col:col + n], mid, bd[col:col + n], out=out, column=col)
        assert ret is out
        col += n
    dense = torch.cat([p[2] for p in parts])
    ref = reference(x, dense, bias, mid, bd)
    assert_products(out, ref, x, dense)
    # the LoRA term really is in there (it moves the outputs far more than a rounding)
    assert (out.double() - reference(x, dense, bias)).abs().max() > 0.1


def test_split_k_sums_in_a_fixed_order():
    from edgetune.kernels.nf4_matmul import nf4_matmul, nf4_weight

    q, qs, dense = quantised(40, 448)
    w = nf4_weight(q, qs)
    x = torch.randn(3, 448, generator=torch.Generator().manual_seed(5)).to(DEV)
    one = nf4_matmul(x, w, split_k=1)
    three = nf4_matmul(x, w, split_k=3)
    assert torch.equal(three, nf4_matmul(x, w, split_k=3))  # deterministic
    assert_products(three, reference(x, dense), x, dense)
    assert_products(one, reference(x, dense), x, dense)


def test_refuses_storage_it_does_not_read():
    import bitsandbytes.functional as bnbF

    from edgetune.kernels.nf4_matmul import nf4_weight

    w = torch.randn(32, 64).to(torch.bfloat16)
    q, qs = bnbF.quantize_4bit(w, quant_type="nf4", compress_statistics=False)
    with pytest.raises(ValueError, match="double-quantised"):
        nf4_weight(q, qs)
    q, qs = bnbF.quantize_4bit(w, quant_type="fp4", compress_statistics=True)
    with pytest.raises(ValueError, match="fp4"):
        nf4_weight(q, qs)
    q, qs = bnbF.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    qs.packing_format_for_cpu = True  # what bitsandbytes' first CPU forward sets when it repacks
    with pytest.raises(ValueError, match="repacked"):
        nf4_weight(q, qs)
