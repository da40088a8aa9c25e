"""The fast rollout loop (engine/generation/fast_decode.py) on a tiny NF4 model on the CPU: which
base path it takes for the memory free, the bf16 copy of some layers giving the tokens of
bitsandbytes' own layers, and the memory it reserves for a decode being the planner's."""

import pytest
import torch

torch.set_num_threads(1)


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
    # of absmax: after one forward every path reads those same (repacked) weights.
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPTS[0]]))
    return model


def greedy(model, n=5):
    from edgetune.engine.generation.rollouts import generate

    return generate(model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=n, fast=True, bf16_weights=False)


def test_base_path_choice(nf4_model, monkeypatch):
    from edgetune.engine.generation import fast_decode as fd
    from edgetune.engine.generation.fast_decode import base_path

    cpu = torch.device("cpu")
    # the CPU: an fp32 copy when the host's available memory holds it twice over
    assert base_path(nf4_model, cpu, None, 0) == "dense" and base_path(nf4_model, cpu, True, 0) == "dense"
    assert base_path(nf4_model, cpu, False, 0) == "module"
    # the NF4 kernel asked for (tests, benches; CUDA's kernel, off on the CPU by default): no copy
    assert base_path(nf4_model, cpu, None, 0, nf4_kernel="on", rows=4) == "kernel"
    monkeypatch.setattr(fd, "host_available", lambda: 2 * fd.host_copy_bytes(nf4_model) - 1)
    assert base_path(nf4_model, cpu, None, 0) == "module"
    monkeypatch.undo()
    # on CUDA without the bf16 copy: bitsandbytes
    assert base_path(nf4_model, torch.device("cuda"), False, 0) == "module"


def greedy_mixed(model, dense_layers, n=5):
    from edgetune.engine.generation.rollouts import generate

    return generate(model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=n, fast=True,
                    dense_layers=dense_layers)


def linear4bit_calls(model, monkeypatch) -> dict:
    """How often each layer's Linear4bit layers run from now on, by layer index (counted in
    the class's forward: a hook on the layer would turn the fast loop's packing off)."""
    import bitsandbytes as bnb

    layer_of = {id(m): i for i, layer in enumerate(model.get_base_model().model.layers) for m in layer.modules()}
    calls: dict = {}
    forward = bnb.nn.Linear4bit.forward

    def counted(self, *args, **kwargs):
        calls[layer_of[id(self)]] = calls.get(layer_of[id(self)], 0) + 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", counted)
    return calls


def test_mixed_copy_gives_the_module_paths_tokens(nf4_model, monkeypatch):
    # the bf16 copy for the first layers only, the rest through bitsandbytes in packs
    ref = greedy(nf4_model)
    none = greedy_mixed(nf4_model, 0)  # every pack calls its Linear4bit layers: the same products
    assert none.info["packed"] is True and none.info["dense_layers"] == 0
    assert torch.equal(none.completion_ids, ref.completion_ids) and torch.equal(none.logprobs, ref.logprobs)
    calls = linear4bit_calls(nf4_model, monkeypatch)
    half = greedy_mixed(nf4_model, 1)
    assert half.info["dense_layers"] == 1 and half.info["bf16_weights"] is True
    assert torch.equal(half.completion_ids, ref.completion_ids)
    # layer 0 in bf16 products of its copy; bitsandbytes' CPU matmul may round differently
    assert torch.allclose(half.logprobs, ref.logprobs, atol=5e-2)
    # layer 0 really took the copy: its Linear4bit layers ran for the prompt only (once
    # each), layer 1's at every decode step too. (Whether the two paths' logprobs differ in
    # the last bit depends on the CPU's bf16 matmul, so that is no evidence either way.)
    import bitsandbytes as bnb

    n = sum(isinstance(m, bnb.nn.Linear4bit) for m in nf4_model.get_base_model().model.layers[0].modules())
    assert n == 7 and calls == {0: n, 1: n * 5}  # 5 new tokens: the prompt, then 4 decode steps


