"""Sampling and the plain decode loop: what rollouts.generate and the static loop
(fast_decode.py) share, so that neither imports the other's module.

Sampling is Gumbel-max (`probs / Exp(1)` then argmax) from one seeded `torch.Generator`:
no host sync per token, reproducible for a seed, the same in both loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from edgetune.engine.core import distributed as dist


@dataclass
class Sampler:
    """Picks the next token from last-position logits [B, V]; shared by both loops."""

    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    generator: torch.Generator | None = None

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        logits = logits.float()
        scaled = logits / self.temperature
        if self.top_p < 1.0:
            scaled = top_p_filter(scaled, self.top_p)
        logp = torch.log_softmax(scaled, dim=-1)
        if self.greedy:
            # argmax of the raw logits, as model.generate(do_sample=False) does
            tok = logits.argmax(dim=-1)
        else:
            # Gumbel-max: argmax p / E, E ~ Exp(1), is an exact categorical draw without
            # multinomial's host sync; -inf (outside the nucleus) gives p = 0, never chosen.
            e = torch.empty_like(logp).exponential_(generator=self.generator)
            tok = (logp.exp() / e).argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def top_p_filter(scaled: Tensor, top_p: float) -> Tensor:
    """Set logits outside the nucleus to -inf (the HF TopPLogitsWarper rule: drop the
    low-probability tail whose mass is <= 1 - top_p, always keep the top token)."""
    sorted_logits, sorted_idx = torch.sort(scaled, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)
    remove[..., -1] = False
    return scaled.masked_fill(remove.scatter(-1, sorted_idx, remove), float("-inf"))


def make_generator(device, seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


# --------------------------------------------------------------------------- plain loop


def inner_model(model):
    """The transformers model under a PEFT wrapper (LoRA modules stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@torch.no_grad()
def decode_plain(model, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int, sampler: Sampler,
                 eos_id: int, pad_id: int, lockstep: bool = False) -> tuple[Tensor, Tensor]:
    """(completion_ids [B, T], logprobs [B, T]) with the model's own forward and a
    DynamicCache; positions and masks are built as model.generate builds them.
    lockstep: the ranks of a sharded base (engine/models/fsdp.py) decode until every rank's rows
    are done (each forward gathers every layer from all ranks); finished rows get pad."""
    from transformers import DynamicCache

    core = inner_model(model)
    B, P = prompt_ids.shape
    dev = prompt_ids.device
    cache = DynamicCache(config=core.config)
    attn = prompt_mask.clone()
    pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    toks, lps = [], []
    inp, step_pos = prompt_ids, pos
    for t in range(max_new_tokens):
        out = core(input_ids=inp, attention_mask=attn, position_ids=step_pos, use_cache=True, logits_to_keep=1,
                   **{cache_kw(core): cache})
        tok, lp = sampler(out.logits[:, -1, :])
        tok = tok.masked_fill(done, pad_id)
        lps.append(lp.masked_fill(done, 0.0))
        toks.append(tok)
        done = done | (tok == eos_id)
        # one host sync per token: the plain loop is the CPU/reference path
        if not dist.any_rank(not bool(done.all())) if lockstep else bool(done.all()):
            break
        inp = tok[:, None]
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, attn.new_ones(B, 1)], dim=1)
    return torch.stack(toks, 1), torch.stack(lps, 1)


def cache_kw(core) -> str:
    """transformers >= 5.2x names the cache argument `cache` (`past_key_values` is deprecated)."""
    import inspect

    return "cache" if "cache" in inspect.signature(core.forward).parameters else "past_key_values"
