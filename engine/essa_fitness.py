"""ESSA's continuous fitness: how likely a candidate makes each row's gold answer.

With `essa.fitness: reward` a candidate's fitness is the mean reward of its greedy
completions on a generation's prompts. On a small model and a 0/1 reward that is a
coarse number (1/P steps for P prompts): most candidates of a generation score the same,
and CMA-ES gets no ranking from them (bench/RESULTS.md, "Learning on unseen tasks").

`gold_logprob` scores instead the row's answer written as `essa.gold_template` (e.g.
"Answer: {answer}", the way the warm start's demonstrations state it) and ended with the
end-of-turn token, teacher-forced after the prompt: one forward pass, no decoding. A
row's score is the mean log-probability per token of that text; the fitness is the mean
over rows. It moves with every small change of the weights, so candidates are ranked.

`reward+gold_logprob` keeps the reward first and breaks its ties with the gold answer:
mean reward + exp(mean gold log-prob per token) / (P + 1), which stays below one
prompt's worth (1/P) of a 0/1 reward, so it never reorders candidates the reward ranks.
"""

from __future__ import annotations

import math

import torch

from .rollouts import left_pad, render_prompts


def gold_texts(rows: list[dict], template: str) -> list[str]:
    """Each row's gold answer in the template's words."""
    try:
        return [template.format(answer=r["answer"]) for r in rows]
    except KeyError as e:
        raise ValueError(f"essa.gold_template: a row has no 'answer', or the template names {e}") from None


def gold_batch(tok, rows: list[dict], template: str, system_prompt: str, device):
    """Left-padded prompts and right-padded gold completions (each ended by EOS)."""
    prompts = render_prompts(tok, [r["prompt"] for r in rows], system_prompt)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    golds = [list(tok(t, add_special_tokens=False)["input_ids"]) + ([eos] if eos is not None else [])
             for t in gold_texts(rows, template)]
    prompt_ids, prompt_mask = left_pad(prompts, pad, device)
    T = max(len(g) for g in golds)
    ids = torch.full((len(golds), T), pad, dtype=torch.long)
    mask = torch.zeros((len(golds), T), dtype=torch.long)
    for i, g in enumerate(golds):
        ids[i, : len(g)] = torch.tensor(g, dtype=torch.long)
        mask[i, : len(g)] = 1
    return prompt_ids, prompt_mask, ids.to(device), mask.to(device)


@torch.inference_mode()
def gold_logprob(model, batch, copies: int = 1) -> list[float]:
    """Mean per-token log-prob of the gold text of every row, for `copies` blocks of the
    batch's rows in one forward (copy j = candidate j under engine/multilora.py), as
    [copies * rows] floats, candidate-major."""
    from .fgrpo import completion_logprobs

    prompt_ids, prompt_mask, ids, mask = (t.repeat(copies, 1) for t in batch)
    lp = completion_logprobs(model, prompt_ids, prompt_mask, ids, mask)
    per_row = (lp * mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_row.float().cpu().tolist()


def combine(kind: str, rewards: list[float] | None, gold: list[float] | None) -> float:
    """A candidate's fitness from its rows' rewards and gold log-probs (see the module doc)."""
    if kind == "reward":
        return float(sum(rewards) / len(rewards)) if rewards else 0.0
    g = float(sum(gold) / len(gold)) if gold else -math.inf
    if kind == "gold_logprob":
        return g
    r = float(sum(rewards) / len(rewards)) if rewards else 0.0
    return r + math.exp(g) / (len(gold) + 1)
