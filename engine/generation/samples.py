"""Held-out prompts shown with the model's greedy completion and the reference, at each
evaluation of the methods that train on demonstrations or pairs (sft.samples, dpo.samples)."""

from __future__ import annotations

import torch

from edgetune.engine.data import IGNORE

from edgetune.engine.generation.rollouts import generate

# Samples at each evaluation complete at most this many tokens past the reference's
# length, and never more than SAMPLE_MAX_TOKENS: a few short greedy completions, so they
# stay cheap beside the held-out loss, even on the CPU.
SAMPLE_SLACK_TOKENS, SAMPLE_MAX_TOKENS = 8, 64


def sample_prompts(examples, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference ids) of the first `n` held-out examples that have a prompt:
    the tokens before the first target token, and that first run of target tokens (the
    first reply). Plain-text rows (every token a target) have no prompt and are skipped."""
    out = []
    for ex in examples:
        first = next((i for i, v in enumerate(ex.labels) if v != IGNORE), None)
        if not first:  # no target, or no prompt before it
            continue
        end = next((i for i in range(first, len(ex.labels)) if ex.labels[i] == IGNORE), len(ex.labels))
        out.append((ex.input_ids[:first], ex.input_ids[first:end]))
        if len(out) == n:
            break
    return out


@torch.no_grad()
def complete_samples(model, tok, picks: list[tuple[list[int], list[int]]]) -> tuple[list[str], list[str], list[str]]:
    """(prompts, greedy completions, references) as text. On a GPU the plain decode loop:
    no CUDA-graph capture nor bf16 copy of the base for a handful of short completions; on
    the CPU rollouts.generate's choice (its fp32 copy of the base, kept between calls)."""
    cap = min(SAMPLE_MAX_TOKENS, max(len(ref) for _, ref in picks) + SAMPLE_SLACK_TOKENS)
    cpu = next(model.parameters()).device.type == "cpu"
    roll = generate(model, tok, [p for p, _ in picks], max_new_tokens=cap, greedy=True, fast=None if cpu else False)

    def text(ids):
        return tok.decode(ids, skip_special_tokens=True).strip()
    return [last_turn(tok, p) for p, _ in picks], [t.strip() for t in roll.texts], [text(r) for _, r in picks]


ROLES = ("system", "user", "assistant", "model", "human")


def last_turn(tok, prompt_ids: list[int]) -> str:
    """The text of a rendered prompt's last turn (the user's question), without the chat
    template's system prompt and role markers: the pieces between its special tokens, less
    those that only name a role. A template without special tokens gives the whole text."""
    specials = set(tok.all_special_ids)
    pieces, cur = [], []
    for i in [*prompt_ids, None]:
        if i is None or i in specials:
            text = tok.decode(cur).strip()
            first, _, rest = text.partition("\n")
            text = rest.strip() if first.strip().lower() in ROLES else text
            if text and text.lower() not in ROLES:
                pieces.append(text)
            cur = []
        else:
            cur.append(i)
    return pieces[-1] if pieces else tok.decode(prompt_ids, skip_special_tokens=True).strip()
