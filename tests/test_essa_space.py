"""ESSA's search space and batched multi-LoRA, on a tiny random Llama (seconds on a CPU)."""

import numpy as np
import pytest
import torch

from edgetune.engine.core.errors import ConfigError

from edgetune.engine.generation.multilora import batched_lora

from edgetune.engine.methods.essa.space import SVDSpace, lora_modules

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_lora_model(r=4, quant=False, seed=0):
    """A 2-layer Llama with a random (non-zero) LoRA on q, k, v, o."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    if quant:
        import bitsandbytes as bnb

        for layer in model.model.layers:
            for name, lin in list(layer.self_attn.named_children()):
                if isinstance(lin, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.float32,
                                          quant_type="nf4")
                    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
                    q = q.to("cpu")
                    setattr(layer.self_attn, name, q)
        model.is_loaded_in_4bit = True  # so PEFT wraps them in its bnb LoRA layer, as on a real NF4 load
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1, generator=g)
    return model.eval()


def test_zero_offsets_reproduce_the_warm_start_exactly():
    model = tiny_lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    space = SVDSpace(model, alpha=1.0)
    assert space.dim == 2 * 4 * 2 * 4  # layers x modules x factors x floor(alpha * r)
    space.write(np.random.default_rng(0).normal(size=space.dim))
    changed = {n for n, p in model.named_parameters() if "lora_" in n and not torch.equal(p, before[n])}
    assert len(changed) == len(before)
    space.write(np.zeros(space.dim))
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, before[n]), n


def test_offsets_move_singular_values():
    """The rebuilt factor is U diag(s + x) Vᵀ: its singular values are the warm start's plus x."""
    model = tiny_lora_model()
    space = SVDSpace(model, alpha=0.5)  # top 2 of 4
    f = space.factors[0]
    x = np.zeros(space.dim)
    x[:f.k] = [0.3, -0.05]
    w = space.factor_weights(x)[0]
    s_full = torch.linalg.svdvals(f.w0.double())
    expected = s_full.clone()
    expected[:2] += torch.tensor([0.3, -0.05], dtype=torch.float64)
    got = torch.linalg.svdvals(w.double())
    assert torch.allclose(got, expected.sort(descending=True).values, atol=1e-5)


def test_stacked_matches_one_by_one():
    model = tiny_lora_model()
    space = SVDSpace(model)
    xs = np.random.default_rng(1).normal(scale=0.2, size=(3, space.dim))
    stacks = space.stacked(xs)
    for k, x in enumerate(xs):
        ws = space.factor_weights(x)
        for j, (a, b) in enumerate(stacks):
            assert torch.allclose(a[k], ws[2 * j], atol=1e-6)
            assert torch.allclose(b[k], ws[2 * j + 1], atol=1e-6)


def test_empty_search_space_is_a_config_error():
    model = tiny_lora_model(r=8)
    with pytest.raises(ConfigError, match="search space is empty"):
        SVDSpace(model, alpha=0.1)
    assert SVDSpace(model, alpha=0.125).dim == 16  # exactly one value per factor


