"""Causal-LM loss that computes logits only where a label exists.

With prompt tokens and padding masked to -100, the logit rows of those positions have
exactly zero gradient and contribute nothing to the loss. `lm_head` (vocab x hidden) is
the largest single matmul of a small model and its [tokens, vocab] logits the largest
activation of any model, so we skip them: select the rows with a label, project them in
chunks, and recompute each chunk's logits in the backward (checkpointing) instead of
storing them. Peak memory for logits drops from tokens x vocab to chunk x vocab (512
rows: ~0.9 GB of fp32 logits, softmax and gradient at a 152k vocabulary, where 2,048
rows held 3.7 GB; a 512 x 3584 x 152k product still runs at full GEMM rate).

The result equals transformers' `ForCausalLMLoss` (shift by one, ignore -100, mean over
the remaining tokens) up to float rounding; a test checks this.

The log-probs of sampled completions (F-GRPO's policy loss, ESSA's fitness) take the same
path: the hidden states of the completion tokens only, projected in checkpointed chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from edgetune.engine.planning.effective import LOSS_CHUNK_ROWS


def backbone_and_head(model):
    """(decoder stack returning hidden states, lm_head) of a PEFT or plain HF causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    return base, decoder, base.get_output_embeddings()


def supports_sparse_head(model) -> bool:
    base, _, _ = backbone_and_head(model)
    cfg = base.config
    # Models that rescale or soft-cap logits need their own head code: use HF's loss.
    return not any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def label_count(labels: torch.Tensor) -> int:
    """Target tokens of a batch: positions whose next-token label is not -100."""
    return int((labels[:, 1:] != -100).sum())


def sparse_ce_loss(hidden: torch.Tensor, lm_head, labels: torch.Tensor, chunk_rows: int = LOSS_CHUNK_ROWS,
                   num_items: int | None = None) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over positions whose label is not -100, through
    kernels/sebp.py's `sparse_lm_head_loss` in checkpointed chunks.

    hidden: [B, T, H] final hidden states; labels: [B, T] (unshifted, HF convention).
    Returns (loss, number of target tokens)."""
    from edgetune.kernels.sebp import sparse_lm_head_loss

    n = int((labels[:, 1:] != -100).sum())
    if n == 0:
        return hidden.sum() * 0.0, 0
    return sparse_lm_head_loss(hidden, lm_head.weight, labels, num_items_in_batch=num_items,
                               chunk_rows=chunk_rows), n


def causal_lm_loss(model, batch: dict, sparse_head: bool = True,
                   chunk_rows: int = LOSS_CHUNK_ROWS) -> tuple[torch.Tensor, int]:
    """(mean loss over target tokens, number of target tokens) for one batch."""
    labels = batch["labels"]
    # A packed row (engine/data/packing.py) carries position_ids; its block-diagonal mask is
    # built from them only when no 2D mask and no KV cache are passed.
    pos = batch.get("position_ids")
    inputs = dict(input_ids=batch["input_ids"], attention_mask=None if pos is not None else batch["attention_mask"],
                  position_ids=pos, use_cache=False)
    if not sparse_head or not supports_sparse_head(model):
        out = model(**inputs, labels=labels)
        return out.loss, int((labels[:, 1:] != -100).sum())
    _, decoder, head = backbone_and_head(model)
    hidden = decoder(**inputs).last_hidden_state
    return sparse_ce_loss(hidden, head, labels, chunk_rows=chunk_rows)


# --------------------------------------------------------------------------- log-probs


def _chunk_logp(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = F.linear(h, weight).float() / temperature
    return logits.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, sebp=None):
    """The last hidden state that predicts each completion token: (hs [tokens, H], ys
    [tokens], keep [B, last], head), the tokens being those of completion_mask in row-major
    order and `last` the longest completion. Prompts are left-padded, so positions come
    from the attention mask, as during decoding. With `sebp` (the handle of
    kernels/sebp.enabled) the backward skips the padding rows of the trimmed batch."""
    P = prompt_ids.shape[1]
    # Trim columns that are padding in every row of this batch: less work, same values.
    first = int(prompt_mask.any(0).nonzero()[0]) if prompt_mask.any() else P
    last = int(completion_mask.any(0).nonzero()[-1]) + 1 if completion_mask.any() else 0
    ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :last]], dim=1)
    attn = torch.cat([prompt_mask[:, first:], completion_mask[:, :last]], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    if sebp is not None:  # the rows of the batch as trimmed here: SEBP matches them by shape
        sebp.set_active_rows(attn.bool())
    _, decoder, head = backbone_and_head(model)
    hidden = decoder(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
    p = P - first
    h = hidden[:, p - 1 : p - 1 + last]  # position t predicts completion token t
    keep = completion_mask[:, :last].bool()
    return h[keep], completion_ids[:, :last][keep], keep, head


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature: float = 1.0, chunk_rows: int = LOSS_CHUNK_ROWS, sebp=None) -> torch.Tensor:
    """[B, T] log-probs of the completion tokens (0 where completion_mask is 0), with
    logits divided by `temperature` as at sampling time (see completion_hidden)."""
    B, T = completion_ids.shape
    hs, ys, keep, head = completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, sebp)
    parts = []
    for s in range(0, hs.shape[0], chunk_rows):
        args = (hs[s : s + chunk_rows], head.weight, ys[s : s + chunk_rows], temperature)
        # Recompute each chunk's logits in the backward instead of storing [tokens, vocab].
        parts.append(checkpoint(_chunk_logp, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _chunk_logp(*args))
    out = torch.zeros(keep.shape, dtype=torch.float32, device=hs.device)
    if parts:
        out = out.masked_scatter(keep, torch.cat(parts))
    return F.pad(out, (0, T - keep.shape[1]))


def labelled_logprobs(model, batch: dict, chunk_rows: int = LOSS_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the log-probs of each row's target tokens [B], their count [B]) for a batch of
    labelled rows (unshifted labels, -100 where no target, as `causal_lm_loss` takes them).
    Only the target positions are projected through lm_head, in checkpointed chunks."""
    labels = batch["labels"]
    _, decoder, head = backbone_and_head(model)
    hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     use_cache=False).last_hidden_state
    keep = labels[:, 1:] != -100
    h, y = hidden[:, :-1][keep], labels[:, 1:][keep]
    parts = []
    for s in range(0, h.shape[0], chunk_rows):
        args = (h[s : s + chunk_rows], head.weight, y[s : s + chunk_rows], 1.0)
        parts.append(checkpoint(_chunk_logp, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _chunk_logp(*args))
    per_token = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    rows = keep.nonzero()[:, 0]
    sums = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device).index_add(0, rows, per_token)
    return sums, keep.sum(1)
