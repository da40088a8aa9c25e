"""ESSA's continuous fitness: how likely a candidate makes each row's gold answer.

With `essa.fitness: reward` a candidate's fitness is the mean reward of its greedy
completions on a generation's prompts. On a small model and a 0/1 reward that is a
coarse number (1/P steps for P prompts): most candidates of a generation score the same,
and CMA-ES gets no ranking from them (bench/README.md).

`gold_logprob` scores instead the row's answer written as `essa.gold_template` (e.g.
"Answer: {answer}", the way the warm start's demonstrations state it) and ended with the
end-of-turn token, teacher-forced after the prompt: one forward pass, no decoding. A
row's score is the mean log-probability per token of that text; the fitness is the mean
over rows. It moves with every small change of the weights, so candidates are ranked.

`reward+gold_logprob` keeps the reward first and breaks its ties with the gold answer:
mean reward + exp(mean gold log-prob per token) / (P + 1), which stays below one
prompt's worth (1/P) of a 0/1 reward, so it never reorders candidates the reward ranks.

`gold_margin` asks what the held-out greedy success asks: does greedy decoding write the
right answer? Teacher-forced on the gold text, greedy writes the answer exactly when each
of the answer's own tokens has the highest logit there. A row's margin is the smallest,
over the answer's tokens (those of {answer}; the template's words around it are read but
not scored), of the gold token's logit minus the best other token's (in nats of
log-probability: positive = greedy, once it has written the template's lead-in, writes
the right answer); the fitness is the mean over rows of sigmoid(margin), a soft count of
the rows greedy answers right. The template's words are left out because a warm start
that does not yet use them ("The GCD of 4 and 6 is 2" instead of "Answer: 2") would make
its first word the smallest margin of every row, and the search would then chase the
wording instead of the answers (as it did on gcd: bench/README.md). Where gold_logprob
rewards raising the gold text's probability anywhere (also on rows greedy still gets
wrong, and on rows already right), the margin moves most with rows near the point where
greedy flips. Like gold_logprob it is one forward pass: far cheaper a prompt than
decoding, so a generation can score more prompts (the fitness of few prompts ranks
candidates by noise: bench/essa_noise.py). What it cannot see: how the free-running
answer begins. On count_bits a search raised the soft count while the adapter came to open
most held-out answers with its system prompt's words (bench/README.md), so it is a
setting, not the default. `reward+gold_margin` keeps the free-running reward first and lets
the soft count only break its ties (below one prompt's worth, as reward+gold_logprob).
The margin kinds find the answer's tokens by the tokenizer's character offsets, which only
fast tokenizers give: a run with a slow one is refused at its start (engine/methods/essa/essa.py).
"""

from __future__ import annotations

import math

import torch

from edgetune.engine.planning.effective import LOSS_CHUNK_ROWS

from edgetune.engine.generation.rollouts import left_pad, render_prompts

from edgetune.engine.training.lm_loss import completion_hidden, completion_logprobs


def parts(kind: str) -> tuple[bool, str | None]:
    """What an `essa.fitness` kind is made of: (uses the reward of greedy completions, the
    gold score it uses: "gold_logprob", "gold_margin" or None)."""
    if kind == "reward":
        return True, None
    _, plus, gold = kind.partition("+")  # "reward+<gold>" or "<gold>"
    return (True, gold) if plus else (False, kind)


def gold_texts(rows: list[dict], template: str) -> list[str]:
    """Each row's gold answer in the template's words."""
    try:
        return [template.format(answer=r["answer"]) for r in rows]
    except KeyError as e:
        raise ValueError(f"essa.gold_template: a row has no 'answer', or the template names {e}") from None


def answer_span(template: str, answer: str) -> tuple[int, int]:
    """Characters of the (last) {answer} in the template written with this answer."""
    lead = template.rpartition("{answer}")[0]
    start = len(lead.format(answer=answer))
    return start, start + len(answer)


