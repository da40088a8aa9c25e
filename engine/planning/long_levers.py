"""The memory planner's model of the long-sequence levers that change one layer's
activations (engine/planning/planner.py calls these; engine/planning/long_context.py has
the rest: what grows, the longest length that fits, the refusal). Imports no torch.

- model.mlp_chunk_tokens: the MLP runs on that many tokens at a time, each chunk
  recomputed in the backward (engine/models/long_context.py): its [tokens, intermediate]
  activations and gradients exist for one chunk, and the layer keeps the MLP's input.
- model.mask_free_attention: no [tokens, tokens] mask for packed or padded rows, keys and
  values at their grouped width (the planner's `masked` is then false).
"""

from __future__ import annotations


def levers_of(cfg, ctx) -> None:
    """Set the planner context's lever fields from `cfg`."""
    ctx.mlp_chunk = int(getattr(cfg.model, "mlp_chunk_tokens", 0) or 0)
    ctx.mask_free = bool(getattr(cfg.model, "mask_free_attention", False))


def mlp_tokens(ctx, tokens: int) -> int:
    """The tokens the MLP works on at once: a chunk, or the whole sequence."""
    return min(tokens, ctx.mlp_chunk) if ctx.mlp_chunk else tokens


def mlp_share(ctx, tokens: int) -> int:
    """The part of planner.layer_activation_bytes that the MLP keeps for `tokens` tokens:
    gate, up, act(gate) (act * up, read by down's adapter, with a bf16 residual), the
    adapters' copies of the MLP projections' inputs and their rank-r intermediates."""
    a, b = ctx.arch, ctx.act_bytes
    i = a.intermediate * (a.experts_per_token or 1)
    dims = a.projections()
    copy_bytes = ctx.compute_bytes if ctx.autocast else 4
    targets = [t for t in ("gate_proj", "up_proj", "down_proj") if t in ctx.targets]
    if b >= 4:
        per = b * (3 * i + (i if "down_proj" in targets else 0))
    else:
        per = copy_bytes * sum(dims[t][0] for t in targets) + b * 3 * i - (b * i if ctx.liger else 0)
    return tokens * (per + len(targets) * ctx.r * copy_bytes)


def chunked_layer(ctx, tokens: int, full: int) -> int:
    """One layer's saved activations (`full`: the planner's count for the whole sequence at
    once) when the MLP runs in chunks: the MLP's share is gone, its input is kept."""
    if mlp_tokens(ctx, tokens) == tokens:
        return full
    return full - mlp_share(ctx, tokens) + tokens * ctx.arch.hidden * ctx.act_bytes


def chunk_recompute(ctx, tokens: int) -> int:
    """What the backward of one MLP chunk adds to a layer's recompute: that chunk's share."""
    n = mlp_tokens(ctx, tokens)
    return mlp_share(ctx, n) if n < tokens else 0
