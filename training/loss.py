"""The training objective: summed next-token cross-entropy over the labelled tokens of a batch.

`token_loss` returns the sum (not the mean) and the count, so the caller can normalise over a whole
accumulation window and every data-parallel rank (see `train.train_step`). It also returns the model's
outputs: a Mixture-of-Experts model's router logits ride on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.data import IGNORE


def token_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(summed next-token cross-entropy over labelled tokens, how many there were, the model's outputs)."""
    outputs = model(**{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")})
    # A shard of a split sequence carries labels shifted before the split (training.sequence_parallel).
    if "shift_labels" in batch:
        logits, shift_labels = outputs.logits, batch["shift_labels"]
    else:
        logits, shift_labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(),
        shift_labels.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return loss_sum, (shift_labels != IGNORE).sum(), outputs
