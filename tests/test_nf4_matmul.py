"""The fused NF4 dequantise-and-matmul kernel (kernels/nf4_matmul.py) on the CPU under
TRITON_INTERPRET=1: its dequantised weights equal bitsandbytes' bit for bit, its products
equal the bf16 reference within one bf16 rounding, and the fast rollout loop gives the
same greedy tokens through it as through bitsandbytes' own layers."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from edgetune.kernels import nf4_matmul as K  # noqa: E402

torch.set_num_threads(1)


def quantized(N, Kd, nested, seed=0, scale=1.0):
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(N, Kd, generator=g) * scale).to(torch.bfloat16)
    q, qs = F.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=nested)
    return q, qs


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quant"])
def test_dequantised_weights_equal_bitsandbytes(nested):
    import bitsandbytes.functional as F

    q, qs = quantized(96, 128, nested, scale=3.0)
    ref = F.dequantize_4bit(q, qs).to(torch.bfloat16)  # what the bf16 copy holds
    w = K.prepare(q, qs)
    assert w.absmax.shape == (96, 2) and w.packed.shape == (96, 64)
    assert torch.equal(K.dequantize_ref(w), ref)
    assert torch.equal(K.dequantize(w), ref)  # the kernel's in-register weights (select tree)
    assert set((q.view(torch.uint8) >> 4).unique().tolist()) == set(range(16))  # every code seen


def close_to_reference(y, x, w, bias=None):
    """|y - fp32 reference| within one bf16 rounding of the result (plus a hair for the
    summation order)."""
    exact = x.to(torch.bfloat16).float() @ K.dequantize_ref(w).float().t()
    if bias is not None:
        exact = exact + bias.float()
    err = (y.float() - exact).abs()
    return bool((err <= exact.abs() * 2**-8 + 1e-3).all()), float(err.max())


@pytest.mark.parametrize("M,N,Kd,split,bias,bk", [(4, 96, 128, 1, False, 64), (4, 96, 128, 2, True, 128),
                                                   (20, 80, 192, 2, False, 64), (40, 48, 64, 1, True, 64),
                                                   (20, 80, 192, 1, True, 128), (70, 48, 128, 2, False, 64)])
def test_linear_matches_reference(M, N, Kd, split, bias, bk):
    # BLOCK_K 64 = one scale per row and step; 128 reads a scale per weight (and a ragged
    # last step when K = 192)
    q, qs = quantized(N, Kd, nested=True, seed=M)
    w = K.prepare(q, qs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, Kd, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    y = K.linear(x, w, b, config=(32, bk, split, 4, 1))
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    ok, err = close_to_reference(y, x, w, b)
    assert ok, err
    # and the torch reference (bitsandbytes' weights, fp32 accumulation, one rounding)
    assert torch.allclose(y.float(), K.linear_ref(x, w, b).float(), rtol=2**-7, atol=1e-3)


def test_column_slices_of_one_output():
    # q|k|v style: three weights written into column slices of one [M, sum N] output
    from edgetune.engine.fast_decode import NF4Pack

    ws = [K.prepare(*quantized(n, 64, nested=False, seed=n)) for n in (64, 32, 32)]
    x = torch.randn(3, 64)
    bias = torch.randn(128).to(torch.bfloat16)
    y = NF4Pack(ws).linear(x, bias)
    off = 0
    for w in ws:
        n = w.shape[0]
        ok, err = close_to_reference(y[:, off:off + n], x, w, bias[off:off + n])
        assert ok, err
        off += n


def tiny_nf4_model():
    """A 2-layer Qwen2 (q/k/v biases) with every projection in bitsandbytes NF4 (bf16
    compute, double-quantised absmax) and a random LoRA on all of them."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if isinstance(lin, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                          compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
                    q.weight = bnb.nn.Params4bit(lin.weight.data * 4, requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                    if lin.bias is not None:
                        q.bias = torch.nn.Parameter(torch.randn_like(lin.bias.data) * 0.5, requires_grad=False)
                    setattr(parent, name, q.to("cpu"))
    model.is_loaded_in_4bit = True  # PEFT wraps the layers in its bnb LoRA layer, as on a real NF4 load
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=g)
        # a random init's next-token distribution is nearly flat (top-2 gaps of 1e-3 in
        # log-prob): sharpen it so that greedy tokens test the arithmetic, not rounding ties
        model.get_base_model().lm_head.weight.mul_(30)
    return model.eval()


class IdTokenizer:
    eos_token_id, pad_token_id = 2, 0

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


PROMPTS = [[17, 9, 31, 7, 64], [11, 3, 40], [60, 61, 5, 8, 90, 33]]


@pytest.fixture(scope="module")
def nf4_model():
    model = tiny_nf4_model()
    # bitsandbytes' CPU kernel repacks each layer on its first forward, keeping a bf16 copy
    # of absmax: after one forward both paths read those same (repacked) weights.
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPTS[0]]))
    return model


def greedy(model, nf4_kernel, n=5):
    from edgetune.engine.rollouts import generate

    return generate(model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=n, fast=True, nf4_kernel=nf4_kernel)


def test_fast_loop_greedy_tokens_through_the_kernel(nf4_model):
    ref = greedy(nf4_model, False)
    assert ref.info["nf4_kernel"] is False
    ours = greedy(nf4_model, True)
    assert ours.info["nf4_kernel"] is True and ours.info["packed"] is True
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    # bf16 products either way; bitsandbytes' CPU matmul rounds differently (~0.02 here)
    assert torch.allclose(ours.logprobs, ref.logprobs, atol=5e-2)


