"""What one decoder layer keeps for its backward: the bytes autograd saves inside it,
for checking engine/planning/planner.py's layer_activation_bytes against a real model
(tests/test_planner.py without Liger, tests/test_liger.py with it)."""

from __future__ import annotations

import contextlib

import torch


def tiny_nf4_qwen2(folder, embedded_dir):
    """(PEFT model in train mode, Config): a 2-layer Qwen2 saved to `folder`, loaded by the
    engine in NF4 with bf16 compute on the CPU and LoRA r=16 on all 7 projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from edgetune.engine.core.settings import resolve

    from edgetune.engine.models import model as model_lib

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512)).save_pretrained(folder)
    model_lib.load_tokenizer(str(embedded_dir)).save_pretrained(folder)
    cfg = resolve(overrides=[f"model.name={folder}", "model.quant=nf4", "model.device=cpu", "model.dtype=bf16",
                             "model.gradient_checkpointing=false", "lora.r=16"])
    model, _, _ = model_lib.load(cfg)
    model.train()
    return model, cfg


def saved_bytes_of_first_layer(model, ids, mask=None, autocast: bool = False) -> int:
    """Bytes of the tensors autograd saves inside decoder layer 0 during one forward
    (parameters and their views excluded), optionally under CPU bf16 autocast (standing
    in for the engine's CUDA autocast)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layer = model.get_base_model().model.layers[0]
    inside, saved = [False], {}

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = [layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True)),
             layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))]
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    return sum(saved.values())
