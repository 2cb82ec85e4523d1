"""Speed options of a recipe: Liger kernels (GPU, optional package) and torch.compile, and a one-time
report of what a run actually uses (attention implementation, compile, Liger, FLOPs per token, peak)
that also turns tokens/s into MFU.

Fused AdamW lives with the optimizer builders; flash_attention_2/SDPA selection in models.pick_attention.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import asdict, dataclass

import torch

from training import flops
from training.config import Recipe
from training.errors import RecipeError

log = logging.getLogger(__name__)


def check_speed_options(recipe: Recipe, device: torch.device) -> None:
    """Refuse speed options this machine cannot honour, before anything loads."""
    if recipe.model.liger_kernels:
        if device.type != "cuda":
            raise RecipeError(
                "model.liger_kernels=true needs a CUDA GPU (Liger kernels are Triton GPU kernels); set it to false on CPU"
            )
        if importlib.util.find_spec("liger_kernel") is None:
            raise RecipeError("model.liger_kernels=true needs the liger-kernel package: pip install liger-kernel (or set it to false)")


def apply_liger(model) -> None:
    """Swap RMSNorm, RoPE and SwiGLU for Liger's fused kernels on this model instance.

    The training loop computes the loss from the logits, so Liger's (fused linear) cross entropy,
    which replaces the model's own loss computation, is left off.
    """
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    log.info("Liger kernels applied (RMSNorm, RoPE, SwiGLU)")


def apply_compile(model) -> None:
    """torch.compile the model's forward in place (nn.Module.compile): the module, its state-dict keys
    and therefore checkpoints and exports stay exactly as without compilation."""
    model.compile()
    log.info("torch.compile enabled (inductor); the first steps include compilation time")


@dataclass
class SpeedReport:
    attn_implementation: str | None
    torch_compile: bool
    liger_kernels: bool
    flops_per_token: int
    peak_flops: float | None  # per device, FLOP/s; None on CPU or an unlisted GPU
    num_devices: int

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation of the global tokens/s against all devices' peak."""
        return flops.mfu(tokens_per_s, self.flops_per_token, self.peak_flops, self.num_devices)

    def as_row(self) -> dict:
        return asdict(self)


def speed_report(model, recipe: Recipe, accelerator) -> SpeedReport:
    """What this run really uses, from the built (not yet prepared) model; logged once."""
    config = getattr(model, "config", None)
    report = SpeedReport(
        attn_implementation=getattr(config, "_attn_implementation", None),
        torch_compile=recipe.train.torch_compile,
        liger_kernels=recipe.model.liger_kernels,
        flops_per_token=flops.model_training_flops_per_token(model, recipe.data.max_length),
        peak_flops=flops.peak_flops(accelerator.device, recipe.precision, recipe.model.dtype),
        num_devices=accelerator.num_processes,
    )
    log.info(
        "speed: attention %s, torch.compile %s, Liger %s, %.3g model FLOPs/token, device peak %s",
        report.attn_implementation, "on" if report.torch_compile else "off", "on" if report.liger_kernels else "off",
        report.flops_per_token,
        f"{report.peak_flops / 1e12:.0f} TFLOP/s" if report.peak_flops else "unknown (MFU not reported on CPU or an unlisted GPU)",
    )
    return report


def mfu_postfix(mfu: float | None) -> dict:
    """The progress bar's MFU field, when MFU is known."""
    return {"mfu": f"{mfu:.1%}"} if mfu is not None else {}
