"""Long sequences on one card: the MLP in chunks along the sequence, and attention with no
[tokens, tokens] mask. Both give the loss and gradients of the plain step (up to float
rounding; tests/test_long_context.py checks them on a tiny model) and are off by default.

What grows with the sequence at batch 1 (docs/performance.md has the planner's table):
with checkpointing, the backward of one layer recomputes its activations for the whole
sequence, and the widest of them are the MLP's: gate, up, act(gate) * up and their
gradients, each [tokens, intermediate] (18,944 wide on a 7B, 29,568 on a 72B, five to
eight times the hidden size). `chunk_mlp` runs each layer's MLP on `n` tokens at a time,
each chunk under its own checkpoint: the forward keeps only the MLP's input, and the
backward recomputes one chunk's intermediates at a time (`model.mlp_chunk_tokens`).
With LoRA dropout on, the chunks draw their dropout masks chunk by chunk: the same
distribution as one pass, not the same draws.

Packed rows (or padded ones) through sdpa get a dense boolean [tokens, tokens] mask
(17 GB at 131,072 tokens) and keys and values repeated to every query head.
`mask_free_attention` calls SDPA once per document instead (the position ids restart at 0
at each packed row's start; a padded row stops at its last token) with `is_causal` and
grouped keys and values: no mask, and on CUDA only the flash / memory-efficient kernels,
whose memory is linear in the length (`model.mask_free_attention`). It is switched on
around the training step only: generation, with its KV cache and left padding, keeps the
model's own attention.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MASK_FREE = "edgetune_mask_free"  # the name the attention function is registered under in transformers

# --------------------------------------------------------------------------- MLP in chunks


def _chunked(forward, n: int):
    def run(x, *args, **kwargs):
        if x.shape[-2] <= n:
            return forward(x, *args, **kwargs)
        parts = []
        for s in range(0, x.shape[-2], n):
            part = x[..., s : s + n, :]
            if torch.is_grad_enabled():  # the backward recomputes this chunk's intermediates
                parts.append(checkpoint(forward, part, *args, use_reentrant=False, **kwargs))
            else:
                parts.append(forward(part, *args, **kwargs))
        return torch.cat(parts, dim=-2)

    run.chunk_tokens = n
    return run


def chunk_mlp(model, n: int) -> int:
    """Run the MLP of every decoder layer of `model` (PEFT or plain HF) on `n` tokens of the
    sequence at a time, each chunk checkpointed. Returns how many MLPs were wrapped."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if n <= 0:
        return 0
    count = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None) if isinstance(layer, GradientCheckpointingLayer) else None
        if mlp is None:
            continue
        if getattr(mlp.forward, "chunk_tokens", None) is None:
            mlp.forward = _chunked(mlp.forward, n)
        count += 1
    if count == 0:
        raise RuntimeError("model.mlp_chunk_tokens: this model's decoder layers have no `mlp` module")
    return count


# --------------------------------------------------------------------------- attention without a mask


def _segments(pos: torch.Tensor | None, length: int, total: int) -> list[tuple[int, int]]:
    """[start, end) of each causal segment of one row: the documents of a packed row (its
    position ids restart at 0), up to `length` real tokens, then the padding as one more."""
    starts = [0]
    if pos is not None:
        starts += [s for s in (pos[:length] == 0).nonzero().flatten().tolist() if s > 0]
    cuts = starts + [length]
    out = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    if length < total:
        out.append((length, total))
    return out


def _sdpa(q, k, v, dropout: float, scale: float | None) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # never the math kernel, which holds [heads, tokens, tokens] scores
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        try:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        except RuntimeError:
            if not gqa:
                raise
            # a kernel without grouped-query support: keys and values repeated for this segment
            rep = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                  dropout_p=dropout, is_causal=True, scale=scale)


def _dense(query, key, value, attention_mask, dropout: float, scale: float | None) -> torch.Tensor:
    """The exact masked path, for what the segments do not cover (a KV cache, left padding)."""
    tq, tk = query.shape[2], key.shape[2]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -tk:].bool()
    mask = mask | ~mask.any(-1, keepdim=True)  # a query with nothing to see (padding) sees all: finite
    rep = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1),
                                          attn_mask=mask, dropout_p=dropout, scale=scale)


def mask_free_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                scaling: float | None = None, position_ids=None, **kwargs):
    """transformers' attention interface: query [B, H, T, D], key / value [B, KV, T, D];
    `attention_mask` is the 2D padding mask or None (flash_attention_mask's, registered
    with it). Returns ([B, T, H, D], None)."""
    B, _, T, _ = query.shape
    lengths = [T] * B
    if attention_mask is not None:
        m = attention_mask[:, -key.shape[2]:].bool()
        lengths = m.sum(-1).tolist()
        right_padded = all(bool(m[b, :n].all()) for b, n in enumerate(lengths))
    if key.shape[2] != T or (attention_mask is not None and not right_padded):
        out = _dense(query, key, value, attention_mask, dropout, scaling)
        return out.transpose(1, 2).contiguous(), None
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids[None]
    rows = []
    for b in range(B):
        pos = None if position_ids is None else position_ids[b if position_ids.shape[0] > 1 else 0]
        parts = [_sdpa(query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e], dropout, scaling)
                 for s, e in _segments(pos, lengths[b], T)]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if B == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(MASK_FREE, mask_free_attention_forward)
    # the 2D padding mask (None when there is none) is all it reads: no [T, T] mask is built
    AttentionMaskInterface.register(MASK_FREE, flash_attention_mask)


@contextlib.contextmanager
def mask_free_attention(model, on: bool = True):
    """Inside, `model`'s attention is mask_free_attention_forward (the forward and the
    backward's recompute of a training step); the model's own attention afterwards."""
    if not on:
        yield
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    before = base.config._attn_implementation
    _register()
    base.set_attn_implementation(MASK_FREE)
    try:
        yield
    finally:
        base.set_attn_implementation(before)
