"""What a batch is made of, for every layer: IGNORE marks tokens without loss (labels are aligned with
input_ids; the model shifts them), the counts the loss is normalised by, and the sequences' real lengths
that attention's cost grows with."""

from __future__ import annotations

import torch

IGNORE = -100
# per-token vectors some rows carry beside input_ids (k values per token, flattened in the dataset; [batch,
# length, k] in a batch): a distillation teacher's top-k token ids and log-probabilities at each position
TEACHER_TOPK = ("teacher_topk_ids", "teacher_topk_logprobs")
NOT_MODEL_INPUTS = ("labels", "shift_labels", *TEACHER_TOPK)


def to_device(batch: dict, device) -> dict:
    """The batch with its tensors moved to `device` (blocking copies, as accelerate's send_to_device makes by
    default); its other values (use_cache, flash-attention lengths) as they are."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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


def squared_lengths(batch: dict) -> torch.Tensor:
    """The sum over the batch's sequences of their real length squared, which attention's cost scales with:
    each packed document on its own, each padded row at its unpadded length.

    A sequence of L tokens at positions 0..L-1 has sum over its positions p of (2p + 1) = L^2, so where a
    batch carries position_ids the sum runs over its real tokens' positions; summed per token like this,
    the shards of a sequence split over ranks (Ulysses) add up to the whole sequence's square. Packed rows
    (padded, or flattened into one row for varlen attention, whose cu_seq_lens mark the same documents)
    restart their positions at 0 for every document; padding also sits at position 0 and is told from a
    document's first token, as in `real_tokens`, by the position 1 that follows that token. Padded rows
    without position_ids: their attention_mask's sums. Neither: every row is a whole sequence."""
    mask = batch.get("attention_mask")
    mask = mask if mask is not None and mask.dim() == 2 else None
    pos = batch.get("position_ids")
    if pos is not None and mask is not None:  # padded rows with positions (split over sequence ranks)
        return ((2 * pos + 1) * mask).sum()
    if mask is not None:
        lengths = mask.sum(dim=1)
        return (lengths * lengths).sum()
    if pos is not None:  # packed rows: padding at position 0, each document's start told by its position 1
        return (2 * pos + 1).masked_fill(pos.eq(0), 0).sum() + pos.eq(1).sum()
    rows, length = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
    return torch.tensor(rows * length * length, device=batch["input_ids"].device)
