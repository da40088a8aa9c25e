"""gradient_checkpointing: auto. The planner checkpoints the fewest decoder layers that fit
the memory budget (engine/planning/planner.checkpoint_split), the engine checkpoints exactly those
(the first ones), and partial checkpointing computes the same loss and gradients as
checkpointing all layers or none."""

import json

import pytest
import torch

from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.settings import LoraSettings, resolve

from edgetune.engine.planning import effective, planner

from edgetune.engine.models import model as model_lib

from edgetune.engine.training.lm_loss import causal_lm_loss

GiB = 1024**3
QWEN7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
              num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
PACKED_7B = ["sft.batch_size=1", "data.max_seq_len=4340", "sft.packing=true"]


@pytest.fixture(scope="module")
def q7b(tmp_path_factory):
    d = tmp_path_factory.mktemp("q7b")
    (d / "config.json").write_text(json.dumps(QWEN7B))
    return str(d)


def total_with(cfg, k: int, device="cuda") -> int:
    """The planner's total with the first k layers checkpointed."""
    ctx, _ = planner.make_ctx(cfg, device, "auto")
    ctx.checkpointing, ctx.ckpt_layers = True, k
    return planner._plan_ctx(cfg, ctx, device, None, [])[0]["total"]


def test_split_is_the_fewest_layers_that_fit_the_budget(q7b):
    chosen = {}
    for budget in (10, 12, 16, 20, 24, 28, 40):
        cfg = resolve(overrides=[f"model.name={q7b}", *PACKED_7B, "model.gradient_checkpointing=auto",
                                 f"model.memory_budget_gib={budget}"])
        split = planner.checkpoint_split(cfg, device="cuda")
        k = split["checkpointed"]
        chosen[budget] = k
        assert split["layers"] == 28 and split["budget"] == budget * GiB
        assert split["planned_total"] == total_with(cfg, k) <= budget * GiB
        if k > 0:
            assert total_with(cfg, k - 1) > budget * GiB, budget  # one layer fewer would not fit
        # the estimate plans the same split and shows it in its notes (the app's estimate panel)
        est = planner.estimate(cfg, device="cuda", detect_gpu=False)
        assert est["model"]["checkpointed_layers"] == k and est["total"] == split["planned_total"]
        assert any(n.startswith(f"gradient checkpointing auto: {k} of 28") or (k == 0 and "none of the 28" in n)
                   for n in est["notes"]), est["notes"]
    ks = [chosen[b] for b in sorted(chosen)]
    assert ks == sorted(ks, reverse=True)  # more memory, fewer recomputed layers
    assert 0 < chosen[12] < 28 and 0 < chosen[24] < chosen[12] and chosen[40] == 0
    # between all-checkpointed and none in memory, as the split says
    cfg = resolve(overrides=[f"model.name={q7b}", *PACKED_7B])
    assert total_with(cfg, 28) < total_with(cfg, chosen[24]) < total_with(cfg, 0)


def test_budget_defaults_to_free_memory_minus_a_margin(q7b):
    cfg = resolve(overrides=[f"model.name={q7b}", *PACKED_7B, "model.gradient_checkpointing=auto"])
    big = planner.checkpoint_split(cfg, device="cuda", gpu_free=140 * GiB)
    assert big["checkpointed"] == 0 and big["budget"] == int(140 * GiB * (1 - effective.BUDGET_MARGIN_SHARE))
    small = planner.checkpoint_split(cfg, device="cuda", gpu_free=20 * GiB)
    assert 0 < small["checkpointed"] < 28 and small["budget"] == 18 * GiB
    # too little memory for any split: everything is checkpointed and the note says it does not fit
    tiny = planner.checkpoint_split(cfg, device="cuda", gpu_free=4 * GiB)
    assert tiny["checkpointed"] == 28 and "exceed" in tiny["note"]
    # true / false are not planned
    for word, k in (("true", 28), ("false", 0)):
        c = resolve(overrides=[f"model.name={q7b}", f"model.gradient_checkpointing={word}"])
        assert planner.checkpoint_split(c, device="cuda", gpu_free=4 * GiB)["checkpointed"] == k


def test_offload_keeps_at_least_one_checkpointed_layer(q7b):
    cfg = resolve(overrides=[f"model.name={q7b}", *PACKED_7B, "model.gradient_checkpointing=auto",
                             "model.offload_activations=true", "model.memory_budget_gib=200"])
    assert planner.checkpoint_split(cfg, device="cuda")["checkpointed"] == 1


def test_bad_values_are_one_line_errors():
    with pytest.raises(ConfigError, match="model.gradient_checkpointing: expected true, false or auto"):
        resolve(overrides=["model.gradient_checkpointing=sometimes"])
    with pytest.raises(ConfigError, match=r"model.memory_budget_gib must be in \[0, 1048576\]"):
        resolve(overrides=["model.memory_budget_gib=-1"])
    assert resolve(overrides=["model.gradient_checkpointing=auto"]).model.gradient_checkpointing == "auto"


# --------------------------------------------------------------------------- engine


def _tiny_lora(checkpointing):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = model_lib.add_lora(LlamaForCausalLM(cfg), LoraSettings(r=4, alpha=8, target_modules="all-linear"),
                               gradient_checkpointing=checkpointing)
    with torch.no_grad():  # a non-zero B, so every LoRA factor gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.train()


def _loss_grads_and_mlp_calls(model):
    layers = model.get_base_model().model.layers
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):  # the MLP is entered again when the backward recomputes its layer
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    loss, _ = causal_lm_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, calls


def test_partial_checkpointing_same_loss_and_grads_and_recomputes_only_the_first_layers():
    ref_loss, ref, calls_all = _loss_grads_and_mlp_calls(_tiny_lora(True))
    assert calls_all == [2, 2, 2, 2]  # forward + recompute in the backward
    for k, expected_calls in ((2, [2, 2, 1, 1]), (False, [1, 1, 1, 1]), (1, [2, 1, 1, 1])):
        model = _tiny_lora(k)
        flags = [layer.gradient_checkpointing for layer in model.get_base_model().model.layers]
        assert sum(flags) == (k or 0) and flags == [i < (k or 0) for i in range(4)]
        loss, got, calls = _loss_grads_and_mlp_calls(model)
        assert calls == expected_calls, k
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert got.keys() == ref.keys() and len(got) == 4 * 7 * 2
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-8, msg=n)


def test_engine_load_checkpoints_the_planned_layers(tiny_model_dir):
    base = [f"model.name={tiny_model_dir}", "model.quant=none", "model.device=cpu", "sft.batch_size=8",
            "data.max_seq_len=512", "lora.r=4"]
    cfg = resolve(overrides=base)
    totals = [total_with(cfg, k, device="cpu") for k in (0, 1, 2)]
    assert totals[2] < totals[1] < totals[0]
    budget = (totals[0] + totals[1]) / 2 / GiB  # room for one layer's activations, not two
    cfg = resolve(overrides=[*base, "model.gradient_checkpointing=auto", f"model.memory_budget_gib={budget}"])
    assert planner.checkpoint_split(cfg, device="cpu")["checkpointed"] == 1
    model, _, _ = model_lib.load(cfg)
    assert [layer.gradient_checkpointing for layer in model.get_base_model().model.layers] == [True, False]
    # what a run records (effective.checkpointed_layers) is what the planner shows
    assert model_lib.checkpointed_layers(model) == 1
    est = planner.estimate(cfg, device="cpu", detect_gpu=False, gpu_free=100 * GiB)  # not a CPU run's budget
    assert est["effective"]["checkpointed_layers"] == est["model"]["checkpointed_layers"] == 1
