"""SEBP: the sparse backward must equal the dense backward with padding rows' dY zeroed.

Triton kernels run under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it before triton is imported); the
whole-model tests use the pure-PyTorch path of the same math, which is itself checked
against the Triton path per layer.
"""

import contextlib
import json
import types

import pytest
import torch
from torch import nn

from edgetune.kernels import sebp

from edgetune.engine.training.lm_loss import causal_lm_loss

torch.set_num_threads(1)
BACKENDS = ["triton", "torch", "runs"]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def make_mask(kind, batch, seq, gen):
    if kind == "random":
        m = torch.rand(batch, seq, generator=gen) < 0.55
        m[0, 0] = True
        return m
    if kind == "right_padded":
        lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
        return torch.arange(seq)[None, :] < lengths[:, None]
    if kind == "one":
        m = torch.zeros(batch, seq, dtype=torch.bool)
        m[batch - 1, seq // 2] = True
        return m
    if kind == "all":
        return torch.ones(batch, seq, dtype=torch.bool)
    raise ValueError(kind)


class Holder(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def grads_of(model, x, dy, params):
    for p in params:
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in params]


# --------------------------------------------------------------------------- plain nn.Linear


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "right_padded", "one", "all"])
def test_plain_linear_matches_dense(backend, dtype, kind):
    gen = torch.Generator().manual_seed(hash((backend, str(dtype), kind)) % 2**31)
    batch, seq, k, n = 3, 12, 48, 80
    layer = nn.Linear(k, n, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen))
        layer.bias.copy_(torch.randn(n, generator=gen))
    model = Holder(layer)
    x = torch.randn(batch, seq, k, generator=gen).to(dtype)
    mask = make_mask(kind, batch, seq, gen)
    dy = torch.randn(batch, seq, n, generator=gen).to(dtype)
    dy_masked = dy * mask[..., None].to(dtype)
    params = [layer.weight, layer.bias]
    y_ref, dx_ref, (dw_ref, db_ref) = grads_of(model, x, dy_masked, params)

    handle = sebp.patch(model)
    handle.backend = backend
    sebp.set_active_rows(model, mask)
    # The sparse backward reads dY only at active rows: feed the unmasked dY to prove it.
    y, dx, (dw, db) = grads_of(model, x, dy, params)
    sebp.unpatch(model)

    assert torch.equal(y, y_ref)  # the forward is the dense forward, bit for bit
    for got, ref in [(dx, dx_ref), (dw, dw_ref), (db, db_ref)]:
        assert not torch.isnan(got).any()
        assert rel(got, ref) <= tol(dtype), rel(got, ref)
    assert (dx[~mask] == 0).all()
    assert dx[mask].abs().sum() > 0


def test_frozen_linear_gives_only_dx():
    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(32, 48, bias=False)
    layer.weight.requires_grad_(False)
    model = Holder(layer)
    x = torch.randn(2, 16, 32, generator=gen)
    mask = make_mask("right_padded", 2, 16, gen)
    dy = torch.randn(2, 16, 48, generator=gen)
    _, dx_ref, _ = grads_of(model, x, dy * mask[..., None], [])
    sebp.patch(model).backend = "triton"
    sebp.set_active_rows(model, mask)
    _, dx, _ = grads_of(model, x, dy, [])
    assert layer.weight.grad is None
    assert rel(dx, dx_ref) <= 1e-5 and (dx[~mask] == 0).all()


def test_falls_back_without_mask_or_on_other_shapes():
    gen = torch.Generator().manual_seed(4)
    layer = nn.Linear(16, 24)
    model = Holder(layer)
    handle = sebp.patch(model)
    handle.backend = "triton"
    dy = torch.randn(2, 8, 24, generator=gen)
    x = torch.randn(2, 8, 16, generator=gen)
    # No mask: dense backward, so dY's non-zero rows all reach dX.
    _, dx, _ = grads_of(model, x, dy, [layer.weight, layer.bias])
    assert (dx != 0).all()
    # A mask of another shape than the input's [batch, seq]: dense backward too.
    sebp.set_active_rows(model, torch.zeros(2, 9, dtype=torch.bool))
    _, dx, _ = grads_of(model, x, dy, [layer.weight, layer.bias])
    assert (dx != 0).all()
    # A 2-D input: dense.
    sebp.set_active_rows(model, torch.zeros(2, 8, dtype=torch.bool))
    x2 = x.reshape(16, 16).requires_grad_(True)
    model(x2).backward(dy.reshape(16, 24))
    assert (x2.grad != 0).all()
    sebp.set_active_rows(model, None)
    _, dx, _ = grads_of(model, x, dy, [layer.weight, layer.bias])
    assert (dx != 0).all()


