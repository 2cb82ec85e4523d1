"""The loss of online RL: log-probabilities at the sampling temperature, PPO's clipped surrogate with the k3 KL
estimate per token, and how a micro-batch's token losses are summed and normalised by loss type (the
formulas are in training/rl/objective.py's module doc)."""

from __future__ import annotations

import torch

from training.config import RLSection
from training.model.logits import last_logits


def token_logps(
    model, input_ids, attention_mask, temperature: float, mask
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each of the rows' last `width` tokens at `temperature`, the entropy of its
    distribution, detached) at the positions of a rollout's mask [N, width] (Drawn.tensors), 0 elsewhere.
    Computed there only: a row's log-softmax is its own, so the values there (and the gradients) are those of
    every position's, and the prompt's padding, the tool's results and what follows the end cost nothing over
    the vocabulary."""
    keep, width = mask > 0, mask.shape[1]
    logits = last_logits(model, width, input_ids=input_ids, attention_mask=attention_mask)[keep].float()
    if temperature != 1.0:
        logits = logits / temperature
    logps = torch.log_softmax(logits, dim=-1)
    chosen = torch.gather(logps, -1, input_ids[:, -width:][keep].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logps.exp() * logps).sum(-1)
    return spread(chosen, keep), spread(entropy, keep)


def spread(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`values` (one per True of `keep`, in order) at their positions of a [N, width] tensor, 0 elsewhere."""
    return values.new_zeros(keep.shape).masked_scatter(keep, values)


def token_losses(
    logps, old_logps, ref_logps, adv, cfg: RLSection, weight=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss [N, T], clipped low [N, T] bool, clipped high [N, T] bool, KL [N, T] or zeros).
    Clipped low: the ratio is below 1 - epsilon with a negative advantage (the min takes the clipped, constant
    term: no gradient); high: above 1 + epsilon_high with a positive one (TRL's clip_ratio/low, /high).
    `weight` [N, T]: rl.async's truncated importance weight, on the surrogate (not the KL), as TRL applies it."""
    ratio = torch.exp(logps - old_logps)
    a = adv.unsqueeze(-1)
    clipped_ratio = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    losses = -torch.min(ratio * a, clipped_ratio * a)
    if weight is not None:
        losses = losses * weight
    low = (ratio < 1 - cfg.epsilon) & (a < 0)
    high = (ratio > 1 + cfg.epsilon_high) & (a > 0)
    kl = torch.zeros_like(losses)
    if cfg.beta > 0:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        losses = losses + cfg.beta * kl
    return losses, low, high, kl


def importance_weight(logps, generating_logps, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rl.async: (the truncated importance weight min(p / p_generating, cap) per token, detached; the ratio
    before truncation, for its statistics)."""
    ratio = torch.exp((logps.detach() - generating_logps).clamp(max=30.0))
    return ratio.clamp(max=cap), ratio


def summed_loss(losses: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The micro-batch's loss summed as its normaliser counts (see the module doc)."""
    if loss_type == "grpo":
        return ((losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    return (losses * mask).sum()


def normaliser(mask: torch.Tensor, loss_type: str, max_new_tokens: int) -> float:
    if loss_type == "grpo":
        return float(mask.shape[0])
    if loss_type == "dr_grpo":
        return float(mask.shape[0] * max_new_tokens)
    return float(mask.sum())


# ----------------------------------------------------------------------------- rollouts
