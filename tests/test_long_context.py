"""The long-sequence levers (engine/models/long_context.py, engine/models/offload.py's
prefetch): each gives the loss and LoRA gradients of the plain step on a tiny model, on a
padded batch and on a packed row, and each really ran (the chunks, the segments, the
prefetched inputs are counted)."""

import contextlib

import pytest
import torch
from inline_run import run_inline, sft_config

from edgetune.engine.data.packing import collate_packed

from edgetune.engine.models import long_context, offload

from edgetune.engine.training.lm_loss import causal_lm_loss


def _lora_model(checkpointing=True):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    base = Qwen2ForCausalLM(cfg)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():  # a non-zero B, so every LoRA factor gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.train()


class _Row:
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, 97, (n,), generator=g).tolist()
        self.labels = list(self.input_ids)


def _batches():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    packed = collate_packed([_Row(13, 2), _Row(20, 3), _Row(7, 4)])  # one row of three documents
    return {"padded": padded, "packed": packed}


def _grads(model, batch, around=None):
    model.zero_grad(set_to_none=True)
    with around or contextlib.nullcontext():
        loss, _ = causal_lm_loss(model, batch)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _same(got, ref):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) == 3 * 7 * 2
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_chunked_mlp_gives_the_plain_step(kind, checkpointing, monkeypatch):
    batch = _batches()[kind]
    plain = _grads(_lora_model(checkpointing), batch)
    model = _lora_model(checkpointing)
    assert long_context.chunk_mlp(model, 7) == 3
    chunks = []
    real = long_context.checkpoint
    monkeypatch.setattr(long_context, "checkpoint", lambda fn, x, *a, **k: chunks.append(x.shape[-2]) or real(fn, x, *a, **k))
    _same(_grads(model, batch), plain)
    # every layer's MLP ran in chunks of at most 7 tokens covering the row (and again in the
    # recompute when the layer is checkpointed)
    assert max(chunks) == 7 and sum(chunks) == 40 * 3 * (2 if checkpointing else 1)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_mask_free_attention_gives_the_plain_step(kind, monkeypatch):
    batch = _batches()[kind]
    model = _lora_model()
    plain = _grads(model, batch)
    segments = []
    real = long_context._sdpa
    monkeypatch.setattr(long_context, "_sdpa", lambda q, *a: segments.append(q.shape[2]) or real(q, *a))
    monkeypatch.setattr(long_context, "_dense", None)  # the masked path must not run
    _same(_grads(model, batch, long_context.mask_free_attention(model)), plain)
    # one SDPA call per document (packed) or per row's real tokens and its padding, per layer,
    # in the forward and again in the checkpointed recompute
    per_layer = [13, 20, 7] if kind == "packed" else [40, 29, 11]
    assert segments == per_layer * 3 * 2
    assert model.get_base_model().config._attn_implementation == "sdpa"  # the model's own attention again


def test_mask_free_attention_leaves_generation_to_the_masked_path():
    model = _lora_model(checkpointing=False).eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as generation pads prompts
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        with long_context.mask_free_attention(model):
            got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_prefetched_offload_gives_the_plain_step(kind):
    batch = _batches()[kind]
    model = _lora_model()
    plain = _grads(model, batch)
    stash = offload.HostStash(prefetch=True, copies=True)  # real copies, as host memory would hold
    assert offload.enable(model, stash=stash) == 3
    for step in (1, 2):  # a second step starts a new chain of saved inputs
        _same(_grads(model, batch), plain)
        assert stash.prefetched == 2 * step  # layers 2 and 1 were back before their backward began


def test_every_lever_together_in_an_sft_run(tiny_model_dir, tmp_path):
    from edgetune.engine.methods.sft import sft

    def losses(name, **model):
        cfg = sft_config(tiny_model_dir, tmp_path, model={"gradient_checkpointing": True, **model},
                         sft={"steps": 3, "packing": True}, run={"checkpoint_every": 0})
        events = run_inline(sft.train, cfg, tmp_path / name)[2]
        return [e["loss"] for e in events if e["type"] == "step"]

    plain = losses("plain")
    levers = losses("levers", mlp_chunk_tokens=16, mask_free_attention=True, offload_activations=True,
                    offload_prefetch=True)
    assert len(plain) == 3 and len(set(plain)) == 3
    assert levers == pytest.approx(plain, rel=1e-5)