class Stack(nn.Module):
    """Several linear layers in a row, like a decoder's block linears."""

    def __init__(self, widths):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_ids_built_once_per_step_and_no_host_sync_per_layer(backend, monkeypatch):
    """The active rows are computed in set_active_rows (one nonzero) and every layer's
    backward reuses that one object: no nonzero, item, int() or tolist while the layers
    run forward and backward, whatever the number of layers."""
    gen = torch.Generator().manual_seed(9)
    model = Stack([16, 32, 24, 16, 8])
    handle = sebp.patch(model)
    handle.backend = backend
    mask = make_mask("right_padded", 3, 8, gen)
    x = torch.randn(3, 8, 16, generator=gen)
    dy = torch.randn(3, 8, 8, generator=gen)
    ref_dx = grads_of(model, x, dy * mask[..., None], [])[1]  # no rows set: dense
    builds = []
    real_build = sebp.ActiveRows.from_mask.__func__
    monkeypatch.setattr(sebp.ActiveRows, "from_mask", classmethod(lambda cls, m: builds.append(1) or real_build(cls, m)))
    sebp.set_active_rows(handle, mask)
    assert len(builds) == 1
    step_rows = handle.rows

    seen, syncs = [], []
    real_backward = sebp._sparse_backward
    monkeypatch.setattr(sebp, "_sparse_backward", lambda g2, x2, rows, *a: seen.append(rows) or real_backward(g2, x2, rows, *a))
    for owner, name in [(torch.Tensor, "nonzero"), (torch.Tensor, "item"), (torch.Tensor, "tolist"),
                        (torch.Tensor, "__int__"), (torch, "nonzero"), (torch, "argwhere")]:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **k: syncs.append(_name) or _real(*a, **k))
    xg = x.clone().requires_grad_(True)
    model(xg).backward(dy)
    monkeypatch.undo()
    assert syncs == [] and len(builds) == 1
    assert len(seen) == 4 and all(r is step_rows for r in seen)  # one ActiveRows, reused by every layer
    assert rel(xg.grad, ref_dx) <= 1e-5
    sebp.unpatch(model)


def test_set_active_rows_takes_prebuilt_rows():
    gen = torch.Generator().manual_seed(10)
    layer = nn.Linear(16, 8, bias=False)
    model = Holder(layer)
    handle = sebp.patch(model)
    handle.backend = "torch"
    mask = make_mask("random", 2, 8, gen)
    rows = sebp.ActiveRows.from_mask(mask)
    assert rows.n_active == int(mask.sum()) and rows.index.dtype == torch.int32
    assert torch.equal(rows.inactive(), (~mask).reshape(-1).nonzero().squeeze(1))
    x, dy = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 8, generator=gen)
    _, dx_ref, (dw_ref,) = grads_of(model, x, dy * mask[..., None], [layer.weight])  # no rows: dense
    sebp.set_active_rows(model, rows)
    assert handle.rows is rows
    _, dx, (dw,) = grads_of(model, x, dy, [layer.weight])
    assert rel(dx, dx_ref) <= 1e-5 and rel(dw, dw_ref) <= 1e-5 and (dx[~mask] == 0).all()
    sebp.unpatch(model)


def test_unpatch_restores_forward_exactly():
    layer = nn.Linear(8, 8)
    model = Holder(layer)
    sentinel = layer.forward
    assert "forward" not in layer.__dict__
    h = sebp.patch(model)
    assert sebp.patch(model) is h and len(h) == 1
    assert "forward" in layer.__dict__
    sebp.unpatch(model)
    assert "forward" not in layer.__dict__ and layer.forward == sentinel
    assert not hasattr(model, "_sebp_handle")
    with pytest.raises(ValueError):
        sebp.set_active_rows(model, None)


