"""Distributed backends: which one `accelerate launch` asked for, the Accelerator for it, and the
combinations refused before anything loads.

The backend is chosen only by the accelerate config file (accelerate_configs/*.yaml): `accelerate
launch` turns it into environment variables (ACCELERATE_USE_DEEPSPEED, ACCELERATE_USE_FSDP,
WORLD_SIZE, ...) that this module reads. The recipe stays the single source of batch size,
accumulation, clipping and precision: the DeepSpeed configs say "auto" and are filled from it here.

CPU-only machines (see ../shared/ENVIRONMENT.md): accelerate only runs real multi-process DDP on CPU
when told it is on CPU, and DeepSpeed only shards over several CPU processes with the gloo backend;
`build_accelerator` arranges both, so the same config files and commands work with or without GPUs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedType, InitProcessGroupKwargs
from accelerate.utils import GradientAccumulationPlugin

from training.config import Recipe
from training.data import IGNORE
from training.errors import RecipeError, UserError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- what was launched


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def requested_backend() -> str:
    """The backend the launcher asked for: deepspeed, fsdp, multi (DDP / multi-node) or single."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _flag("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return "multi" if world_size() > 1 else "single"


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_config_path() -> Path | None:
    """The DeepSpeed JSON named by the accelerate config, resolved against the working directory
    and then the repository root (so `accelerate_configs/ds_*.json` works from any directory)."""
    raw = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if raw in ("", "none"):
        return None
    path = Path(raw).expanduser()
    for candidate in (path, ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    raise UserError(
        f"accelerate config: deepspeed_config_file {raw} does not exist (looked in {Path.cwd()} and {ROOT}); "
        f"use a path relative to the repository root, e.g. accelerate_configs/ds_zero2.json, or an absolute path"
    )


def read_deepspeed_config() -> dict:
    path = deepspeed_config_path()
    if path is None:
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"DeepSpeed config {path} line {e.lineno}: not valid JSON ({e.msg})") from None


# ----------------------------------------------------------------------------- checks


def check_launch(recipe: Recipe) -> None:
    """Refuse launches that cannot work on this machine, before any process group exists."""
    backend = requested_backend()
    cuda = torch.cuda.is_available()
    if backend == "fsdp" and not cuda:
        raise UserError(
            "the accelerate config asks for FSDP, which needs CUDA GPUs, and this machine has none "
            "(accelerate would silently fall back to plain DDP). On CPU use accelerate_configs/ddp.yaml "
            "(data parallel) or accelerate_configs/zero3_offload.yaml (DeepSpeed ZeRO-3: shards parameters, "
            "gradients and optimizer state, runs on CPU)"
        )
    if backend == "deepspeed":
        ds = read_deepspeed_config().get("zero_optimization", {})
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", ds.get("stage", 2)))
        offload_opt = _offload(ds, "offload_optimizer", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
        if recipe.train.on_nonfinite == "skip":
            raise RecipeError(
                "train.on_nonfinite=skip is not available under DeepSpeed (the engine steps inside backward); use stop"
            )
        if offload_opt and recipe.train.optimizer != "adamw":
            raise RecipeError(
                f"train.optimizer={recipe.train.optimizer} cannot be used with DeepSpeed optimizer offload: DeepSpeed "
                f"replaces it with its CPU Adam (in plain Adam mode, not AdamW). Use train.optimizer=adamw (the "
                f"offloaded optimizer state lives in CPU RAM anyway), or a config without offload (zero2.yaml, zero3.yaml)"
            )
        if stage == 3 and not _gathers_16bit(ds):
            raise RecipeError(
                "the DeepSpeed config uses ZeRO-3 without stage3_gather_16bit_weights_on_model_save: true, so final/ "
                "could not be exported at the end of training; set it in the DeepSpeed JSON (as in "
                "accelerate_configs/ds_zero3.json) or zero3_save_16bit_model: true in the accelerate config"
            )


def _offload(ds: dict, key: str, env: str) -> bool:
    device = os.environ.get(env) or (ds.get(key) or {}).get("device", "none")
    return str(device).lower() not in ("none", "")


def _gathers_16bit(ds: dict) -> bool:
    return _flag("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL") or ds.get("stage3_gather_16bit_weights_on_model_save") is True


def check_compatibility(recipe: Recipe, accelerator: Accelerator) -> None:
    """Refuse combinations that cannot work on this machine/backend, before loading anything."""
    cpu = accelerator.device.type == "cpu"
    if cpu and recipe.precision == "fp16":
        raise RecipeError("precision=fp16 needs a GPU (CPU has no fp16 loss scaling); use precision=bf16 or no on CPU")
    if requested_backend() == "deepspeed" and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise UserError(
            f"the accelerate config asks for DeepSpeed but accelerate set up {accelerator.distributed_type.value}; "
            f"launch with `accelerate launch --config_file accelerate_configs/zero*.yaml` and without --cpu"
        )


# ----------------------------------------------------------------------------- the accelerator


def build_accelerator(recipe: Recipe) -> Accelerator:
    """The Accelerator for whatever backend the launcher asked for, configured from the recipe."""
    check_launch(recipe)
    backend = requested_backend()
    handlers, cpu = [], False
    if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        if backend == "deepspeed":
            # DeepSpeed on CPU shards data only over gloo. ACCELERATE_USE_CPU would make accelerate
            # drop DeepSpeed silently and run plain DDP, so it is ignored here.
            if os.environ.pop("ACCELERATE_USE_CPU", None) is not None:
                log.info("ignoring ACCELERATE_USE_CPU under DeepSpeed (it would disable DeepSpeed)")
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        elif world_size() > 1:
            # Without cpu=True accelerate inits the process group but leaves the model unwrapped
            # (DistributedType.NO): ranks would train apart without syncing gradients.
            cpu = True
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
    if backend == "deepspeed" and (path := deepspeed_config_path()) is not None:
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(path)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=recipe.precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=recipe.train.grad_accum, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(even_batches=True),
        kwargs_handlers=handlers,
    )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, recipe)
    return accelerator