@pytest.mark.parametrize("quant", [False, True], ids=["fp32", "nf4"])
@pytest.mark.parametrize("layout", ["blocks", "shuffled"])
def test_batched_forward_equals_sequential(quant, layout):
    model = tiny_lora_model(quant=quant)
    space = SVDSpace(model)
    K, P, T = 3, 2, 7
    ids = torch.randint(0, 96, (P, T), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    xs = np.random.default_rng(3).normal(scale=0.3, size=(K, space.dim))
    with torch.inference_mode():
        seq = []
        for x in xs:
            space.write(x)
            seq.append(model(input_ids=ids, attention_mask=mask).logits)
        space.restore()
        rows = torch.arange(K).repeat_interleave(P)
        if layout == "shuffled":
            rows = rows[torch.randperm(K * P, generator=torch.Generator().manual_seed(4))]
        # row b shows prompt (b mod P) to candidate rows[b]
        in_rows = torch.arange(K * P) % P
        with batched_lora(space.modules, space.stacked(xs), rows):
            out = model(input_ids=ids[in_rows], attention_mask=mask[in_rows]).logits
    # and the patch is gone afterwards: the weights (warm start) are used again
    with torch.inference_mode():
        plain = model(input_ids=ids, attention_mask=mask).logits
    for b in range(K * P):
        ref = seq[int(rows[b])][int(in_rows[b])]
        assert torch.allclose(out[b], ref, atol=1e-5), b
    assert not torch.allclose(plain, seq[0], atol=1e-3)
    assert all("forward" not in m.__dict__ for _, m in lora_modules(model))


def test_batched_lora_refuses_a_split_batch():
    model = tiny_lora_model()
    space = SVDSpace(model)
    xs = np.zeros((2, space.dim))
    ids = torch.randint(0, 96, (3, 5))
    with torch.inference_mode(), batched_lora(space.modules, space.stacked(xs), torch.tensor([0, 0, 1, 1])):
        with pytest.raises(RuntimeError, match="micro-batches"):
            model(input_ids=ids)


def test_cma_es_finds_a_target_adapter():
    """CMA-ES plus the space's plumbing recover a hidden adapter from its distance alone."""
    from edgetune.engine.core.settings import ESSASettings

    from edgetune.engine.methods.essa.essa import make_es

    model = tiny_lora_model(r=2)
    space = SVDSpace(model, alpha=0.5)  # one value per factor: 32 dimensions
    target_x = np.random.default_rng(5).normal(scale=0.2, size=space.dim)
    target = space.factor_weights(target_x)

    def fitness(x):  # higher is better, as for rewards
        return -sum(float(((w - t) ** 2).sum()) for w, t in zip(space.factor_weights(x), target))

    es = make_es(space.dim, ESSASettings(population=16, sigma0=0.1), seed=0)
    start = fitness(np.zeros(space.dim))
    for _ in range(120):
        xs = es.ask()
        es.tell(xs, [-fitness(x) for x in xs])
    found = es.result.xfavorite
    assert fitness(found) > 1e-4 * start  # start is negative: 10,000x closer
    assert np.abs(found - target_x).max() < 0.02


def test_relative_steps_move_each_singular_value_by_a_share_of_itself():
    """essa.step relative: the first population's offsets spread in proportion to the value
    they move (sigma0 0.2: about 20% of it); absolute: alike for every value."""
    from edgetune.engine.core.settings import ESSASettings

    from edgetune.engine.methods.essa.essa import make_es

    model = tiny_lora_model(r=4)
    space = SVDSpace(model, alpha=1.0)
    values = space.values()
    assert values.shape == (space.dim,) and np.allclose(values, np.concatenate([f.s.numpy() for f in space.factors]))
    with torch.no_grad():  # make the B factors ten times smaller than the A factors, as after a short warm start
        for f in space.factors:
            if f.which == "B":
                f.weight.mul_(0.1)
    space = SVDSpace(model, alpha=1.0)
    values = space.values()
    is_b = np.concatenate([[f.which == "B"] * f.k for f in space.factors])
    assert values[is_b].mean() < 0.2 * values[~is_b].mean()

    def spread(step):
        es = make_es(space.dim, ESSASettings(population=400, sigma0=0.2, step=step), seed=0, values=values)
        return np.std(np.asarray(es.ask()), axis=0)

    rel, ab = spread("relative"), spread("absolute")
    assert np.allclose(rel / values, 0.2, rtol=0.15)  # 400 draws: the sd is known to ~4%
    assert np.allclose(ab, 0.2, rtol=0.15)
    with pytest.raises(ValueError, match="singular values"):
        make_es(space.dim, ESSASettings(step="relative"), seed=0)
    with pytest.raises(ConfigError, match="all 0"):
        make_es(space.dim, ESSASettings(step="relative"), seed=0, values=np.zeros(space.dim))
