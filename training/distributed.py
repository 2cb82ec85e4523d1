"""The Accelerator for the backend `accelerate launch` asked for, the launches refused before anything
loads, and the backend-specific parts of model building, export and evaluation.

The backend is chosen only by the accelerate config file (accelerate_configs/*.yaml): `accelerate
launch` turns it into environment variables (ACCELERATE_USE_DEEPSPEED, ACCELERATE_USE_FSDP,
WORLD_SIZE, ...) that training.backends reads. The recipe stays the single source of batch size,
accumulation, clipping and precision: the DeepSpeed configs say "auto" and are filled from it here.

CPU-only machines: accelerate runs real multi-process DDP on CPU only when told it is on CPU (without
that it inits the process group but leaves the model unwrapped), and DeepSpeed shards over several CPU
processes only with the gloo backend (its default, NCCL, needs GPUs); `build_accelerator` arranges
both, so the same config files and commands work with or without GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedType, InitProcessGroupKwargs
from accelerate.utils import GradientAccumulationPlugin
from transformers.integrations import deepspeed as hf_deepspeed

from training.backends import Backend, launched_backend, refusal, world_size
from training.config import Recipe
from training.data import IGNORE
from training.errors import UserError

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- checks


def check_launch(recipe: Recipe) -> Backend:
    """Refuse a recipe the launched backend cannot run on this machine (training.backends.refusal),
    before any process group exists; return that backend."""
    backend = launched_backend()
    cuda = torch.cuda.is_available() and not backend.cpu
    if (error := refusal(recipe, backend, cuda)) is not None:
        raise error
    return backend


def check_compatibility(recipe: Recipe, accelerator: Accelerator) -> None:
    """Once accelerate has set up: it set up the backend that was asked for, and the recipe can run on
    the device it chose (check_launch could only judge the machine from torch.cuda)."""
    backend = launched_backend()
    if backend.kind == "deepspeed" and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise UserError(
            f"the accelerate config asks for DeepSpeed but accelerate set up {accelerator.distributed_type.value}; "
            f"launch with `accelerate launch --config_file accelerate_configs/zero*.yaml` and without --cpu"
        )
    if (error := refusal(recipe, backend, accelerator.device.type == "cuda")) is not None:
        raise error


# ----------------------------------------------------------------------------- the accelerator


def build_accelerator(recipe: Recipe) -> Accelerator:
    """The Accelerator for whatever backend the launcher asked for, configured from the recipe."""
    backend = check_launch(recipe)
    handlers, cpu = [], False
    if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        if backend.kind == "deepspeed":
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
    if backend.deepspeed_file is not None:  # found from any working directory; DeepSpeedPlugin reads it again
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(backend.deepspeed_file)
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
