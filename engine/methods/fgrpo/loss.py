"""Group-relative policy losses (GRPO, DAPO, Dr. GRPO, CISPO) with F-GRPO's focal weights.

Pure tensor functions, no model: the loop (engine/methods/fgrpo/fgrpo.py) feeds them per-token
log-probs. Definitions follow TRL's `GRPOTrainer` (1.16) so that identical inputs give
identical losses (tests/test_grpo_loss.py checks this against TRL's own code):

    A_i   = (r_i - mean_group(r)) / (std(r) + eps)      std: per group (unbiased), over the
                                                        batch, or none (no division)
    g     = (1 - p̂) ** gamma per group, p̂ = share of the group's completions that
            succeed; F-GRPO multiplies the group's advantages by g (no gradient).
            gamma = 0 gives g = 1 everywhere (0 ** 0 = 1), i.e. plain GRPO.
    ρ     = exp(logp - logp_old) per token
    clip  : -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A)        grpo, dapo, dr_grpo
    cispo : -stopgrad(min(ρ, ε_high)) A logp                ε_high is an absolute cap here
    KL    : β (exp(ref - logp) - (ref - logp) - 1), added per token
    grpo  : mean over sequences of each sequence's token mean
    dapo  : sum over all completion tokens / number of completion tokens (cispo too)
    dr_grpo: sum / (sequences · max_completion_length)

Micro-batching: the loop splits a rollout batch into micro-batches to bound activation
memory. The normalisers (`num_sequences`, `num_tokens`) can be given for the whole
batch, so the micro-batch losses *sum* to the full-batch loss exactly and accumulating
their gradients costs no approximation, whatever the split. With β = 0 a sequence of
zero advantage contributes exactly zero gradient, so the loop may drop it from the
backward batch while still counting it in the normalisers: same gradient, less compute.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "cispo")


def group_advantages(rewards: torch.Tensor, G: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Rewards of B groups of G adjacent completions -> one advantage per completion."""
    if rewards.dim() != 1 or rewards.numel() % G:
        raise ValueError(f"rewards must be 1-D with a multiple of G={G} entries, got {tuple(rewards.shape)}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    grouped = r.view(-1, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    if scale == "group":
        # A group of one has no spread: std 0 rather than NaN.
        std = grouped.std(dim=1, keepdim=True) if G > 1 else torch.zeros_like(grouped[:, :1])
        std = std.expand_as(grouped).reshape(-1)
    elif scale == "batch":
        std = r.std() if r.numel() > 1 else torch.zeros(())
    else:
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    return centred / (std + eps)


def success_share(success: torch.Tensor, G: int) -> torch.Tensor:
    """p̂ per group: the share of its completions that succeed; shape [B]."""
    return success.float().view(-1, G).mean(dim=1)


def focal_weights(rewards: torch.Tensor, G: int, gamma: float, threshold: float | None = None,
                  success: torch.Tensor | None = None, normalize: bool = False) -> torch.Tensor:
    """g = (1 - p̂) ** gamma for every completion of a group; shape [B*G], no gradient.

    Success is `success` when given (engine/training/rewards.py decides it for weighted sums),
    else reward >= threshold, and threshold None = 1.0: the maximum of a 0/1 reward.
    normalize: g divided by its mean over the groups whose rewards differ (the only ones with an
    advantage), so the weights move the step from prompts the model solves to those it does not
    without making the whole step smaller; a step with no such group, or where all their g are 0,
    is left as it is.
    """
    if success is None:
        success = rewards >= (1.0 if threshold is None else threshold)
    p = success_share(success.to(rewards.device), G)
    g = torch.pow(1.0 - p, gamma)  # torch.pow(0, 0) == 1: gamma = 0 is plain GRPO
    if normalize:
        r = rewards.view(-1, G)
        informative = (r != r[:, :1]).any(dim=1)
        if informative.any():
            mean = g[informative].mean()
            if mean > 0:
                g = g / mean
    return g.repeat_interleave(G).detach()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Loss of one (micro-)batch. logp/old_logp/ref_logp/mask: [B, T]; advantages: [B].

    max_completion_length (dr_grpo): None = T. num_sequences / num_tokens: the
    normalisers of the whole rollout batch when this is one micro-batch of it
    (None = this batch's own B / completion tokens).
    Metrics (floats over this batch's completion tokens): clip_ratio (share of tokens
    whose update the clip removed; for cispo, whose ratio hit the cap), clip_low,
    clip_high, kl (mean per-token KL to the reference, when given), ratio (mean ρ),
    tokens (count, to weight the means when combining micro-batches).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp)

    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logp
        clipped_high = (ratio > epsilon_high) & (adv > 0)
        clipped_low = torch.zeros_like(clipped_high)
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        clipped_low = (ratio < 1 - epsilon) & (adv < 0)
        clipped_high = (ratio > 1 + epsilon_high) & (adv > 0)

    kl = None
    if ref_logp is not None:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        if beta != 0.0:
            per_token = per_token + beta * kl
    elif beta != 0.0:
        raise ValueError("beta > 0 needs ref_logp")

    masked = per_token * mask
    B = logp.shape[0]
    if loss_type == "grpo":
        seq_mean = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = seq_mean.sum() / (num_sequences or B)
    elif loss_type in ("dapo", "cispo"):
        n = num_tokens if num_tokens is not None else mask.sum()
        loss = masked.sum() / max(float(n), 1.0)
    else:  # dr_grpo
        L = max_completion_length or logp.shape[1]
        loss = masked.sum() / ((num_sequences or B) * L)

    with torch.no_grad():
        tokens = float(mask.sum())
        denom = max(tokens, 1.0)

        def mean(x: torch.Tensor) -> float:
            return float((x.to(mask.dtype) * mask).sum() / denom)

        metrics = {
            "clip_ratio": mean(clipped_low | clipped_high),
            "clip_low": mean(clipped_low),
            "clip_high": mean(clipped_high),
            "ratio": mean(ratio),
            "kl": mean(kl) if kl is not None else 0.0,
            "tokens": tokens,
        }
    return loss, metrics
