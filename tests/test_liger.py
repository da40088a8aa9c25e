"""engine/models/liger.py: Liger's fused RMSNorm / SwiGLU / RoPE give the same loss and the same
LoRA gradients as the transformers code, with PEFT LoRA on all 7 projections.

The Triton kernels run on the CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it).
Liger replaces the modeling module's `apply_rotary_pos_emb` process-wide, so each test
computes the reference first and puts the module's attributes back afterwards.
"""

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from edgetune.engine.core.errors import ModelError  # noqa: E402
from edgetune.engine.core.settings import LoraSettings  # noqa: E402

from edgetune.engine.models import liger  # noqa: E402
from edgetune.engine.models.model import add_lora  # noqa: E402

pytest.importorskip("liger_kernel", reason="liger-kernel is a Linux dependency of edgetune")

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False, pad_token_id=0, rms_norm_eps=1e-6)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**COMMON))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**COMMON))


@pytest.fixture
def interpreter_float_scalars(monkeypatch):
    """Triton's interpreter (3.9) passes a Python float kernel argument through as a float,
    while the compiler specialises it to an fp32 scalar; Liger's RMSNorm forward kernel
    calls `eps.to(tl.float32)` / `offset.to(tl.float32)` on such arguments and fails under
    the interpreter with "'float' object has no attribute 'to'". Give the interpreter the
    compiler's semantics (what runs on a GPU) for the duration of the test."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return cvt(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", implicit_cvt)
    # The interpreter implements tl.math but not triton.language.extra.libdevice (its
    # functions are `...` stubs there and return None): Liger's RMSNorm kernels take
    # `rsqrt` from libdevice. tl.math.rsqrt is the same function (looked up at call
    # time: the interpreter swaps tl.math's functions for its own during a launch).
    from liger_kernel.ops import rms_norm

    monkeypatch.setattr(rms_norm, "rsqrt", lambda x: tl.math.rsqrt(x))

    # Record the names of the kernels that run, so a test can show they did.
    launched = []
    run = interpreter.InterpretedFunction.run

    def record(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    return launched


@pytest.fixture
def restore_modeling():
    """Put back whatever Liger replaced in transformers' modeling modules."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    saved = {m: dict(vars(m)) for m in (modeling_llama, modeling_qwen2)}
    yield
    for m, attrs in saved.items():
        for k, v in attrs.items():
            if getattr(m, k, None) is not v:
                setattr(m, k, v)