# --------------------------------------------------------------------------- NF4 + LoRA model


VOCAB = 96


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def load_nf4_lora(path, checkpointing=True, seed=1, targets="all-linear"):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.float32, device_map={"": "cpu"})
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero, which would hide dA: use random factors
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.train()
    return model


def sft_batch(gen, batch=3, seq=20):
    lengths = torch.tensor([seq, seq - 7, 5])[:batch]
    attn = torch.arange(seq)[None, :] < lengths[:, None]
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    ids[~attn] = 0
    labels = ids.clone()
    labels[~attn] = -100
    labels[:, :3] = -100  # the prompt: masked in the loss, still attended to
    return ids, attn.long(), labels


def lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_over_nf4_layer_matches_dense(tiny_dir):
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    model = load_nf4_lora(tiny_dir)
    layers = [m for m in model.modules() if isinstance(m, LoraLinear4bit)]
    assert len(layers) == 2 * 7 and isinstance(layers[0].base_layer, bnb.nn.Linear4bit)
    layer = layers[-1]  # down_proj: K=128 -> N=64
    k, n = layer.in_features, layer.out_features
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, k, generator=gen)
    mask = make_mask("random", 2, 16, gen)
    dy = torch.randn(2, 16, n, generator=gen)
    holder = Holder(layer)
    _, dx_ref, (da_ref, db_ref) = grads_of(holder, x, dy * mask[..., None], [a, b])
    handle = sebp.patch(holder)
    results = {}
    for backend in BACKENDS:
        handle.backend = backend
        sebp.set_active_rows(handle, mask)
        y, dx, (da, db) = grads_of(holder, x, dy, [a, b])
        results[backend] = (dx, da, db)
        for got, ref in [(dx, dx_ref), (da, da_ref), (db, db_ref)]:
            assert not torch.isnan(got).any()
            assert rel(got, ref) <= 1e-5, (backend, rel(got, ref))
        assert (dx[~mask] == 0).all()
    sebp.unpatch(holder)
    for t, p in zip(results["triton"], results["torch"]):
        assert rel(t, p) <= 1e-5


def step(model, batch, use_sebp, lm_head_sparse=False):
    ids, attn, labels = batch
    if use_sebp:
        sebp.set_active_rows(model, attn.bool())
    else:
        sebp.set_active_rows(model, None)
    model.zero_grad(set_to_none=True)
    if lm_head_sparse:
        loss, _ = causal_lm_loss(model, {"input_ids": ids, "attention_mask": attn, "labels": labels})
    else:
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    loss.backward()
    return loss.detach(), lora_grads(model)


