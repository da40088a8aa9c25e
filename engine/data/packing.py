"""Padding-free SFT batches: a micro-batch's rows laid end to end in one row.

A right-padded batch of B rows costs B x longest tokens in every matmul of the forward
and (without SEBP) the backward; the lengths of real chat data vary a lot, so often half
of that is padding. Packed, the batch costs exactly its real tokens. Nothing changes in
the result:

- position ids restart at 0 at each row's start, so rotary embeddings see the same
  positions as in the padded batch;
- transformers (5.x, masking_utils) reads the restarts from `position_ids` when no 2D
  attention mask is given and no KV cache is in use (`find_packed_sequence_indices`) and
  builds a block-diagonal causal mask: a boolean [1, 1, N, N] for sdpa (N^2 bytes: 19 MB
  for 4,340 tokens; fine up to ~16k tokens), a BlockMask for flex_attention, varlen
  offsets for flash-attention 2. tests/test_packing.py checks the equality, not the code;
- the first token of every row gets label -100: in the padded batch nothing predicts it
  (the shift drops it), and here the previous row's last token would.

The returned `attention_mask` is all ones, [1, N]: it is what SEBP's `set_active_rows`
and token counting read (every row of a packed batch is real). engine/training/lm_loss drops it
when `position_ids` is present, since a 2D mask would switch the packed-mask detection off.
"""

from __future__ import annotations

IGNORE = -100


def collate_packed(examples, pad_id: int | None = None) -> dict:
    """One row of all examples' tokens: input_ids, labels, position_ids, attention_mask
    (all ones), each [1, total tokens]. `pad_id` is unused (there is no padding); it keeps
    the signature of engine.data.collate."""
    import torch

    ids, labels, pos = [], [], []
    for e in examples:
        n = len(e.input_ids)
        if n == 0:
            continue
        ids += list(e.input_ids)
        lab = list(e.labels)
        lab[0] = IGNORE
        labels += lab
        pos += range(n)
    ids_t = torch.tensor([ids], dtype=torch.long)
    return {
        "input_ids": ids_t,
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "attention_mask": torch.ones_like(ids_t),
    }

