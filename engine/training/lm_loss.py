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
"""

from __future__ import annotations

import torch

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
