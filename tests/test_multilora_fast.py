"""K ESSA candidates in one fast-loop generate call (engine/generation/fast_decode.py with
engine/generation/multilora.py): the same tokens and log-probs as each candidate decoded alone, on
the module path and on the packed step, and the same ESSA fitness as sequential
evaluation. Tiny random Llama / Qwen2 in fp32 on the CPU (the fast step runs eagerly)."""

import numpy as np
import pytest
import torch

from edgetune.engine.core.settings import ESSASettings

from edgetune.engine.generation.multilora import batched_lora
from edgetune.engine.generation.rollouts import generate

from edgetune.engine.methods.essa.population import Evaluator
from edgetune.engine.methods.essa.space import SVDSpace

K, P, NEW = 3, 2, 8


class IdTokenizer:
    """Token-id prompts in, ids out as text; EOS 1 (a real id: rows may stop early)."""

    eos_token_id = 1
    pad_token_id = 0
    chat_template = None

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(str(t) for t in r) for r in rows]


def tiny_model(kind: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    arch = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                bos_token_id=2, eos_token_id=1, pad_token_id=0)
    cfg = LlamaConfig(**arch) if kind == "llama" else Qwen2Config(**arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # every projection: the q|k|v and gate|up packs then stack several candidates' factors
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:  # non-zero B: a warm start whose singular values matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    model = tiny_model(request.param)
    space = SVDSpace(model)
    xs = np.random.default_rng(0).normal(scale=1.5, size=(K, space.dim))
    prompts = torch.randint(3, 96, (P, 5), generator=torch.Generator().manual_seed(2)).tolist()
    prompts[1] = prompts[1][:3]  # unequal lengths: left padding in the batch
    yield model, space, xs, prompts
    space.restore()


@pytest.mark.parametrize("packed", [False, True])
def test_batched_fast_loop_equals_each_candidate_alone(setup, packed):
    model, space, xs, prompts = setup
    tok = IdTokenizer()
    kw = dict(max_new_tokens=NEW, greedy=True, fast=True, bf16_weights=packed)
    with torch.inference_mode():
        alone = []
        for x in xs:
            space.write(x)
            alone.append(generate(model, tok, prompts, **kw))
        space.restore()
        rows = torch.arange(K).repeat_interleave(P)
        with batched_lora(space.modules, space.stacked(xs), rows):
            got = generate(model, tok, prompts * K, **kw)
    assert got.info["fast"] is True and got.info["packed"] is packed
    T = got.completion_ids.shape[1]
    for j, ref in enumerate(alone):
        blk = slice(j * P, (j + 1) * P)
        assert got.texts[blk] == ref.texts
        t = ref.completion_ids.shape[1]
        assert torch.equal(got.completion_ids[blk, :t], ref.completion_ids)
        assert (got.completion_ids[blk, t:] == tok.pad_token_id).all() and T >= t
        assert torch.allclose(got.logprobs[blk, :t], ref.logprobs, atol=1e-5)
    assert len({tuple(r.texts) for r in alone}) == K  # the candidates really decode differently


def test_batched_fast_loop_logits_match_plain_loop(setup):
    # the packed per-row step against the plain HF loop (model forward with the patched
    # per-row LoRA layers): sampled tokens and their log-probs, not only greedy argmaxes
    model, space, xs, prompts = setup
    tok = IdTokenizer()
    kw = dict(max_new_tokens=NEW, temperature=0.9, seed=5)
    with torch.inference_mode(), batched_lora(space.modules, space.stacked(xs), torch.arange(K).repeat_interleave(P)):
        a = generate(model, tok, prompts * K, fast=False, **kw)
        b = generate(model, tok, prompts * K, fast=True, bf16_weights=True, **kw)
    assert b.info["packed"] is True
    assert a.texts == b.texts and torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def id_reward(completions, rows, truncated=None):
    """Depends on every generated id, so equal fitness ~ equal text."""
    return [sum(int(t) % 7 for t in c.split()) / (7 * max(1, len(c.split()))) for c in completions], \
        [None] * len(completions)


def test_essa_batched_fitness_on_the_fast_loop_equals_sequential(setup):
    model, space, xs, prompts = setup
    rows = [{"prompt": p, "answer": ""} for p in prompts]
    s = ESSASettings(population=K, max_new_tokens=NEW, greedy=True, prompts_per_generation=P)
    sb = ESSASettings(**{**s.__dict__, "evaluation": "batched"})
    seq = Evaluator(model, IdTokenizer(), space, id_reward, s, fast=False).population(xs, rows)
    # chunks of 2 + 1 candidates: two generate calls, two shapes of the per-row step
    got = Evaluator(model, IdTokenizer(), space, id_reward, sb, candidates_per_batch=2,
                         fast=True).population(xs, rows)
    assert got == seq
    assert len(set(seq)) > 1


def nf4_candidates_alone_and_batched(**kw):
    """Two ESSA candidates on the tiny NF4 model, each decoded alone and then both as
    candidate-major blocks of one batch, through the fast loop with `kw`'s base path."""
    from test_fast_decode import PROMPTS as NF4_PROMPTS
    from test_fast_decode import IdTokenizer as NF4Tokenizer
    from test_fast_decode import tiny_nf4_model

    model = tiny_nf4_model()
    prompts = NF4_PROMPTS[:2]
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompts[0]]))  # bitsandbytes repacks its CPU weights on the first forward
        space = SVDSpace(model)
        xs = np.random.default_rng(3).normal(scale=1.5, size=(2, space.dim))
        kw = dict(max_new_tokens=3, greedy=True, fast=True, **kw)
        alone = []
        for x in xs:
            space.write(x)
            alone.append(generate(model, NF4Tokenizer(), prompts, **kw))
        space.restore()
        with batched_lora(space.modules, space.stacked(xs), torch.arange(2).repeat_interleave(2)):
            got = generate(model, NF4Tokenizer(), prompts * 2, **kw)
    return alone, got


def assert_blocks_equal_alone(alone, got):
    for j, ref in enumerate(alone):
        t = ref.completion_ids.shape[1]
        assert torch.equal(got.completion_ids[2 * j:2 * j + 2, :t], ref.completion_ids)
        # bf16 products of the copy: the LoRA sums' order may move a rounding
        assert torch.allclose(got.logprobs[2 * j:2 * j + 2, :t], ref.logprobs, atol=5e-2)
    assert alone[0].texts != alone[1].texts


def test_batched_candidates_through_a_mixed_copy():
    # the first layer from the bf16 copy, the second through bitsandbytes in packs, the
    # candidates' stacked factors in both: each block equals its candidate decoded alone
    alone, got = nf4_candidates_alone_and_batched(dense_layers=1)
    assert got.info["dense_layers"] == 1 and got.info["packed"] is True
    assert_blocks_equal_alone(alone, got)