def fill_deepspeed_config(ds: dict, recipe: Recipe) -> None:
    """The recipe decides micro-batch, accumulation and clipping, whatever the JSON says."""
    ds["train_micro_batch_size_per_gpu"] = recipe.train.batch_size
    ds["gradient_accumulation_steps"] = recipe.train.grad_accum
    ds["gradient_clipping"] = recipe.train.max_grad_norm or 0.0
    ds.pop("train_batch_size", None)  # derived by accelerate from the three above and the world size


# ----------------------------------------------------------------------------- model building and export


@contextlib.contextmanager
def no_zero3_init():
    """While a ZeRO-3 Accelerator exists, transformers builds every model inside deepspeed.zero.Init;
    inside this block it builds plain ones (for meta-device sizing, or from-scratch models)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def model_init_context(recipe: Recipe):
    """Build the model so that its initial weights do not depend on the backend.

    zero.Init partitions each weight as it is created and initialises it by another path, so a
    from-scratch model would start from other random weights than under any other backend. A
    pretrained model loads the same weights either way (and zero.Init keeps big ones from being
    materialised on every rank), so only from-scratch models are built outside it; DeepSpeed then
    partitions them in `prepare`.
    """
    return no_zero3_init() if recipe.model.from_scratch is not None else contextlib.nullcontext()


def share_tied_tensors(state_dict: dict, model) -> dict:
    """Make tied weights (e.g. lm_head = embed_tokens) one tensor again in a gathered state dict.

    DeepSpeed's gathered state dicts hold a separate copy per name, so save_pretrained would not see
    the tie and would write the embedding twice; aliasing lets it drop the duplicate as usual.
    """
    if not state_dict:  # ranks other than the main one may get None or {}
        return state_dict
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state_dict and name in state_dict:
            state_dict[name] = state_dict[owner]
    return state_dict


# ----------------------------------------------------------------------------- evaluation


def mask_repeated_rows(batch: dict, accelerator: Accelerator) -> dict:
    """Labels of the samples that accelerate repeats to give every rank a full last batch, masked.

    With several processes, `even_batches` pads the last global batch with samples from the start
    of the dataset; counting them would make the eval loss depend on the number of processes. The
    real rows of the last global batch come first in rank order (as `gather_for_metrics` assumes).
    """
    state = accelerator.gradient_state
    if accelerator.num_processes == 1 or not state.end_of_dataloader or state.remainder <= 0:
        return batch
    rows = batch["labels"].shape[0]
    keep = max(0, min(rows, state.remainder - accelerator.process_index * rows))
    if keep == rows:
        return batch
    labels = batch["labels"].clone()
    labels[keep:] = IGNORE
    return {**batch, "labels": labels}
