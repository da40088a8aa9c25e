"""Rollouts on the embedded SmolLM2-135M on the CPU.

Greedy equality with model.generate is checked on the NF4 model (the one training uses).
Log-prob exactness (1e-4) is checked on plain fp32 weights: bitsandbytes' CPU NF4 matmul
rounds its outputs to bf16, so an incremental decode and a full forward of the same
tokens differ by up to ~0.1 in log-prob there (measured), whatever the decode loop does.
"""

import pytest
import torch

from edgetune.engine.core.settings import LoraSettings, ModelSettings

from edgetune.engine.models.model import add_lora, load_base

from edgetune.engine.generation.decoding import top_p_filter
from edgetune.engine.generation.rollouts import generate, left_pad, render_prompts

PROMPTS = ["What is 3 plus 4?", "Hi", "Name a colour. Answer in one word only please, and be quick about it."]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model, tok, _ = load_base(ModelSettings())
    return model, tok


@pytest.fixture(scope="module")
def fp32():
    model, tok, _ = load_base(ModelSettings(quant="none"))
    return model, tok


@pytest.fixture(scope="module")
def lora(fp32):
    model, tok = fp32
    peft = add_lora(model, LoraSettings(r=4, alpha=8, target_modules="q_proj,v_proj,up_proj"), False)
    g = torch.Generator().manual_seed(0)
    for n, p in peft.named_parameters():
        if "lora_B" in n:  # a fresh adapter is a no-op (B = 0): make it change the outputs
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    yield peft, tok
    peft.unload()  # give the plain base back to tests that run after this one


def hf_greedy(model, tok, prompts, n):
    ids, mask = left_pad(render_prompts(tok, prompts), tok.pad_token_id, "cpu")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n)
    return out[:, ids.shape[1]:]


def recompute_logprobs(model, rb, temperature, top_p=1.0):
    ids = torch.cat([rb.prompt_ids, rb.completion_ids], 1)
    mask = torch.cat([rb.prompt_mask, torch.ones_like(rb.completion_mask)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    P, T = rb.prompt_ids.shape[1], rb.completion_ids.shape[1]
    scaled = logits[:, P - 1:P + T - 1] / temperature
    if top_p < 1:
        scaled = top_p_filter(scaled, top_p)
    lp = torch.log_softmax(scaled, -1).gather(-1, rb.completion_ids[..., None]).squeeze(-1)
    return torch.where(rb.completion_mask.bool(), lp, torch.zeros_like(lp))


def check_masks(rb, eos, pad, max_new):
    for i in range(len(rb.texts)):
        row, m = rb.completion_ids[i].tolist(), rb.completion_mask[i].tolist()
        first = row.index(eos) if eos in row else None
        n = first + 1 if first is not None else len(row)
        assert m == [1] * n + [0] * (len(row) - n)
        assert all(t == pad for t in row[n:])
        assert (rb.logprobs[i, n:] == 0).all()
        assert rb.truncated[i] == (first is None)
        if rb.truncated[i]:
            assert len(row) == max_new


def test_greedy_matches_hf_generate(base):
    model, tok = base
    # 8 tokens: the colour prompt stops at its 7th (EOS), the other two run on (NF4 decodes slower on a CPU)
    rb = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=8)
    ref = hf_greedy(model, tok, PROMPTS, 8)
    T = rb.completion_ids.shape[1]
    assert torch.equal(rb.completion_ids, ref[:, :T])
    assert (ref[:, T:] == tok.pad_token_id).all()  # hf only padded after every row stopped
    assert not all(rb.truncated) and any(rb.truncated)  # the prompts exercise both cases
    check_masks(rb, tok.eos_token_id, tok.pad_token_id, 8)
    assert rb.texts[1] == tok.decode(ref[1], skip_special_tokens=True)


def test_chunks_keep_order_and_results(fp32):
    model, tok = fp32
    seen = []
    b = generate(model, tok, PROMPTS, num_generations=2, greedy=True, max_new_tokens=8, batch_size=4,
                 on_chunk=seen.append)
    assert seen == [[0, 1, 2, 3], [4, 5]]
    assert b.prompt_index == [0, 0, 1, 1, 2, 2]
    # Each chunk equals a separate call on its prompts (compared like for like: the same rows
    # with the same left padding).
    first = generate(model, tok, PROMPTS[:2], num_generations=2, greedy=True, max_new_tokens=8)
    last = generate(model, tok, PROMPTS[2:], num_generations=2, greedy=True, max_new_tokens=8)
    assert b.texts == first.texts + last.texts
    T1, T2 = first.logprobs.shape[1], last.logprobs.shape[1]
    assert torch.equal(b.logprobs[:4, :T1], first.logprobs) and torch.equal(b.logprobs[4:, :T2], last.logprobs)
    assert b.prompt_ids.shape[1] == max(len(r) for r in render_prompts(tok, PROMPTS))


def test_sampling_seeded_and_logprobs_exact(fp32):
    model, tok = fp32
    kw = dict(num_generations=3, max_new_tokens=12, temperature=0.7, seed=123)
    a = generate(model, tok, PROMPTS[:2], **kw)
    b = generate(model, tok, PROMPTS[:2], **kw)
    c = generate(model, tok, PROMPTS[:2], **{**kw, "seed": 124})
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len(set(a.texts[:3])) > 1  # the G samples of one prompt differ
    check_masks(a, tok.eos_token_id, tok.pad_token_id, 12)
    ref = recompute_logprobs(model, a, 0.7)
    assert (a.logprobs <= 0).all()
    assert torch.allclose(a.logprobs, ref, atol=1e-4), (a.logprobs - ref).abs().max()


def test_top_p_logprobs(fp32):
    model, tok = fp32
    a = generate(model, tok, PROMPTS[:2], num_generations=2, max_new_tokens=12, temperature=1.0, top_p=0.8, seed=5)
    ref = recompute_logprobs(model, a, 1.0, top_p=0.8)
    assert torch.allclose(a.logprobs, ref, atol=1e-4)
    full = recompute_logprobs(model, a, 1.0)
    assert (a.logprobs >= full - 1e-5).all() and (a.logprobs > full + 1e-3).any()  # renormalised nucleus


def test_through_lora(lora):
    model, tok = lora
    rb = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=12)
    ref = hf_greedy(model, tok, PROMPTS, 12)
    assert torch.equal(rb.completion_ids, ref[:, :rb.completion_ids.shape[1]])
    with model.disable_adapter():  # the adapter really is live (not a no-op)
        plain = hf_greedy(model, tok, PROMPTS, 12)
    assert not torch.equal(ref, plain)
    s = generate(model, tok, PROMPTS[:2], num_generations=2, max_new_tokens=8, temperature=0.9, seed=1)
    assert torch.allclose(s.logprobs, recompute_logprobs(model, s, 0.9), atol=1e-4)
    model.train()
    generate(model, tok, PROMPTS[:1], greedy=True, max_new_tokens=2)
    assert model.training


