"""Speed options a machine cannot honour, refused before anything loads.

The speed transforms themselves (Liger kernels, torch.compile) are applied by training.models with
the model builders; the per-run speed report and MFU live in training.flops; fused AdamW with the
optimizer builders; flash_attention_2/SDPA selection in models.pick_attention.
"""

from __future__ import annotations

import importlib.util

import torch

from training.config import Recipe
from training.errors import RecipeError


def check_speed_options(recipe: Recipe, device: torch.device) -> None:
    """Refuse speed options whose package this machine lacks, before anything loads. Liger kernels on a
    device without CUDA are refused earlier, with the other rules, by training.backends.refusal."""
    if (
        recipe.model.liger_kernels
        and device.type == "cuda"
        and importlib.util.find_spec("liger_kernel") is None
    ):
        raise RecipeError(
            "model.liger_kernels=true needs the liger-kernel package: pip install liger-kernel (or set it to false)"
        )
