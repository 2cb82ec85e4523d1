"""What a batch is made of, for every layer: IGNORE marks tokens without loss (labels are aligned with
input_ids; the model shifts them), and the counts the loss is normalised by."""

from __future__ import annotations

import torch

IGNORE = -100


def real_tokens(batch: dict) -> torch.Tensor:
    """Non-padding tokens in a batch (padded, packed or flattened).

    Packed batches have no attention_mask: every example is at least 2 tokens long (a 1-token example
    has no label after packing, so it is never packed), hence a real token has position > 0 or sits at
    the start of a sequence whose next position is 1; padding tokens all have position 0.
    """
    if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
        return batch["attention_mask"].sum()
    if "position_ids" in batch:
        pos = batch["position_ids"]
        return pos.gt(0).sum() + pos.eq(1).sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)


def labelled_tokens(batch: dict) -> torch.Tensor:
    """Tokens that have a next-token target: `shift_labels` (already shifted, possibly a shard of the
    sequence) or `labels` shifted here."""
    if "shift_labels" in batch:
        return batch["shift_labels"].ne(IGNORE).sum()
    return batch["labels"][:, 1:].ne(IGNORE).sum()
