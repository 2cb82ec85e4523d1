"""Logits of the positions a loss reads, not of every position: RL and preference losses score only the
completion's tokens, so the vocabulary head (and the softmax after it, the largest tensors of a small model's
step) runs on the last positions from the first scored token on (transformers' `logits_to_keep`, as TRL's
trainers pass it). A model whose forward does not take `logits_to_keep` gets every position's logits, cut."""

from __future__ import annotations

import torch


def scored_width(scored: torch.Tensor) -> int:
    """How many of the last predicted positions [N, L-1] a loss needs: from the first column any row scores (at
    least one, so that a batch with nothing scored still has a loss to take)."""
    cols = scored.any(0).nonzero()
    return max(scored.shape[1] - int(cols[0]), 1) if len(cols) else 1


def last_logits(model, width: int, **inputs) -> torch.Tensor:
    """The logits predicting the last `width` tokens of each row [N, width, V] (positions L-1-width .. L-2)."""
    try:
        logits = model(**inputs, use_cache=False, logits_to_keep=width + 1).logits
    except TypeError as e:  # a forward without the keyword
        if "logits_to_keep" not in str(e):
            raise
        logits = model(**inputs, use_cache=False).logits
    return logits[:, -(width + 1) : -1]
