"""Activation offload (engine/models/offload.py): the offloading checkpoint gives the same loss
and LoRA gradients as transformers' own gradient checkpointing, dropout included."""

import pytest
import torch

from edgetune.engine.models import offload

from edgetune.engine.training.lm_loss import causal_lm_loss


def _lora_model(dropout):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    base = LlamaForCausalLM(cfg)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
    with torch.no_grad():  # a non-zero B, so every LoRA factor gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.train()


def _grads(model, batch, seed=5):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss, _ = causal_lm_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_offloaded_checkpoint_matches_plain_checkpointing(dropout, monkeypatch):
    model = _lora_model(dropout)
    saved = []
    real_save = offload.HostStash.save
    monkeypatch.setattr(offload.HostStash, "save", lambda self, t: saved.append(t.shape) or real_save(self, t))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    ref_loss, ref = _grads(model, batch)
    assert offload.enable(model) == 3
    loss, got = _grads(model, batch)
    assert saved == [torch.Size([2, 12, 64])] * 3  # every layer went through the offloading checkpoint
    torch.testing.assert_close(loss, ref_loss)
    assert got.keys() == ref.keys() and len(got) == 3 * 7 * 2
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_needs_checkpointing():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    with pytest.raises(RuntimeError, match="gradient_checkpointing"):
        offload.enable(model)