def _peft(build):
    torch.manual_seed(0)
    model = build().float()
    model = add_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0, target_modules="all-linear"),
                     gradient_checkpointing=False)
    # lora_B starts at zero, which would make every lora_A gradient zero: randomise it.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.train()
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 8:], mask[1, 8:] = 0, 0  # right padding on row 1
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[:, :3] = -100  # a "prompt" without labels
    return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("build", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_liger_matches_transformers(build, restore_modeling, interpreter_float_scalars):
    launched = interpreter_float_scalars
    import peft
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    ref = _peft(build)
    fused = copy.deepcopy(ref)
    batch = _batch()
    # The reference runs before apply(): Liger's RoPE is a module-level replacement.
    ref_loss, ref_grads = _loss_and_grads(ref, batch)

    modeling = __import__(type(ref.get_base_model()).__module__, fromlist=["_"])
    classes = {k: v for k, v in vars(modeling).items() if isinstance(v, type)}
    assert liger.apply(fused, "on") == "applied: rms_norm, swiglu, rope"

    # Not vacuous: the copy's norms / MLPs run Liger's forward, RoPE is Liger's ...
    base = fused.get_base_model().model
    norms = [base.norm] + [m for layer in base.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    for m in norms:
        assert m.forward.__func__ is LigerRMSNorm.forward and m._get_name() == "LigerRMSNorm"
    for layer in base.layers:
        assert layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward
        # ... and the LoRA layers are still the modules that run.
        for p in PROJ:
            owner = layer.mlp if p in ("gate_proj", "up_proj", "down_proj") else layer.self_attn
            assert isinstance(getattr(owner, p), peft.tuners.lora.Linear), p
    assert modeling.apply_rotary_pos_emb is liger_rotary_pos_emb
    # The reference model's modules are untouched, and the module's classes are back.
    ref_base = ref.get_base_model().model
    assert "forward" not in vars(ref_base.norm) and "forward" not in vars(ref_base.layers[0].mlp)
    assert all(getattr(modeling, k) is v for k, v in classes.items())

    assert not launched  # the reference ran no Liger kernel
    loss, grads = _loss_and_grads(fused, batch)
    n = build().config.num_hidden_layers
    counts = {k: launched.count(k) for k in set(launched)}
    # 2 norms per layer + the final one; no backward through layer 0's input norm (the
    # frozen embeddings need no gradient). One RoPE kernel (q and k) per layer, run
    # again for the backward.
    assert counts == {"_rms_norm_forward_kernel": 2 * n + 1, "_rms_norm_backward_kernel": 2 * n,
                      "_swiglu_forward_kernel": n, "_swiglu_backward_kernel": n,
                      "_triton_rope": 2 * n}, counts
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 2 * len(PROJ)
    for n, g in grads.items():
        assert ref_grads[n].abs().max() > 0, n
        torch.testing.assert_close(g, ref_grads[n], atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_phi3_fused_projections_match_transformers(interpreter_float_scalars):
    """Phi-3 (fused qkv_proj and gate_up_proj, Liger's own Phi-3 MLP): the same loss and
    LoRA gradients; docs/support.md counts Phi-3 among the families Liger is used for."""
    from transformers import Phi3Config, Phi3ForCausalLM
    from transformers.models.phi3 import modeling_phi3

    saved = dict(vars(modeling_phi3))
    try:
        ref = _peft(lambda: Phi3ForCausalLM(Phi3Config(**COMMON, eos_token_id=1, bos_token_id=1)))
        fused = copy.deepcopy(ref)
        ref_loss, ref_grads = _loss_and_grads(ref, _batch())
        assert liger.apply(fused, "on") == "applied: rms_norm, swiglu, rope"
        loss, grads = _loss_and_grads(fused, _batch())
    finally:
        for k, v in saved.items():
            if getattr(modeling_phi3, k, None) is not v:
                setattr(modeling_phi3, k, v)
    assert {"_swiglu_forward_kernel", "_swiglu_backward_kernel", "_triton_rope"} <= set(interpreter_float_scalars)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 2 * 4  # qkv, o, gate_up, down per layer
    for n, g in grads.items():
        assert ref_grads[n].abs().max() > 0, n
        torch.testing.assert_close(g, ref_grads[n], atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_on_without_gpu_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = _llama()
    with pytest.raises(ModelError, match="needs a CUDA GPU"):
        liger.apply(model, "on")
    assert "forward" not in vars(model.model.norm)


def test_auto_and_off_on_cpu():
    model = _llama()
    assert liger.apply(model, "auto").startswith("off: ")
    assert liger.apply(model, "off").startswith("off: ")
    assert "forward" not in vars(model.model.norm)
    with pytest.raises(ModelError):
        liger.apply(model, "yes")


def test_unsupported_model_type_on_is_an_error(restore_modeling):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ModelError, match="no kernels for model_type 'gpt2'"):
        liger.apply(model, "on")


@pytest.mark.slow  # Liger's kernels in Triton's interpreter
def test_planner_counts_what_a_liger_layer_saves(tmp_path, embedded_dir, restore_modeling,
                                                 interpreter_float_scalars):
    """One decoder layer of an NF4 + LoRA Qwen2 (bf16 compute, bf16 autocast as on CUDA)
    with Liger applied: the bytes autograd saves inside it, against the planner's
    layer_activation_bytes for the same configuration on CUDA (where the planner assumes
    Liger in SFT)."""
    from dataclasses import replace

    from layer_probe import saved_bytes_of_first_layer, tiny_nf4_qwen2

    from edgetune.engine.planning import planner

    model, c = tiny_nf4_qwen2(tmp_path, embedded_dir)
    assert liger.apply(model, "on") == "applied: rms_norm, swiglu, rope"
    ids = torch.randint(0, 512, (4, 64))
    measured = saved_bytes_of_first_layer(model, ids, autocast=True)
    assert "_swiglu_forward_kernel" in interpreter_float_scalars  # Liger's MLP ran
    ctx, _ = planner.make_ctx(c, "cuda", "auto")
    assert ctx.liger and ctx.autocast
    predicted = planner.layer_activation_bytes(ctx, ids.numel())
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)
    # and Liger's saving is real: the same layer without it keeps more
    assert planner.layer_activation_bytes(replace(ctx, liger=False), ids.numel()) > 1.1 * measured
