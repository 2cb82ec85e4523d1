"""Checks that run before a model is loaded, so a run fails in seconds rather than at its first save."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import psutil
import torch

from training.config import Recipe
from training.core.errors import RecipeError, UserError
from training.launch.backend import Backend
from training.planning.inventory import ModelInventory, inventory, model_config
from training.planning.memory import CUDA_CONTEXT_GIB, GiB, plan_backend

log = logging.getLogger(__name__)


def run_inventory(recipe: Recipe, tokenizer) -> ModelInventory | None:
    """The run's model counted on the meta device, once for the disk and memory checks; None (said) when
    its config cannot be read, e.g. a hub model offline: loading will say so."""
    try:
        return inventory(recipe, model_config(recipe, tokenizer))
    except UserError as e:
        log.warning("disk space and memory checks skipped: %s", e)
        return None


def checkpoint_bytes(recipe: Recipe, inv: ModelInventory) -> tuple[int, int]:
    """(bytes of one resumable checkpoint, bytes of final/), estimated from tensor sizes on the meta device:
    the checkpoint holds the model's state dict and AdamW's two fp32 moments per trainable parameter."""
    optimizer = inv.trainable_numel * (2 if recipe.train.optimizer.endswith("8bit") else 8)
    if recipe.train.optimizer == "muon":  # one fp32 momentum buffer per hidden matrix instead of two moments
        optimizer -= inv.muon_numel * 4
    final = inv.param_bytes if recipe.method.type == "full" else inv.trainable_bytes
    return inv.param_bytes + optimizer, final


def check_disk_space(
    recipe: Recipe, run_dir: Path, inv: ModelInventory, staging: Path | None = None, machines: int = 1
) -> None:
    """Refuse to start when output_dir cannot hold one more checkpoint plus final/ (10% margin), or, for
    asynchronous saves, `staging` (this run's staging directory) cannot hold a node's share of one."""
    ckpt, final = checkpoint_bytes(recipe, inv)
    need = int(1.1 * ((ckpt if recipe.checkpoint.every_steps else 0) + final))
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise RecipeError(
            f"output_dir: {run_dir} has {free / GiB:.2f} GiB free but a checkpoint ({ckpt / GiB:.2f} GiB) and final/ "
            f"({final / GiB:.2f} GiB) need about {need / GiB:.2f} GiB; free some space or pick another output_dir"
        )
    log.info("disk: %.2f GiB free, ~%.2f GiB per checkpoint", free / GiB, ckpt / GiB)
    if staging is not None and recipe.checkpoint.every_steps:
        where = next(p for p in (staging, *staging.parents) if p.exists())
        free, share = shutil.disk_usage(where).free, int(1.1 * ckpt / machines)
        if free < share:
            raise RecipeError(
                f"checkpoint.staging_dir: {where} has {free / GiB:.2f} GiB free but an asynchronous save stages "
                f"this node's share of a checkpoint there (about {share / GiB:.2f} GiB); set checkpoint.staging_dir "
                f"to node-local storage with room, or checkpoint.async_save: false"
            )


def with_batch(recipe: Recipe, batch_size: int, grad_accum: int, switches: dict) -> Recipe:
    """The recipe with another micro-batch and accumulation, and the model's memory switches set."""
    train = recipe.train.model_copy(update={"batch_size": batch_size, "grad_accum": grad_accum})
    model = recipe.model.model_copy(update=switches)
    return recipe.model_copy(update={"train": train, "model": model})


def memory_tries(recipe: Recipe, cpu: bool) -> list[tuple[int, int, dict]]:
    """What memory_fit tries, in order: the largest smaller micro-batch (more accumulation, the same examples
    per step), then gradient checkpointing, the tiled MLP and (on GPUs) activation offloading, each with the
    largest micro-batch that then fits."""
    m, bs, accum = recipe.model, recipe.train.batch_size, recipe.train.grad_accum
    halves = [bs // 2**k for k in range(1, bs.bit_length()) if bs % 2**k == 0]
    tries = [(h, accum * bs // h, {}) for h in halves]
    switches: dict = {}
    steps = [("gradient_checkpointing", True), ("tiled_mlp", True)] + (
        [] if cpu else [("activation_offloading", True)]
    )
    for key, value in steps:
        if getattr(m, key):
            continue
        switches = {**switches, key: value}
        tries += [(h, accum * bs // h, switches) for h in [bs, *halves]]
    return tries


def memory_fit(recipe: Recipe, inv: ModelInventory, backend: Backend, device: torch.device) -> str | None:
    """A warning when the planner's figure for this run on this machine exceeds what the machine has (host
    memory available now on CPU; the GPU's memory, and host memory for what is offloaded, on GPU), naming
    the first of memory_tries that would fit; a note when it fits within 10% of the limit. None when it fits."""
    cpu = device.type == "cpu"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", backend.num_processes // backend.num_machines or 1))
    b = dataclasses.replace(backend, cpu=cpu or backend.cpu)
    host_gib = psutil.virtual_memory().available / GiB
    gpu_gib = 0.0 if cpu else torch.cuda.get_device_properties(device).total_memory / GiB

    def plan(r: Recipe):
        return plan_backend(
            r, inv, b, local, gpu_gib, host_gib, r.model.gradient_checkpointing, backend.num_machines
        )

    now = plan(recipe)
    # fits, or refused (fit_reasons' memory verdicts begin "needs"; refusals are the launch checks' to say)
    if now.fits or not now.reason.startswith("needs "):
        need = now.host_gib if cpu else now.peak_gib + CUDA_CONTEXT_GIB
        limit = host_gib if cpu else gpu_gib
        what = "of host memory" if cpu else "per GPU"
        log.info("memory: the plan needs %.1f GiB %s; %.1f GiB is available", need, what, limit)
        if now.fits and need > 0.9 * limit:
            log.warning(
                "memory: that is within 10%% of the limit; %s",
                first_fix(recipe, cpu, plan, now) or "nothing helps",
            )
        return None
    fix = first_fix(recipe, cpu, plan, None) or (
        "no smaller batch, checkpointing or tiling makes it fit: a backend that shards or offloads, LoRA/QLoRA or "
        "a shorter max_length would (python -m training.plan compares them)"
    )
    return (
        f"memory: the plan for this run needs more than this machine has ({now.reason}); it may be killed for "
        f"memory mid-run; {fix}"
    )


def first_fix(recipe: Recipe, cpu: bool, plan, now) -> str | None:
    """'it would fit with ...' for the first of memory_tries that fits (and, given `now`, needs less)."""
    bs = recipe.train.batch_size
    for size, acc, switches in memory_tries(recipe, cpu):
        alt = plan(with_batch(recipe, size, acc, switches))
        used = alt.host_gib if cpu else alt.peak_gib
        if alt.fits and (now is None or used < (now.host_gib if cpu else now.peak_gib) * 0.95):
            settings = [f"model.{k}=true" for k in switches]
            if size != bs:
                settings += [f"train.batch_size={size}", f"train.grad_accum={acc}"]
            return f"it would fit with {' '.join(settings)} ({used:.1f} GiB)"
    return None
