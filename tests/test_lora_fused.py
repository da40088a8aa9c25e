"""Fused LoRA (kernels/lora_fused.py): the same outputs and gradients as PEFT's LoRA layer."""

# The kernels run under TRITON_INTERPRET=1 on the CPU, compiled with EDGETUNE_TEST_GPU=1 (tests/conftest.py).
import os

import pytest
import torch
from torch import nn

from edgetune.kernels import lora_fused, sebp

torch.set_num_threads(1)
GPU = os.environ.get("EDGETUNE_TEST_GPU") == "1" and torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Holder(nn.Module):
    def __init__(self, k, n, bias):
        super().__init__()
        self.layer = nn.Linear(k, n, bias=bias)

    def forward(self, x):
        return self.layer(x)


def peft_layer(k, n, bias, gen):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(Holder(k, n, bias), LoraConfig(r=4, lora_alpha=12, target_modules=["layer"]))
    with torch.no_grad():  # PEFT starts B at zero, which would hide dA: random factors
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def run(model, x, dy, autocast):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, [p.grad.clone() for p in params]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_fused_lora_linear_matches_peft(bias, autocast):
    """Forward, dX, dA, dB of a PEFT LoRA Linear (odd widths, 3 x 7 rows), in fp32 and
    under bf16 autocast (there to bf16 rounding: PEFT rounds the branch before its add)."""
    gen = torch.Generator().manual_seed(41)
    model = peft_layer(45, 37, bias, gen).to(DEV)
    x, dy = torch.randn(3, 7, 45, generator=gen).to(DEV), torch.randn(3, 7, 37, generator=gen).to(DEV)
    y_ref, dx_ref, g_ref = run(model, x, dy, autocast)
    calls = []
    real = lora_fused.FusedLoraFn.forward
    lora_fused.FusedLoraFn.forward = staticmethod(lambda *a: calls.append(1) or real(*a))
    try:
        with lora_fused.enabled(model, True) as fused:
            assert fused.patched == 1
            y, dx, g = run(model, x, dy, autocast)
    finally:
        lora_fused.FusedLoraFn.forward = staticmethod(real)
    assert calls == [1] and "forward" not in model.base_model.model.layer.__dict__  # patched, then removed
    tol = 1e-2 if autocast else 1e-6
    assert y.dtype == y_ref.dtype and dx.dtype == dx_ref.dtype
    for got, ref in [(y, y_ref), (dx, dx_ref)] + list(zip(g, g_ref)):
        assert got.dtype == ref.dtype and rel(got, ref) <= tol, rel(got, ref)
    assert len(g) == 2 and all(t.abs().sum() > 0 for t in g)


def test_off_and_lifted_are_peft_itself_and_other_layers_keep_their_forward():
    gen = torch.Generator().manual_seed(43)
    model = peft_layer(16, 8, True, gen)
    layer = model.base_model.model.layer
    with lora_fused.enabled(model, False) as fused:
        assert fused.patched == 0 and "forward" not in layer.__dict__
    with lora_fused.enabled(model, True) as fused:
        with fused.lifted():
            assert "forward" not in layer.__dict__
        assert "forward" in layer.__dict__
        layer.lora_dropout["default"] = nn.Dropout(0.5)  # a dropout mask: PEFT's own path
        x = torch.randn(2, 3, 16, generator=gen)
        calls = []
        real = lora_fused.FusedLoraFn.apply
        lora_fused.FusedLoraFn.apply = lambda *a: calls.append(1) or real(*a)
        try:
            model(x)
        finally:
            lora_fused.FusedLoraFn.apply = real
        assert calls == []
    assert "forward" not in layer.__dict__


@pytest.mark.skipif(GPU, reason="a CPU model: on a GPU, bench/sft_speed.py's first losses compare the same step")
@pytest.mark.parametrize("with_sebp", [False, True])
def test_whole_nf4_model_step_matches_peft(tmp_path, with_sebp):
    """A tiny Llama, NF4 base, LoRA on every linear: loss and every adapter gradient of a
    padded batch equal PEFT's; with SEBP patched over the fused forwards too."""
    import test_sebp as ts
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=ts.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = ts.load_nf4_lora(tmp_path)
    batch = ts.sft_batch(torch.Generator().manual_seed(11))
    model.zero_grad(set_to_none=True)
    ids, attn, labels = batch
    loss_ref = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    loss_ref.backward()
    loss_ref, g_ref = loss_ref.detach(), ts.lora_grads(model)
    with lora_fused.enabled(model, True) as fused:
        assert fused.patched == 2 * 7
        with sebp.enabled(model, with_sebp, "gather") as h:
            if with_sebp:
                h.set_active_rows(batch[1].bool())
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            g = ts.lora_grads(model)
    assert rel(loss.detach(), loss_ref) <= 1e-6
    assert set(g) == set(g_ref)
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-5, (name, rel(g[name], g_ref[name]))