def test_token_id_prompts_and_errors(fp32):
    model, tok = fp32
    ids = render_prompts(tok, PROMPTS[:1])
    a = generate(model, tok, ids, greedy=True, max_new_tokens=6)
    b = generate(model, tok, PROMPTS[:1], greedy=True, max_new_tokens=6)
    assert torch.equal(a.completion_ids, b.completion_ids)
    with pytest.raises(ValueError):
        generate(model, tok, PROMPTS[:1], temperature=0.0)
    with pytest.raises(ValueError):
        generate(model, tok, PROMPTS[:1], top_p=0.0)


# --------------------------------------------------------------------------- static loop
# fast=True runs fast_decode's static-cache step eagerly on the CPU (the CUDA graph is a
# capture of this same step), so its arithmetic is checked here against model.generate.


def test_static_loop_greedy_matches_hf(fp32):
    model, tok = fp32
    rb = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=16, fast=True)
    ref = hf_greedy(model, tok, PROMPTS, 16)
    assert torch.equal(rb.completion_ids, ref[:, :rb.completion_ids.shape[1]])
    assert (ref[:, rb.completion_ids.shape[1]:] == tok.pad_token_id).all()
    check_masks(rb, tok.eos_token_id, tok.pad_token_id, 16)


def test_static_loop_sampling_equals_plain_loop(fp32):
    model, tok = fp32
    kw = dict(num_generations=2, max_new_tokens=10, temperature=0.8, top_p=0.95, seed=7)
    a = generate(model, tok, PROMPTS[:2], **kw)
    b = generate(model, tok, PROMPTS[:2], fast=True, **kw)
    assert a.texts == b.texts and torch.equal(a.completion_ids, b.completion_ids)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert torch.allclose(b.logprobs, recompute_logprobs(model, b, 0.8, top_p=0.95), atol=1e-4)


def test_static_loop_through_lora_and_chunks(lora):
    model, tok = lora
    a = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=12)
    seen = []
    b = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=12, fast=True, batch_size=2, on_chunk=seen.append)
    assert seen == [[0, 1], [2]]
    assert a.texts == b.texts


