"""Rollouts: sample completions (with their log-probs and masks) for F-GRPO and ESSA.

One entry point, `generate`, over any causal LM (PEFT LoRA or plain, NF4 or not, CPU or
CUDA). Two decode loops sit behind it:

- the plain loop (`decoding.py`): the model's own forward with a growing `DynamicCache`, exactly
  what `model.generate` does, so greedy outputs match it token for token. It keeps every
  row until all rows are done (finished rows are fed pad and masked out): the batch
  dimension never changes order, so per-row adapters (ESSA's batched candidates) stay
  aligned. Cost: finished rows still take compute until the last row stops.
- the static loop (`fast_decode.py`): a pre-allocated KV cache and one decode step that is
  captured once as a CUDA graph and replayed. Used automatically on CUDA for the model
  families it knows (Llama / Qwen2 / Qwen3 / Mistral layouts); see that module for the
  memory it takes (the static cache, and optionally a bf16 copy of NF4 base weights).

Sampling is Gumbel-max (`probs / Exp(1)` then argmax) from one seeded `torch.Generator`
on the model's device: no host sync per token, reproducible for a seed, and the same in
both loops. The log-prob of a sampled token is under the distribution it was drawn from:
`log_softmax(logits / temperature)` restricted to the top-p nucleus and renormalised.
LoRA is never merged: the adapters read their live trainable weights.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from edgetune.engine.data.prompts import prompt_ids

from edgetune.engine.generation.decoding import Sampler, decode_plain, make_generator


@dataclass
class RolloutBatch:
    prompt_ids: Tensor  # [B, P] left-padded with pad_token_id
    prompt_mask: Tensor  # [B, P]
    completion_ids: Tensor  # [B, T] right-padded with pad after EOS
    completion_mask: Tensor  # [B, T] 1 for generated tokens up to and including the first EOS
    logprobs: Tensor  # [B, T] log-prob of each sampled token under the sampling distribution; 0 where mask is 0
    texts: list[str]  # decoded completions (special tokens skipped)
    prompt_index: list[int]  # which input prompt each row belongs to (the G rows of one prompt are adjacent)
    truncated: list[bool]  # hit max_new_tokens without EOS
    # how the rows were decoded (fast loop or not, CUDA graph, bf16 copy, capture time, why
    # a graph could not be captured): for benches and the run log
    info: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- prompts


def render_prompts(tokenizer, prompts: list, system_prompt: str = "") -> list[list[int]]:
    """Token ids of each prompt (a string or chat messages), ready for the assistant's
    turn: engine/data/prompts.py, the renderer SFT data and the chat panel use too."""
    return prompt_ids(tokenizer, prompts, system_prompt)


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, P - len(r):] = 1
    return ids.to(device), mask.to(device)


# --------------------------------------------------------------------------- sampling


# --------------------------------------------------------------------------- entry point


@contextlib.contextmanager
def _eval_mode(model):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def finish(completion: Tensor, logprobs: Tensor, eos_id: int, pad_id: int):
    """Masks (up to and including the first EOS), pad after it, truncation flags."""
    is_eos = completion == eos_id
    # rows of tokens strictly after the first EOS
    after = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    mask = (~after).long()
    completion = completion.masked_fill(after, pad_id)
    logprobs = logprobs.masked_fill(after, 0.0)
    truncated = (~is_eos.any(1)).tolist()
    return completion, mask, logprobs, truncated


def generate(model, tokenizer, prompts, *, num_generations: int = 1, max_new_tokens: int = 48,
             temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, seed: int | None = None,
             batch_size: int = 0, system_prompt: str = "", fast: bool | None = None,
             bf16_weights: bool | None = None, dense_layers: int | None = None, memory_budget: int | None = None,
             nf4_kernel: str = "off", on_chunk: Callable[[list[int]], None] | None = None) -> RolloutBatch:
    """Sample `num_generations` completions per prompt (rows of one prompt adjacent).

    prompts: strings / chat-message lists (rendered with the chat template), or lists of
    token ids (used as is). batch_size: rows per decode batch (0 = all rows at once);
    chunks keep row order. fast: None = the CUDA-graph static loop when the model is on
    CUDA and of a known layout, else the plain loop; True insists (error if impossible);
    False forces the plain loop. bf16_weights (fast loop only): None = dequantise NF4 base
    weights to a temporary packed bf16 copy when the GPU has room for it (see
    fast_decode.py). dense_layers (fast loop, NF4 base): the bf16 copy for the first that many decoder
    layers only (None: all when they fit, else as many as fit). memory_budget: bytes the
    process may hold (model.memory_budget_gib); the copy stays within it as well as within
    the free memory. nf4_kernel (fast loop, NF4 base; Effective.nf4_kernel): off | auto | on,
    NF4 layers without a copy through kernels/nf4_matmul.py instead of bitsandbytes (see
    engine/planning/effective.nf4_decode_base).
    on_chunk(rows): called before each chunk is decoded with the global row indices it
    holds (for per-row adapters).
    """
    if temperature <= 0 and not greedy:
        raise ValueError("temperature must be > 0 (use greedy=True for argmax decoding)")
    if not (0.0 < top_p <= 1.0):
        raise ValueError("top_p must be in (0, 1]")
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    if prompts and isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], int):
        rendered = [list(p) for p in prompts]
    else:
        rendered = render_prompts(tokenizer, prompts, system_prompt)
    rows = [r for r in rendered for _ in range(num_generations)]
    prompt_index = [i for i in range(len(rendered)) for _ in range(num_generations)]
    device = next(model.parameters()).device
    sampler = Sampler(temperature=temperature if temperature > 0 else 1.0, top_p=top_p, greedy=greedy,
                      generator=make_generator(device, seed))

    from edgetune.engine.core import distributed as dist

    from edgetune.engine.models.fsdp import is_sharded

    # A sharded base decodes with the plain loop (each forward gathers the layers), every
    # rank until all ranks' rows are done; the callers give every rank as many chunks.
    lockstep = dist.enabled() and is_sharded(model)
    use_fast = False if lockstep else _pick_fast(model, device, fast)
    info = {"fast": use_fast}
    n = len(rows)
    bs = batch_size if batch_size > 0 else n
    comp_chunks, lp_chunks = [], []
    with _eval_mode(model), contextlib.ExitStack() as stack:
        if use_fast:
            from edgetune.engine.generation import fast_decode

            longest = max(len(r) for r in rows) + max_new_tokens
            # what a chunk needs beside a copy of the base: its static cache and its prefill
            rows_per_chunk = min(bs, n)
            reserve = fast_decode.reserve_bytes(model, rows_per_chunk, max(len(r) for r in rows), longest + 64)
            decoder = stack.enter_context(
                fast_decode.Decoder.for_model(model, bf16_weights=bf16_weights, reserve_bytes=reserve,
                                              dense_layers=dense_layers, memory_budget=memory_budget,
                                              nf4_kernel=nf4_kernel, rows=rows_per_chunk))
            info.update(decoder.info)
        for s in range(0, n, bs):
            idx = list(range(s, min(n, s + bs)))
            if on_chunk is not None:
                on_chunk(idx)
            ids, mask = left_pad([rows[i] for i in idx], pad_id, device)
            if use_fast:
                c, lp = decoder.decode(ids, mask, max_new_tokens, sampler, eos_id, pad_id)
            else:
                c, lp = decode_plain(model, ids, mask, max_new_tokens, sampler, eos_id, pad_id, lockstep=lockstep)
            if use_fast:
                info.update(decoder.info)
            comp_chunks.append(c)
            lp_chunks.append(lp)
    T = max(c.shape[1] for c in comp_chunks)
    completion = torch.cat([_pad_right(c, T, pad_id) for c in comp_chunks])
    logprobs = torch.cat([_pad_right(c, T, 0.0) for c in lp_chunks])
    completion, cmask, logprobs, truncated = finish(completion, logprobs, eos_id, pad_id)
    prompt_ids, prompt_mask = left_pad(rows, pad_id, device)
    texts = tokenizer.batch_decode(completion.masked_fill(cmask == 0, pad_id).tolist(), skip_special_tokens=True)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion,
                        completion_mask=cmask, logprobs=logprobs, texts=texts, prompt_index=prompt_index,
                        truncated=truncated, info=info)


def _pad_right(x: Tensor, T: int, value) -> Tensor:
    if x.shape[1] == T:
        return x
    return torch.cat([x, x.new_full((x.shape[0], T - x.shape[1]), value)], dim=1)


def _pick_fast(model, device, fast: bool | None) -> bool:
    if fast is False:
        return False
    from edgetune.engine.generation import fast_decode

    ok, why = fast_decode.supported(model, device, require_cuda=fast is None and device.type == "cuda")
    if ok and fast is None and device.type != "cuda":  # the CPU: over its fp32 copy only
        return fast_decode.host_copy_wanted(model, device)
    if fast and not ok:
        raise ValueError(f"fast rollouts unavailable: {why}")
    if not ok and device.type == "cuda" and why not in _SAID:  # once per process, into worker.log
        _SAID.add(why)
        print(f"rollouts: the plain decode loop ({why})", file=sys.stderr, flush=True)
    return ok


_SAID: set[str] = set()  # fallback reasons already printed