def test_enabled_handle_on_off_lifted_and_removed_on_exception(tiny_dir, monkeypatch):
    """The one handle the training loops use: on gives the plain model's gradients through
    the sparse backward, off and lifted are the plain model itself, and the original
    forwards are back after the block, also when it raises (inside `lifted` too)."""
    model = load_nf4_lora(tiny_dir)
    ids, attn, labels = sft_batch(torch.Generator().manual_seed(17))
    calls = []
    orig = sebp._sparse_backward
    monkeypatch.setattr(sebp, "_sparse_backward", lambda *a, **k: calls.append(1) or orig(*a, **k))

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
        return lora_grads(model)

    def own_forwards():
        return {name: m.__dict__.get("forward") for name, m in model.named_modules()}

    plain_forwards = own_forwards()
    ref = grads()
    with sebp.enabled(model, True, backend="torch") as h:
        assert h.on and h.patched and len(model._sebp_handle) == 2 * 7
        h.set_active_rows(attn.bool())
        g_on = grads()
        assert len(calls) == 2 * 7
        with h.lifted():
            assert not h.patched and not hasattr(model, "_sebp_handle") and own_forwards() == plain_forwards
            h.set_active_rows(attn.bool())  # nothing to set while lifted
            g_lifted = grads()
        assert len(calls) == 2 * 7 and h.patched and model._sebp_handle.backend == "torch"
        assert model._sebp_handle.rows is None  # back with no rows: a stale mask never applies
        h.set_active_rows(attn.bool())
        g_again = grads()
        assert len(calls) == 2 * 2 * 7
        with pytest.raises(ValueError, match="already patched"):
            with sebp.enabled(model, True):
                pass
    assert not hasattr(model, "_sebp_handle") and own_forwards() == plain_forwards
    with sebp.enabled(model, False) as h:
        assert not h.on and not h.patched and not hasattr(model, "_sebp_handle")
        h.set_active_rows(attn.bool())
        with h.lifted():
            pass
        g_off = grads()
    assert len(calls) == 2 * 2 * 7
    for name in ref:
        assert ref[name].abs().sum() > 0
        assert torch.equal(g_lifted[name], ref[name]) and torch.equal(g_off[name], ref[name])
        assert rel(g_on[name], ref[name]) <= 1e-5 and rel(g_again[name], ref[name]) <= 1e-5, name

    for lift in (False, True):
        with pytest.raises(RuntimeError, match="boom"):
            with sebp.enabled(model, True) as h:
                h.set_active_rows(attn.bool())
                with h.lifted() if lift else contextlib.nullcontext():
                    raise RuntimeError("boom")
        assert not hasattr(model, "_sebp_handle") and own_forwards() == plain_forwards
    n = len(calls)
    assert torch.equal(grads()[next(iter(ref))], ref[next(iter(ref))]) and len(calls) == n


@pytest.mark.parametrize("checkpointing", [True, False])
def test_whole_model_step_matches_dense(tiny_dir, checkpointing):
    model = load_nf4_lora(tiny_dir, checkpointing=checkpointing)
    handle = sebp.patch(model)
    handle.backend = "torch"  # the Triton path of the same math: per-layer tests and the one below
    assert len(handle) == 2 * 7  # q k v o gate up down per block; lm_head left alone
    batch = sft_batch(torch.Generator().manual_seed(11))
    loss_ref, g_ref = step(model, batch, use_sebp=False)
    calls = []
    orig = sebp._sparse_backward
    sebp._sparse_backward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        loss, g = step(model, batch, use_sebp=True)
        loss_h, g_h = step(model, batch, use_sebp=True, lm_head_sparse=True)
    finally:
        sebp._sparse_backward = orig
    assert len(calls) == 2 * 14  # every patched layer took the sparse backward
    assert torch.equal(loss, loss_ref)
    assert rel(loss_h, loss_ref) <= 1e-6
    assert set(g) == set(g_ref) and len(g) == 2 * 2 * 7
    for name in g_ref:
        assert g_ref[name].abs().sum() > 0
        assert rel(g[name], g_ref[name]) <= 1e-5, (name, rel(g[name], g_ref[name]))
        assert rel(g_h[name], g_ref[name]) <= 1e-5, (name, rel(g_h[name], g_ref[name]))
    sebp.unpatch(model)


def test_few_training_steps_same_losses(tiny_dir):
    losses = {}
    for use in (False, True):
        model = load_nf4_lora(tiny_dir, seed=5)
        sebp.patch(model).backend = "torch"
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        gen = torch.Generator().manual_seed(21)
        run = []
        for _ in range(3):
            loss, _ = step(model, sft_batch(gen), use_sebp=use, lm_head_sparse=use)
            opt.step()
            run.append(loss.item())
        losses[use] = run
    assert losses[False][0] != losses[False][-1]
    for a, b in zip(losses[False], losses[True]):
        assert abs(a - b) <= 1e-5 * abs(a), (losses[False], losses[True])


@pytest.mark.slow  # a whole model in Triton's interpreter
def test_whole_model_under_triton_interpreter(tiny_dir):
    model = load_nf4_lora(tiny_dir, checkpointing=True)
    handle = sebp.patch(model)
    handle.backend = "triton"
    batch = sft_batch(torch.Generator().manual_seed(13), batch=2, seq=16)
    loss_ref, g_ref = step(model, batch, use_sebp=False)
    loss, g = step(model, batch, use_sebp=True, lm_head_sparse=True)
    assert rel(loss, loss_ref) <= 1e-6
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-5, (name, rel(g[name], g_ref[name]))