def gold_batch(tok, rows: list[dict], template: str, system_prompt: str, device, answer_tokens: bool = True):
    """Left-padded prompts, right-padded gold completions (each ended by EOS), and which
    completion tokens spell the answer: (prompt_ids, prompt_mask, ids, mask, answer_mask).
    answer_tokens=False: answer_mask all False, and no character offsets asked for (which
    only fast tokenizers give; gold_logprob does not need them)."""
    prompts = render_prompts(tok, [r["prompt"] for r in rows], system_prompt)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    golds, answers = [], []
    for row, text in zip(rows, gold_texts(rows, template)):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=answer_tokens)
        start, end = answer_span(template, str(row["answer"]))
        golds.append(list(enc["input_ids"]) + ([eos] if eos is not None else []))
        spans = enc["offset_mapping"] if answer_tokens else [(0, 0)] * len(enc["input_ids"])
        answers.append([a < end and b > start for a, b in spans] + [False])
    prompt_ids, prompt_mask = left_pad(prompts, pad, device)
    T = max(len(g) for g in golds)
    ids = torch.full((len(golds), T), pad, dtype=torch.long)
    mask = torch.zeros((len(golds), T), dtype=torch.long)
    answer = torch.zeros((len(golds), T), dtype=torch.bool)
    for i, (g, a) in enumerate(zip(golds, answers)):
        ids[i, : len(g)] = torch.tensor(g, dtype=torch.long)
        mask[i, : len(g)] = 1
        answer[i, : len(g)] = torch.tensor(a[: len(g)])
    return prompt_ids, prompt_mask, ids.to(device), mask.to(device), answer.to(device)


@torch.inference_mode()
def gold_logprob(model, batch, copies: int = 1) -> list[float]:
    """Mean per-token log-prob of the gold text of every row, for `copies` blocks of the
    batch's rows in one forward (copy j = candidate j under engine/generation/multilora.py), as
    [copies * rows] floats, candidate-major."""
    prompt_ids, prompt_mask, ids, mask = (t.repeat(copies, 1) for t in batch[:4])
    lp = completion_logprobs(model, prompt_ids, prompt_mask, ids, mask)
    per_row = (lp * mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_row.float().cpu().tolist()


@torch.inference_mode()
def gold_margin(model, batch, copies: int = 1, chunk_rows: int = LOSS_CHUNK_ROWS) -> list[float]:
    """Per row, the smallest margin over its scored tokens of the gold token's logit over
    the best other token's (> 0: greedy writes them), [copies * rows] floats,
    candidate-major as gold_logprob. The scored tokens: the batch's fifth tensor (the
    answer's tokens, from gold_batch), or every completion token of a 4-tensor batch."""
    prompt_ids, prompt_mask, ids, mask = (t.repeat(copies, 1) for t in batch[:4])
    scored = (batch[4] if len(batch) > 4 else batch[3].bool()).repeat(copies, 1)
    hs, ys, keep, head = completion_hidden(model, prompt_ids, prompt_mask, ids, mask)
    scored = keep & scored[:, : keep.shape[1]]
    hs, ys = hs[scored[keep]], ys[scored[keep]]  # the head only where a margin is wanted
    margins = []
    for s in range(0, hs.shape[0], chunk_rows):  # [chunk, vocab] logits at a time, not [tokens, vocab]
        logits = torch.nn.functional.linear(hs[s:s + chunk_rows], head.weight).float()
        y = ys[s:s + chunk_rows, None]
        gold = logits.gather(-1, y).squeeze(-1)
        margins.append(gold - logits.scatter(-1, y, -math.inf).amax(-1))
    per_token = torch.full(keep.shape, math.inf, device=hs.device)
    if margins:
        per_token = per_token.masked_scatter(scored, torch.cat(margins))
    return per_token.amin(1).cpu().tolist()


def _sigmoid(m: float) -> float:
    return 1.0 / (1.0 + math.exp(-m)) if m >= 0 else math.exp(m) / (1.0 + math.exp(m))


def combine(kind: str, rewards: list[float] | None, gold: list[float] | None) -> float:
    """A candidate's fitness from its rows' rewards and gold scores: log-probs, or margins
    for the gold_margin kinds (see the module doc)."""
    with_reward, score = parts(kind)
    r = float(sum(rewards) / len(rewards)) if rewards else 0.0
    if score is None:
        return r
    if score == "gold_margin":  # gold holds the rows' margins: a soft count of right rows, in [0, 1]
        g = float(sum(_sigmoid(m) for m in gold) / len(gold)) if gold else 0.0
    else:  # mean log-prob per token; exp() of it, in [0, 1], is what breaks a reward's ties
        g = float(sum(gold) / len(gold)) if gold else -math.inf
    if not with_reward:
        return g
    return r + (g if score == "gold_margin" else math.exp(g)) / (len(gold) + 1)