@pytest.mark.slow
def test_unpacked_layers_through_the_kernel(nf4_model, monkeypatch):
    # a layout that cannot be packed: the kernel is swapped into the Linear4bit layers
    # (prefill too, below NF4_KERNEL_MAX_ROWS rows: slow in the interpreter)
    from edgetune.engine import fast_decode

    def no_pack(core, nf4=False):
        raise ValueError("not packable")

    ref = greedy(nf4_model, False, n=3)
    monkeypatch.setattr(fast_decode, "pack_model", no_pack)
    swapped = greedy(nf4_model, True, n=3)
    assert swapped.info["nf4_kernel"] is True and swapped.info["packed"] == "no: not packable"
    assert torch.equal(swapped.completion_ids, ref.completion_ids)
    assert torch.allclose(swapped.logprobs, ref.logprobs, atol=5e-2)


def test_base_path_choice(nf4_model):
    from edgetune.engine.fast_decode import base_path

    model = nf4_model
    cpu = torch.device("cpu")
    assert base_path(model, cpu, None, None, 0) == "module"  # the kernel only when asked
    # on CUDA without the bf16 copy, bitsandbytes unless the kernel is asked for (measured faster)
    assert base_path(model, torch.device("cuda"), False, None, 0) == "module"
    assert base_path(model, cpu, None, True, 0) == "nf4_kernel"
    assert base_path(model, cpu, True, True, 0) == "nf4_kernel"  # no bf16 copy of NF4 on the CPU
    assert base_path(model, cpu, False, False, 0) == "module"


def greedy_mixed(model, dense_layers, n=5):
    from edgetune.engine.rollouts import generate

    return generate(model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=n, fast=True,
                    dense_layers=dense_layers)


def test_mixed_copy_gives_the_module_paths_tokens(nf4_model):
    # the bf16 copy for the first layers only, the rest through bitsandbytes in packs
    ref = greedy(nf4_model, False)
    none = greedy_mixed(nf4_model, 0)  # every pack calls its Linear4bit layers: the same products
    assert none.info["packed"] is True and none.info["dense_layers"] == 0
    assert torch.equal(none.completion_ids, ref.completion_ids) and torch.equal(none.logprobs, ref.logprobs)
    half = greedy_mixed(nf4_model, 1)
    assert half.info["dense_layers"] == 1 and half.info["bf16_weights"] is True
    assert torch.equal(half.completion_ids, ref.completion_ids)
    # layer 0 in cuBLAS-style bf16 products, bitsandbytes' CPU matmul rounds differently
    assert torch.allclose(half.logprobs, ref.logprobs, atol=5e-2)
    assert not torch.equal(half.logprobs, ref.logprobs)  # layer 0 really took the copy


def test_base_path_turns_spare_memory_into_copied_layers(nf4_model, monkeypatch):
    from edgetune.engine import fast_decode as fd

    per_layer = fd.layer_copy_bytes(nf4_model)
    assert len(per_layer) == 2 and per_layer[0] == per_layer[1] > 0
    margin, reserve, cuda = 2 << 30, 1000, torch.device("cuda")

    def free(b, frac=1.0, reserved=0):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (b, 8 << 30))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: frac)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: reserved)

    free(margin + reserve + per_layer[0] * 3 // 2)  # one layer's copy fits, not two
    assert fd.dense_layers_that_fit(nf4_model, reserve) == 1
    assert fd.base_path(nf4_model, cuda, None, None, reserve) == "mixed"
    assert fd.base_path(nf4_model, cuda, False, None, reserve) == "module"  # no copy when told so
    free(margin + reserve + sum(per_layer) + 4096)  # lm_head etc. are not NF4 here: all fits
    assert fd.base_path(nf4_model, cuda, None, None, reserve) == "dense"
    # ... unless the run's memory budget (model.memory_budget_gib) holds one layer only
    one = margin + reserve + per_layer[0] * 3 // 2
    assert fd.base_path(nf4_model, cuda, None, None, reserve, memory_budget=one) == "mixed"
    assert fd.dense_layers_that_fit(nf4_model, reserve, memory_budget=one) == 1
    # the card has room for all, but the process is held to 5 GiB with 3 GiB taken: one layer
    free(6 << 30, frac=5 / 8, reserved=(3 << 30) - reserve - per_layer[0] * 3 // 2)
    assert fd.dense_layers_that_fit(nf4_model, reserve) == 1
    free(margin + reserve + per_layer[0] // 2)  # not one layer
    assert fd.dense_layers_that_fit(nf4_model, reserve) == 0
    assert fd.base_path(nf4_model, cuda, None, None, reserve) == "module"
    # asked for a split: mixed below the layer count, dense at it
    assert fd.base_path(nf4_model, torch.device("cpu"), None, None, 0, dense_layers=1) == "mixed"
    assert fd.base_path(nf4_model, torch.device("cpu"), None, None, 0, dense_layers=2) == "dense"
    assert fd.base_path(nf4_model, torch.device("cpu"), False, None, 0, dense_layers=1) == "module"


def test_generate_reserves_the_prefill_and_passes_the_budget(nf4_model, monkeypatch):
    from edgetune.engine import fast_decode as fd

    seen = {}
    real = fd.Decoder.for_model

    def spy(model, **kw):
        seen.update(kw)
        return real(model, **kw)

    monkeypatch.setattr(fd.Decoder, "for_model", spy)
    from edgetune.engine.rollouts import generate

    generate(nf4_model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=2, fast=True, memory_budget=123)
    rows, longest = len(PROMPTS), max(map(len, PROMPTS))
    assert seen["memory_budget"] == 123
    assert seen["reserve_bytes"] == fd.kv_bytes(nf4_model, rows, longest + 2 + 64) + fd.prefill_bytes(nf4_model, rows, longest)
    assert fd.prefill_bytes(nf4_model, 2 * rows, longest) == 2 * fd.prefill_bytes(nf4_model, rows, longest)