def test_packed_step_through_lora(lora):
    # bf16_weights=True on a plain fp32 model packs fp32 copies (q|k|v, gate|up, stacked
    # LoRA factors): the packed step must reproduce the module path's tokens and log-probs.
    from edgetune.engine.generation.multilora import batched_lora

    model, tok = lora
    kw = dict(num_generations=2, max_new_tokens=10, temperature=0.9, seed=11)
    a = generate(model, tok, PROMPTS[:2], **kw)
    b = generate(model, tok, PROMPTS[:2], fast=True, bf16_weights=True, **kw)
    assert b.info["packed"] is True
    assert a.texts == b.texts and torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
    # ESSA's batched candidates (per-row LoRA in candidate-major blocks) are packed as
    # stacked factors; any other row order is not packed over (module path instead)
    mods = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    stacks = [(m.lora_A["default"].weight[None], m.lora_B["default"].weight[None]) for _, m in mods]
    want = generate(model, tok, PROMPTS[:1], num_generations=2, greedy=True, max_new_tokens=4).texts
    with batched_lora(mods, stacks, [0] * 2):
        c = generate(model, tok, PROMPTS[:1], num_generations=2, greedy=True, max_new_tokens=4, fast=True,
                     bf16_weights=True)
    assert c.info["packed"] is True and c.texts == want
    stacks2 = [(torch.stack([a[0], a[0]]), torch.stack([b[0], b[0]])) for a, b in stacks]
    with batched_lora(mods, stacks2, [1, 0]):
        d = generate(model, tok, PROMPTS[:1], num_generations=2, greedy=True, max_new_tokens=4, fast=True,
                     bf16_weights=True)
    assert str(d.info["packed"]).startswith("no") and d.texts == want


def test_the_cpu_decodes_an_nf4_base_over_its_fp32_copy(base, monkeypatch):
    """On the CPU an NF4 base decodes through the static loop over an fp32 copy of its
    weights (kept for the next call) when the host's memory holds it, with the plain
    loop's greedy tokens; without the memory, the plain loop."""
    from edgetune.engine.generation import fast_decode as fd

    model, tok = base
    plain = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=8, fast=False)
    rb = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=8)
    assert rb.info["fast"] is True and rb.info["packed"] is True and rb.info["bf16_weights"] is True
    assert torch.equal(rb.completion_ids, plain.completion_ids)
    assert torch.allclose(rb.logprobs, plain.logprobs, atol=5e-2)
    layer = fd.inner_model(model).model.layers[0]
    w = fd._HOST_COPIES[layer.self_attn.q_proj][1]
    assert w.dtype == torch.float32 and w.shape[0] == sum(m.out_features for m in fd._base_linears(model)[:3])
    assert generate(model, tok, PROMPTS[:1], greedy=True, max_new_tokens=2).info["fast"] is True
    assert fd._HOST_COPIES[layer.self_attn.q_proj][1] is w  # the copy is reused, not made again
    monkeypatch.setattr(fd, "host_available", lambda: fd.host_copy_bytes(model))
    assert generate(model, tok, PROMPTS[:1], greedy=True, max_new_tokens=2).info == {"fast": False}


def test_model_generate_runs_over_the_host_copy_inside_and_on_the_nf4_layers_after(base, monkeypatch):
    """Chat's model.generate inside over_host_copy: the NF4 layers compute over the fp32
    copy (bitsandbytes' forward not called), with the same greedy tokens; after it, their
    own forward again."""
    import bitsandbytes as bnb

    from edgetune.engine.generation.fast_decode import over_host_copy

    model, tok = base
    ref = hf_greedy(model, tok, PROMPTS, 6)
    calls = []
    forward = bnb.nn.Linear4bit.forward
    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    with over_host_copy(model) as on:
        assert on is True
        copied = hf_greedy(model, tok, PROMPTS, 6)
    assert not calls and torch.equal(copied, ref)
    hf_greedy(model, tok, PROMPTS[:1], 1)
    assert calls  # the layers' own forward is back


def test_a_fresh_lora_beside_a_trained_whole_module_decodes_with_that_module():
    """An adapter whose LoRA factors add nothing yet (B = 0) but which trains a whole module
    (modules_to_save) changes the outputs: the CPU's decode over the fp32 copy keeps that
    module's trained copy in the prefill too, with the plain loop's greedy tokens."""
    from peft import LoraConfig, get_peft_model

    model, tok, _ = load_base(ModelSettings())
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=["norm"]))
    trained = next(m for n, m in peft.named_modules() if n.endswith("model.norm.modules_to_save.default"))
    with torch.no_grad():
        trained.weight.mul_(torch.linspace(0.2, 3.0, trained.weight.numel()))
    plain = generate(peft, tok, PROMPTS, greedy=True, max_new_tokens=6, fast=False)
    with peft.disable_adapter():
        without = generate(peft, tok, PROMPTS, greedy=True, max_new_tokens=6, fast=False)
    assert not torch.equal(plain.completion_ids, without.completion_ids)  # the trained norm matters
    rb = generate(peft, tok, PROMPTS, greedy=True, max_new_tokens=6)
    assert rb.info["fast"] is True and rb.info["packed"] is True
    assert torch.equal(rb.completion_ids, plain.completion_ids)
