"""Advantages of online RL from each group's rewards: GRPO's (r - mean) and RLOO's leave-one-out baseline, scaled
by the group's reward std, the global batch's, or not at all (the formulas are in training/rl/objective.py's
module doc)."""

from __future__ import annotations

import torch


def advantages(
    totals: torch.Tensor, kind: str, scale: str, batch_std: torch.Tensor | None = None
) -> torch.Tensor:
    """[prompts, G] total rewards -> advantages (see the module doc). `batch_std`: the global batch's reward
    std (scale=batch)."""
    g = totals.shape[1]
    mean = totals.mean(1, keepdim=True)
    adv = totals - mean if kind == "grpo" else (totals - mean) * g / (g - 1)
    if scale == "group":
        adv = adv / (totals.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        adv = adv / (batch_std + 1e-4)
    return adv


def batch_std(totals: list[torch.Tensor], accelerator) -> torch.Tensor:
    """The std of every completion's total reward in the global window (scale_rewards=batch): one reduction
    over every rank of (sum, sum of squares, count)."""
    t = torch.cat(totals)
    acc = accelerator
    s = acc.reduce(torch.stack([t.sum(), (t * t).sum(), torch.tensor(float(len(t)))]).to(acc.device), "sum")
    n = s[2].cpu()
    return ((s[1].cpu() - s[0].cpu() ** 2 / n) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
