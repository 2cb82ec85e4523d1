"""The optimizer named by `train.optimizer`.

    adamw              torch AdamW; the fused kernel on CUDA, foreach elsewhere
    adamw_8bit         bitsandbytes AdamW8bit: Adam moments stored in 8 bits (block-wise quantised)
    paged_adamw_8bit   the same, with state in paged (CUDA unified) memory that can spill to CPU RAM
    paged_adamw_32bit  bitsandbytes paged AdamW with 32-bit state

Weight decay applies to matrices only (not to biases and norm weights). bitsandbytes keeps 32-bit
state for tensors smaller than 4096 elements (its `min_8bit_size`), so small LoRA matrices get
little from the 8-bit variants; they pay off for full fine-tuning and large adapters.
Paged optimizers only page on CUDA; on CPU they run as ordinary optimizers.
"""

from __future__ import annotations

import torch

from training.config import TrainSection
from training.core.errors import RecipeError

BNB_OPTIMIZERS = {
    "adamw_8bit": "AdamW8bit",
    "paged_adamw_8bit": "PagedAdamW8bit",
    "paged_adamw_32bit": "PagedAdamW32bit",
}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    if not decay and not no_decay:
        raise RecipeError(
            "the model has no trainable parameters (check method.type and method.lora.target_modules)"
        )
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for group in groups for g in _apart_from_dtensors(group)]


def _apart_from_dtensors(group: dict) -> list[dict]:
    """A group whose parameters mix DTensors (experts sharded by expert parallelism) and plain tensors,
    as two groups: torch's foreach kernels refuse the mix. Any other group unchanged."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in group["params"] if isinstance(p, DTensor)]
    if not sharded or len(sharded) == len(group["params"]):
        return [group]
    plain = [p for p in group["params"] if not isinstance(p, DTensor)]
    return [{**group, "params": plain}, {**group, "params": sharded}]


def build_optimizer(
    model: torch.nn.Module, t: TrainSection, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable parameters. `device` is where training will run
    (parameters may still be on CPU when this is called, before `accelerator.prepare`)."""
    groups = param_groups(model, t.weight_decay)
    kwargs = dict(lr=t.lr, betas=t.betas)
    if t.optimizer == "adamw":
        on_cuda = device is not None and device.type == "cuda"
        floating = all(p.is_floating_point() for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, fused=True if on_cuda and floating else None, **kwargs)
    import bitsandbytes as bnb

    return getattr(bnb.optim, BNB_OPTIMIZERS[t.optimizer])(groups, **kwargs)