# Triton: a whole model in the interpreter
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow), "torch", "runs"])
def test_whole_model_under_bf16_autocast(tiny_dir, backend):
    """The engine's CUDA training forward runs under bf16 autocast (engine/models/model.autocast);
    SEBP must take its sparse backward there too and agree with autograd of the same
    autocast forward to bf16 rounding. (CPU autocast stands in for CUDA's here.)"""
    model = load_nf4_lora(tiny_dir, checkpointing=True)
    handle = sebp.patch(model)
    handle.backend = backend
    batch = sft_batch(torch.Generator().manual_seed(19))
    calls = []
    orig = sebp._sparse_backward
    sebp._sparse_backward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_ref, g_ref = step(model, batch, use_sebp=False)
            n_dense = len(calls)
            loss, g = step(model, batch, use_sebp=True, lm_head_sparse=True)
    finally:
        sebp._sparse_backward = orig
    assert n_dense == 0 and len(calls) == 2 * 7  # every patched layer (2 blocks x 7) went sparse
    assert rel(loss, loss_ref) <= 1e-2
    for name in g_ref:
        assert g_ref[name].abs().sum() > 0
        assert rel(g[name], g_ref[name]) <= 3e-2, (name, rel(g[name], g_ref[name]))
    sebp.unpatch(model)


def test_frozen_nf4_layers_and_left_padding(tiny_dir):
    """LoRA on q/v only: the other block linears are bare 4-bit layers (dX only, through
    the dequantised weight); a left-padded batch, as generation batches are."""
    import bitsandbytes as bnb

    model = load_nf4_lora(tiny_dir, targets=["q_proj", "v_proj"])
    handle = sebp.patch(model)
    bare = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit) and "forward" in m.__dict__]
    assert len(bare) == 2 * 5 and len(handle) == 2 * 7
    gen = torch.Generator().manual_seed(17)
    ids, attn, labels = sft_batch(gen)
    attn, ids, labels = attn.flip(1), ids.flip(1), labels.flip(1)  # padding on the left
    for backend in BACKENDS:
        handle.backend = backend
        loss_ref, g_ref = step(model, (ids, attn, labels), use_sebp=False)
        loss, g = step(model, (ids, attn, labels), use_sebp=True, lm_head_sparse=True)
        assert rel(loss, loss_ref) <= 1e-6
        assert len(g) == 2 * 2 * 2
        for name in g_ref:
            assert g_ref[name].abs().sum() > 0
            assert rel(g[name], g_ref[name]) <= 1e-5, (backend, name, rel(g[name], g_ref[name]))


# --------------------------------------------------------------------------- odd shapes