def test_base_path_turns_spare_memory_into_copied_layers(nf4_model, monkeypatch):
    from edgetune.engine.generation import fast_decode as fd

    per_layer = fd.layer_copy_bytes(nf4_model)
    assert len(per_layer) == 2 and per_layer[0] == per_layer[1] > 0
    margin, reserve, cuda = 2 << 30, 1000, torch.device("cuda")

    def free(b, frac=1.0, reserved=0):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (b, 8 << 30))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: frac)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: reserved)

    free(margin + reserve + per_layer[0] * 3 // 2)  # one layer's copy fits, not two
    assert fd.dense_layers_that_fit(nf4_model, reserve) == 1
    assert fd.base_path(nf4_model, cuda, None, reserve) == "mixed"
    assert fd.base_path(nf4_model, cuda, False, reserve) == "module"  # no copy when told so
    free(margin + reserve + sum(per_layer) + 4096)  # lm_head etc. are not NF4 here: all fits
    assert fd.base_path(nf4_model, cuda, None, reserve) == "dense"
    # ... unless the run's memory budget (model.memory_budget_gib) holds one layer only
    one = margin + reserve + per_layer[0] * 3 // 2
    assert fd.base_path(nf4_model, cuda, None, reserve, memory_budget=one) == "mixed"
    assert fd.dense_layers_that_fit(nf4_model, reserve, memory_budget=one) == 1
    # the card has room for all, but the process is held to 5 GiB with 3 GiB taken: one layer
    free(6 << 30, frac=5 / 8, reserved=(3 << 30) - reserve - per_layer[0] * 3 // 2)
    assert fd.dense_layers_that_fit(nf4_model, reserve) == 1
    free(margin + reserve + per_layer[0] // 2)  # not one layer
    assert fd.dense_layers_that_fit(nf4_model, reserve) == 0
    assert fd.base_path(nf4_model, cuda, None, reserve) == "module"
    # asked for a split: mixed below the layer count, dense at it
    assert fd.base_path(nf4_model, torch.device("cpu"), None, 0, dense_layers=1) == "mixed"
    assert fd.base_path(nf4_model, torch.device("cpu"), None, 0, dense_layers=2) == "dense"
    assert fd.base_path(nf4_model, torch.device("cpu"), False, 0, dense_layers=1) == "module"


def test_generate_reserves_the_planners_decode_memory_and_passes_the_budget(nf4_model, monkeypatch):
    from edgetune.engine.core.arch import arch_of

    from edgetune.engine.planning import planner

    from edgetune.engine.generation import fast_decode as fd

    seen, buffers = {}, []
    real, real_buffers = fd.Decoder.for_model, fd.Decoder._buffers

    def spy(model, **kw):
        seen.update(kw)
        return real(model, **kw)

    def spy_buffers(self, B, L, dtype):
        st = real_buffers(self, B, L, dtype)
        buffers.append(sum(t.nbytes for t in st["k"] + st["v"]))
        return st

    monkeypatch.setattr(fd.Decoder, "for_model", spy)
    monkeypatch.setattr(fd.Decoder, "_buffers", spy_buffers)
    from edgetune.engine.generation.rollouts import generate

    generate(nf4_model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=2, fast=True, memory_budget=123)
    rows, longest = len(PROMPTS), max(map(len, PROMPTS))
    assert seen["memory_budget"] == 123
    # the planner's formulas (an F-GRPO plan adds up the same two), for this model's shape
    # and its fp32 residual stream on the CPU
    ctx = planner.decode_ctx(arch_of(nf4_model), "nf4", 4)
    kv = planner.kv_cache_bytes(ctx, rows, longest + 2 + 64)
    assert seen["reserve_bytes"] == kv + planner.prefill_bytes(ctx, rows, longest)
    # and the static cache the loop then allocates fits in what was reserved for it
    assert len(buffers) == 1 and 0 < buffers[0] <= kv


def fresh_nf4_model():
    """tiny_nf4_model with the storage Linear4bit keeps on CUDA: bitsandbytes' CPU forward
    is told not to repack it for its AVX-512 kernel, so its module path reads the same
    packed codes and double-quantised absmax as the NF4 kernel (and as on a GPU)."""
    from edgetune.engine.generation.fast_decode import linear4bit_modules

    model = tiny_nf4_model()
    for m in linear4bit_modules(model):
        m.support_avx512bf16_for_cpu = False
    return model


def test_nf4_kernel_gives_the_module_paths_tokens():
    from edgetune.engine.generation.rollouts import generate

    model = fresh_nf4_model()
    ref = greedy(model)
    got = generate(model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=5, fast=True, nf4_kernel="on")
    assert got.info["nf4_kernel"] is True and got.info["packed"] is True and got.info["dense_layers"] == 0
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False)
                   for m in model.modules() if type(m).__name__ == "Linear4bit")
    assert torch.equal(got.completion_ids, ref.completion_ids)
    # the same products but for rounding: the kernel adds LoRA before its one bf16 rounding
    assert torch.allclose(got.logprobs, ref.logprobs, atol=5e-2)
    # a copy of layer 0, layer 1 through the kernel: the same tokens
    mixed = generate(model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=3, fast=True, nf4_kernel="on",
                     dense_layers=1)
    assert mixed.info["nf4_kernel"] is True and mixed.info["dense_layers"] == 1
    assert torch.equal(mixed.completion_ids, ref.completion_ids[:, :3])


def test_nf4_kernel_refuses_weights_repacked_for_the_cpu(nf4_model):
    # after bitsandbytes' CPU forward repacked them (the module fixture), the kernel's layout
    # is gone: the decode says so and runs bitsandbytes' own layers
    from edgetune.engine.generation.rollouts import generate

    got = generate(nf4_model, IdTokenizer(), PROMPTS, greedy=True, max_new_tokens=3, fast=True, nf4_kernel="on")
    assert got.info["nf4_kernel"] is False and "repacked" in got.info["packed"]
    assert torch.equal(got.completion_ids, greedy(nf4_model, n=3).completion_ids)


def test_base_path_with_the_nf4_kernel(nf4_model, monkeypatch):
    from edgetune.engine.planning import effective

    from edgetune.engine.generation import fast_decode as fd

    per_layer = fd.layer_copy_bytes(nf4_model)
    cuda, reserve = torch.device("cuda"), 1000
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: 1.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)

    def free(b):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (b, 8 << 30))

    one = (2 << 30) + reserve + per_layer[0] * 3 // 2  # room for one layer's copy
    free(one)
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="off", rows=64) == "mixed"
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="on", rows=64) == "kernel"  # no copy
    # auto (measured faster than bitsandbytes on a GPU): the kernel instead of bitsandbytes, a
    # copy only where it fits and is faster; before that measurement, bitsandbytes and the copy
    assert effective.NF4_KERNEL_AUTO
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="auto", rows=64) == "mixed_kernel"
    monkeypatch.setattr(effective, "NF4_KERNEL_AUTO", False)
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="auto", rows=64) == "mixed"
    monkeypatch.setattr(effective, "NF4_KERNEL_AUTO", True)
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="auto", rows=256) == "mixed"  # past its tiles
    monkeypatch.setattr(effective, "COPY_OVER_KERNEL_FROM_ROWS", 32)
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="auto", rows=16) == "kernel"
    free(one + sum(per_layer))
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="auto", rows=64) == "dense"
    free(1 << 20)  # no copy fits
    assert fd.base_path(nf4_model, cuda, None, reserve, nf4_kernel="auto", rows=64) == "kernel"
    assert fd.base_path(nf4_model, cuda, False, reserve, nf4_kernel="off", rows=64) == "module"
    # the setting reaches rollouts on CUDA only (a GPU kernel)
    assert effective.rollout_nf4_kernel("on", "cpu") == "off" and effective.rollout_nf4_kernel("on", "cuda:0") == "on"
