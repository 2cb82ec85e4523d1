"""Speed options of a recipe: Liger kernels (GPU, optional package) and torch.compile, and a one-time
report of what a run actually uses (attention implementation, compile, Liger, FLOPs per token, peak).

Fused AdamW lives with the optimizer builders; flash_attention_2/SDPA selection in models.pick_attention.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from training import flops
from training.config import Recipe
from training.errors import RecipeError

log = logging.getLogger(__name__)


def check_speed_options(recipe: Recipe, device: torch.device) -> None:
    """Refuse speed options this machine cannot honour, before anything loads."""
    if recipe.model.liger_kernels:
        if device.type != "cuda":
            raise RecipeError("model.liger_kernels=true needs a CUDA GPU (Liger kernels are Triton GPU kernels); set it to false on CPU")
        if importlib.util.find_spec("liger_kernel") is None:
            raise RecipeError("model.liger_kernels=true needs the liger-kernel package: pip install liger-kernel (or set it to false)")


def apply_liger(model) -> None:
    """Swap RMSNorm, RoPE and SwiGLU for Liger's fused kernels on this model instance.

    The loss is computed by the training loop from the logits, so Liger's (fused linear) cross
    entropy, which replaces the model's own loss, is left off.
    """
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    log.info("Liger kernels applied (RMSNorm, RoPE, SwiGLU)")


def dynamo_backend(recipe: Recipe) -> dict:
    """Accelerator kwargs for train.torch_compile (accelerate compiles the model in prepare())."""
    return {"dynamo_backend": "inductor"} if recipe.train.torch_compile else {}


def speed_report(model, recipe: Recipe, device: torch.device) -> dict:
    """What this run really uses; logged once and written into the first metrics row."""
    config = getattr(model, "config", None)
    peak = flops.peak_flops(device, recipe.precision, recipe.model.dtype)
    report = {
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "torch_compile": recipe.train.torch_compile,
        "liger_kernels": recipe.model.liger_kernels,
        "flops_per_token": flops.model_training_flops_per_token(model, recipe.data.max_length),
        "peak_tflops": peak / 1e12 if peak else None,
    }
    log.info(
        "speed: attention %s, torch.compile %s, Liger %s, %.3g model FLOPs/token, device peak %s",
        report["attn_implementation"], "on" if report["torch_compile"] else "off",
        "on" if report["liger_kernels"] else "off", report["flops_per_token"],
        f"{report['peak_tflops']:.0f} TFLOP/s" if peak else "unknown (no MFU on CPU or an unlisted GPU)",
    )
    return report