def pad_mask(kind, batch, seq):
    """none | one | all | right (first rows of each sequence) | left (last rows)."""
    m = torch.zeros(batch, seq, dtype=torch.bool)
    lengths = [max(1, (seq * (b + 2)) // (batch + 3)) for b in range(batch)]
    if kind == "one":
        m[-1, seq // 2] = True
    elif kind == "all":
        m[:] = True
    elif kind in ("right", "left"):
        for b, n in enumerate(lengths):
            m[b, :n] = True
        if kind == "left":
            m = m.flip(1)
    return m


def lora_holder(k, n, dtype, gen):
    """A real PEFT LoRA Linear (r=4) over an nn.Linear with a bias, base frozen."""
    from peft import LoraConfig, get_peft_model

    base = Holder(nn.Linear(k, n, bias=True))
    with torch.no_grad():
        base.layer.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["layer"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.to(dtype)
    return model


# (batch, seq, K): 4,097 rows and K = 2,880; the interpreter's Triton path on scaled-down
# counterparts (257 rows; K = 360, not a multiple of the tiles) to stay a few seconds a case.
ODD_SHAPES = {"runs": [(1, 4097, 2880), (3, 13, 2880)], "triton": [(1, 257, 24), (2, 5, 360)]}


@pytest.mark.parametrize("backend", ["runs", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "one", "all", "right", "left"])
def test_lora_layer_odd_shapes_match_dense(backend, dtype, kind):
    """dX, dA, dB of a PEFT LoRA layer over a frozen base from the active rows only
    equal autograd's with dY zeroed outside them; dX is zero on every other row."""
    gen = torch.Generator().manual_seed(23)
    n = 24
    for batch, seq, k in ODD_SHAPES[backend]:
        model = lora_holder(k, n, dtype, gen)
        layer = model.base_model.model.layer
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        x = torch.randn(batch, seq, k, generator=gen).to(dtype)
        dy = torch.randn(batch, seq, n, generator=gen).to(dtype)
        mask = pad_mask(kind, batch, seq)
        _, dx_ref, (da_ref, db_ref) = grads_of(model, x, dy * mask[..., None].to(dtype), [a, b])
        handle = sebp.patch(model)
        handle.backend = backend
        sebp.set_active_rows(handle, mask)
        _, dx, (da, db) = grads_of(model, x, dy, [a, b])
        sebp.unpatch(model)
        assert (dx[~mask] == 0).all()
        for got, ref in [(dx, dx_ref), (da, da_ref), (db, db_ref)]:
            assert got.dtype == ref.dtype and not torch.isnan(got).any()
            if kind == "none":
                assert (got == 0).all() and (ref == 0).all()
            else:
                assert rel(got, ref) <= tol(dtype), (batch, seq, k, rel(got, ref))


def test_runs_of_active_rows():
    rows = sebp.ActiveRows.from_mask(pad_mask("right", 3, 10))
    assert rows.runs == ((0, 3), (10, 15), (20, 26)) and rows.gaps == ((3, 10), (15, 20), (26, 30))
    rows = sebp.ActiveRows.from_mask(pad_mask("left", 2, 5))
    assert rows.runs == ((3, 5), (7, 10)) and rows.gaps == ((0, 3), (5, 7))
    assert sebp.ActiveRows.from_mask(pad_mask("all", 2, 5)).runs == ((0, 10),)
    none = sebp.ActiveRows.from_mask(pad_mask("none", 2, 5))
    assert none.runs == () and none.gaps == ((0, 10),)
    assert torch.equal(sebp.ActiveRows.from_mask(pad_mask("one", 2, 5)).keep(torch.float32, "cpu").squeeze(1),
                       pad_mask("one", 2, 5).reshape(-1).float())


# --------------------------------------------------------------------------- lm_head


@pytest.mark.parametrize("num_items", [None, 17])
def test_sparse_lm_head_loss_matches_transformers(num_items):
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(num_items or 1)
    batch, seq, hidden, vocab = 3, 10, 24, 50
    h = torch.randn(batch, seq, hidden, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[:, :4] = -100
    labels[2, 6:] = -100
    nib = None if num_items is None else torch.tensor(num_items)
    ref = ForCausalLMLoss(h @ w.t(), labels, vocab, num_items_in_batch=nib)
    dh_ref, dw_ref = torch.autograd.grad(ref, (h, w))
    got = sebp.sparse_lm_head_loss(h, w, labels, num_items_in_batch=nib)
    dh, dw = torch.autograd.grad(got, (h, w))
    assert rel(got, ref) <= 1e-6
    assert rel(dh, dh_ref) <= 1e-5 and rel(dw, dw_ref) <= 1e-5
    # Rows whose next label is ignored get exactly zero gradient (no logits were made).
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    assert (dh[shifted == -100] == 0).all() and (dh[shifted != -100] != 0).any()


@pytest.mark.parametrize("kind", ["random", "right_padded", "one"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scatter_rows_writes_every_row_once(kind, out_dtype):
    """dX from compact rows in one pass: part[i] (+ d[i] @ e) on row R[i], exact zeros
    elsewhere, also over a buffer full of garbage (no memset before it)."""
    from edgetune.kernels.sebp_triton import scatter_rows

    gen = torch.Generator().manual_seed(11)
    rows = sebp.ActiveRows.from_mask(make_mask(kind, 3, 20, gen))
    n, C, r = rows.n_active, 70, 5
    part = torch.randn(n, C, generator=gen).to(out_dtype)
    d, e = torch.randn(n, r, generator=gen), torch.randn(r, C, generator=gen)
    pos = rows.position
    assert (pos[rows.index.long()] == torch.arange(n, dtype=torch.int32)).all() and int((pos >= 0).sum()) == n
    for extra in (None, (d, e)):
        ref = torch.zeros(rows.n_total, C)
        ref[rows.index.long()] = part.float() + (d @ e if extra is not None else 0)
        out = torch.full((rows.n_total, C), float("nan"), dtype=out_dtype)
        scatter_rows(part, pos, out, extra=extra)
        inactive = pos < 0
        assert (out[inactive] == 0).all()
        if out_dtype == torch.float32:
            assert rel(out, ref) <= 1e-6
        else:  # within one bf16 step of the fp32 value (the interpreter truncates, a GPU rounds)
            assert ((out.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()


def test_choose_backend_measures_once_per_key_and_keeps_the_faster(monkeypatch):
    monkeypatch.setattr(sebp, "_CHOICE", {})
    runs = {"triton": 0, "torch": 0}
    cost = {"triton": 2.0, "torch": 1.0}

    def make(name):
        return lambda: runs.__setitem__(name, runs[name] + 1)

    def timer(fn):
        fn()
        return cost["triton" if runs["triton"] > runs["torch"] else "torch"]  # whichever just ran more

    cands = {"triton": make("triton"), "torch": make("torch")}
    assert sebp.choose_backend(("k", 1), cands, timer=timer, reps=2) == "torch"
    assert runs == {"triton": 3, "torch": 3}  # warm-up + 2 timed each
    assert sebp.choose_backend(("k", 1), cands, timer=timer, reps=2) == "torch"
    assert runs == {"triton": 3, "torch": 3}  # the second time: a lookup, nothing run or timed
    cost.update(triton=0.5)
    assert sebp.choose_backend(("k", 2), cands, timer=timer, reps=2) == "triton"  # another key: measured


def test_backend_choices_are_kept_between_runs(monkeypatch, tmp_path):
    """A choice measured once is read back by a later run (a fresh process: the in-memory
    table empty) from the file remember_choices names, and nothing is measured again; a
    damaged file costs a measurement, not a failure."""
    runs = {"triton": 0, "torch": 0}
    last = []
    cands = {name: (lambda name=name: runs.__setitem__(name, runs[name] + 1) or last.append(name)) for name in runs}
    cost = {"triton": 2.0, "torch": 1.0}
    key = (13, 3584, 512, "torch.bfloat16", "torch.bfloat16", True, (True, False, False, True, True), 12)
    cpu = torch.device("cpu")
    for _ in range(2):  # the first run measures; the second finds it in the file
        monkeypatch.setattr(sebp, "_CHOICE", {})
        sebp.remember_choices(tmp_path / "sebp")
        assert sebp.choose_backend(key, cands, timer=lambda fn: fn() or cost[last[-1]], reps=1,
                                   device=cpu) == "torch"
    assert runs == {"triton": 2, "torch": 2}  # one warm-up + one timed each, in the first run only
    (stored,) = (tmp_path / "sebp").iterdir()
    assert stored.name.startswith("cpu-torch") and "torch" in stored.read_text()
    stored.write_text("{not json")
    monkeypatch.setattr(sebp, "_CHOICE", {})
    sebp.remember_choices(tmp_path / "sebp")
    sebp.choose_backend(key, cands, timer=lambda fn: fn() or cost[last[-1]], reps=1, device=cpu)
    assert runs == {"triton": 4, "torch": 4} and json.loads(stored.read_text())


def test_padded_batches_of_nearby_lengths_share_one_backend_choice(monkeypatch):
    """A padded run's batches each have their own length; the choice is made per class of
    the rows and active rows, so lengths 900..1000 of 8 rows cost one measurement."""
    monkeypatch.setattr(sebp, "_CHOICE", {})
    seen = []
    monkeypatch.setattr(sebp, "choose_backend", lambda key, cands, **kw: seen.append(key) or "torch")
    monkeypatch.setattr(sebp, "_use_triton", lambda t, b: False)
    for seq in (900, 950, 1000):
        x2 = types.SimpleNamespace(is_cuda=True, shape=(8 * seq, 64), dtype=torch.bfloat16, device="cuda")
        g2 = types.SimpleNamespace(shape=(8 * seq, 32), dtype=torch.bfloat16)
        rows = types.SimpleNamespace(n_active=5 * seq)
        monkeypatch.setattr(sebp, "_sparse_backward_torch", lambda *a: None)
        sebp._sparse_backward(g2, x2, rows, None, None, (True, False, False, False, False), "auto")
    assert len(set(seen)) == 1


def test_row_counts_of_a_run_reach_few_tunings_and_choices(monkeypatch):
    """Whatever is tuned or measured per row count (the Triton kernels' autotune key, the
    backend choice) sees a bounded set over a run's varying counts: 300 batches of random
    lengths (1..1,024 tokens a row, 8 rows, 1..all rows active) reach at most 3 row classes
    in the kernels and 6 backend choices per layer shape, the choice's row classes being
    at most 3 x 3 with the active rows never more than the rows."""
    from edgetune.kernels import sebp_triton

    tuned = []
    monkeypatch.setattr(sebp_triton, "_launch", lambda kernel, grid, *args, **kw: tuned.append((kernel, args[-1])))
    monkeypatch.setattr(sebp, "_CHOICE", {})
    chosen = []
    monkeypatch.setattr(sebp, "choose_backend", lambda key, cands, **kw: chosen.append(key) or "triton")
    monkeypatch.setattr(sebp, "_sparse_backward_triton", lambda *a: None)
    gen = torch.Generator().manual_seed(37)
    q, qt = torch.zeros(64, 48), torch.zeros(64, 8)
    for _ in range(300):
        seq = int(torch.randint(1, 1025, (1,), generator=gen))
        m = 8 * seq
        n = int(torch.randint(1, m + 1, (1,), generator=gen))
        idx = torch.zeros(n, dtype=torch.int32)
        p = torch.zeros(m, 64)
        sebp_triton.gathered_mm(p, idx, q, torch.zeros(m, 48), scatter=True)
        sebp_triton.gathered_mm(p, idx, qt, torch.zeros(n, 8), scatter=False)
        sebp_triton.gathered_tn(p, idx, p, torch.zeros(64, 64), gather_q=True)
        x2 = types.SimpleNamespace(is_cuda=True, shape=(m, 64), dtype=torch.bfloat16, device="cuda")
        g2 = types.SimpleNamespace(shape=(m, 48), dtype=torch.bfloat16)
        sebp._sparse_backward(g2, x2, types.SimpleNamespace(n_active=n), None, None, (True,) + (False,) * 4, "auto")
    kernels = {k for k, _ in tuned}
    assert len(kernels) == 3  # wide and skinny row-gathering GEMMs, the wide row reduction
    for k in kernels:
        assert len({b for kk, b in tuned if kk is k}) <= 3
    assert 2 <= len(set(chosen)) <= 6


@pytest.mark.parametrize("kernel, backend", [("auto", "auto"), ("indexed", "triton"), ("gather", "torch"),
                                             ("runs", "runs")])
def test_sebp_kernel_setting_names_the_backward(kernel, backend):
    from edgetune.engine.core.settings import SEBP_KERNELS

    assert set(SEBP_KERNELS) == set(sebp.KERNELS)
    gen = torch.Generator().manual_seed(31)
    model = Holder(nn.Linear(16, 8, bias=False))
    mask = pad_mask("right", 2, 6)
    x, dy = torch.randn(2, 6, 16, generator=gen), torch.randn(2, 6, 8, generator=gen)
    _, dx_ref, _ = grads_of(model, x, dy * mask[..., None], [])
    with sebp.enabled(model, True, kernel) as h:
        assert model._sebp_handle.backend == backend
        h.set_active_rows(mask)
        assert ("runs" in h._patch.rows.__dict__) == (backend == "runs")  # built before the layers run
        _, dx, _ = grads_of(model, x, dy, [])
    assert rel(dx, dx_ref) <= 1e-5 and (dx[~mask] == 0).all()
