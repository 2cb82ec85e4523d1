"""Checks that run before a model is loaded, so a run fails in seconds rather than at its first save."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from training.config import Recipe
from training.core.errors import RecipeError, UserError
from training.model.build import from_scratch_config
from training.planning.memory import GiB, inventory

log = logging.getLogger(__name__)


def checkpoint_bytes(recipe: Recipe, tokenizer=None) -> tuple[int, int]:
    """(bytes of one resumable checkpoint, bytes of final/), estimated from tensor sizes on the meta device:
    the checkpoint holds the model's state dict and AdamW's two fp32 moments per trainable parameter."""
    config = (
        from_scratch_config(recipe.model.from_scratch, tokenizer)
        if recipe.model.from_scratch and tokenizer
        else None
    )
    inv = inventory(recipe, config)
    optimizer = inv.trainable_numel * (2 if recipe.train.optimizer.endswith("8bit") else 8)
    if recipe.train.optimizer == "muon":  # one fp32 momentum buffer per hidden matrix instead of two moments
        optimizer -= inv.muon_numel * 4
    final = inv.param_bytes if recipe.method.type == "full" else inv.trainable_bytes
    return inv.param_bytes + optimizer, final


def check_disk_space(recipe: Recipe, run_dir: Path, tokenizer=None) -> None:
    """Refuse to start when output_dir cannot hold one more checkpoint plus final/ (10% margin)."""
    try:
        ckpt, final = checkpoint_bytes(recipe, tokenizer)
    except UserError as e:  # e.g. a hub model whose config is not available offline: let loading say so
        log.warning("disk space check skipped: %s", e)
        return
    need = int(1.1 * ((ckpt if recipe.checkpoint.every_steps else 0) + final))
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise RecipeError(
            f"output_dir: {run_dir} has {free / GiB:.2f} GiB free but a checkpoint ({ckpt / GiB:.2f} GiB) and final/ "
            f"({final / GiB:.2f} GiB) need about {need / GiB:.2f} GiB; free some space or pick another output_dir"
        )
    log.info("disk: %.2f GiB free, ~%.2f GiB per checkpoint", free / GiB, ckpt / GiB)
