"""The Accelerator for the backend `accelerate launch` asked for, the launches refused before anything
loads, and the backend-specific parts of model building, export and evaluation.

The backend is chosen only by the accelerate config file (accelerate_configs/*.yaml): `accelerate
launch` turns it into environment variables (ACCELERATE_USE_DEEPSPEED, ACCELERATE_USE_FSDP,
WORLD_SIZE, ...) that training.launch reads. The recipe stays the single source of batch size,
accumulation, clipping and precision: the DeepSpeed configs say "auto" and are filled from it here.

CPU-only machines: accelerate runs real multi-process DDP on CPU only when told it is on CPU (without
that it inits the process group but leaves the model unwrapped), DeepSpeed shards over several CPU
processes only with the gloo backend (its default, NCCL, needs GPUs), and FSDP2 / device meshes need
the one adaptation in `_present_cpu_as_multi_device`; `build_accelerator` arranges all three, so the
same config files and commands work with or without GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from accelerate import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedType,
    InitProcessGroupKwargs,
    PartialState,
)
from accelerate.utils import GradientAccumulationPlugin
from torch.distributed.fsdp import CPUOffloadPolicy
from transformers.integrations import deepspeed as hf_deepspeed

from training.config import Recipe
from training.core.errors import UserError
from training.launch.backend import Backend, launched_backend, world_size
from training.launch.checks import (
    check_expert_parallel,
    check_pipeline,
    check_sequence_parallel,
    check_tensor_parallel,
)
from training.launch.refusals import precision_note, refusal
from training.model.build import model_config_only
from training.parallel.collectives import isolate_restart_attempts
from training.parallel.sequence_parallel import use_recipe_attention
from training.run.trackers import log_with, project_config

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- checks


def check_launch(recipe: Recipe, backend: Backend | None = None) -> Backend:
    """Refuse a recipe the launched backend cannot run on this machine (training.launch.refusals.refusal),
    before any process group exists; return that backend."""
    backend = backend or launched_backend()
    cuda = torch.cuda.is_available() and not backend.cpu
    if (error := refusal(recipe, backend, cuda)) is not None:
        raise error
    return backend


def check_compatibility(recipe: Recipe, accelerator: Accelerator, backend: Backend | None = None) -> None:
    """Once accelerate has set up: it set up the backend that was asked for, and the recipe can run on
    the device it chose (check_launch could only judge the machine from torch.cuda)."""
    backend = backend or launched_backend()
    if backend.kind == "deepspeed" and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise UserError(
            f"the accelerate config asks for DeepSpeed but accelerate set up {accelerator.distributed_type.value}; "
            f"launch with `accelerate launch --config_file accelerate_configs/zero*.yaml` and without --cpu"
        )
    if (error := refusal(recipe, backend, accelerator.device.type == "cuda")) is not None:
        raise error


# ----------------------------------------------------------------------------- the accelerator


def _present_cpu_as_multi_device(handler: InitProcessGroupKwargs) -> None:
    """The one CPU adaptation for FSDP2 and device meshes (tensor parallel, HSDP), explained.

    accelerate (1.15, state.py) selects FSDP, and accepts a `parallelism_config` mesh, only when the
    process state is "multi-device" (MULTI_GPU, MULTI_XPU, ...). CPU processes are MULTI_CPU, so on a
    machine without GPUs accelerate would silently drop FSDP and wrap the model in DDP. torch's FSDP2
    and DTensor themselves run over gloo on CPU. So the process state is created here exactly as for
    CPU DDP (device cpu, gloo process group) and then presented as multi-device: the Accelerator built
    next takes its own FSDP2 branch (distributed type FSDP) or accepts the mesh (tensor parallel only:
    the type stays MULTI_GPU, which accelerate reads as "multi-device, skip DDP for TP"). The device is
    already fixed to cpu, so nothing calls CUDA. Everything after this is accelerate's own code path.
    """
    state = PartialState(cpu=True, **handler.to_kwargs())
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def _unpinned_cpu_offload(accelerator: Accelerator) -> None:
    """fsdp_offload_params: accelerate builds FSDP2's CPUOffloadPolicy(), whose default pin_memory=True
    needs a GPU ("Cannot access accelerator device when none is available"). On CPU the same offload
    code path runs (the optimizer steps on the CPU shards), with unpinned memory."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if (
        plugin is not None
        and isinstance(plugin.cpu_offload, CPUOffloadPolicy)
        and plugin.cpu_offload.pin_memory
    ):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


@contextlib.contextmanager
def _no_accelerate_mesh(backend: Backend):
    """A pipeline's parallelism_config block (its pp keys, dp_replicate_size) makes `accelerate launch`
    set ACCELERATE_USE_PARALLELISM_CONFIG, and the Accelerator would then build its own mesh without the
    pp dimension it does not know. training/parallel/pipeline.py builds the (pp, dp) mesh instead: while the
    Accelerator is created, the variable is hidden."""
    saved = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None) if backend.pp_size > 1 else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = saved


def build_accelerator(recipe: Recipe, backend: Backend | None = None) -> Accelerator:
    """The Accelerator for whatever backend the launcher asked for, configured from the recipe."""
    backend = check_launch(recipe, backend)
    trackers = log_with(recipe)  # report_to, refused here when not installed
    isolate_restart_attempts()  # before the process group: a restarted group must not read its predecessors'
    handlers, cpu = [], False
    on_cpu = not torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    if on_cpu:
        gloo = InitProcessGroupKwargs(backend="gloo")
        if backend.kind == "deepspeed":
            # DeepSpeed on CPU shards data only over gloo. ACCELERATE_USE_CPU would make accelerate
            # drop DeepSpeed silently and run plain DDP, so it is ignored here.
            if os.environ.pop("ACCELERATE_USE_CPU", None) is not None:
                log.info("ignoring ACCELERATE_USE_CPU under DeepSpeed (it would disable DeepSpeed)")
            handlers.append(gloo)
        elif (
            backend.pp_size > 1
        ):  # training/parallel/pipeline.py builds the (pp, dp) mesh; gloo between stages
            cpu = True
            handlers.append(gloo)
        elif backend.kind == "fsdp" or backend.mesh:
            cpu = True
            handlers.append(gloo)
            _present_cpu_as_multi_device(gloo)
        elif world_size() > 1:
            # Without cpu=True accelerate inits the process group but leaves the model unwrapped
            # (DistributedType.NO): ranks would train apart without syncing gradients.
            cpu = True
            handlers.append(gloo)
    use_recipe_attention(backend, recipe)  # Ulysses wraps the recipe's attention kernel
    if backend.deepspeed_file is not None:  # found from any working directory; DeepSpeedPlugin reads it again
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(backend.deepspeed_file)
    with _no_accelerate_mesh(backend):
        accelerator = Accelerator(
            cpu=cpu,
            mixed_precision=recipe.precision,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=recipe.train.grad_accum, sync_with_dataloader=False
            ),
            dataloader_config=DataLoaderConfiguration(even_batches=True),
            kwargs_handlers=handlers,
            log_with=trackers or None,
            project_config=project_config(recipe) if trackers else None,
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, recipe)
    if on_cpu:
        _unpinned_cpu_offload(accelerator)
    if (note := precision_note(recipe)) is not None:
        log.warning(note)
    return accelerator


# ----------------------------------------------------------------------------- meshes


def check_model_parallelism(recipe: Recipe, tokenizer, backend: Backend | None = None) -> None:
    """Before any weight loads: the model (from its config alone) can be split as the mesh asks."""
    backend = backend or launched_backend()
    if backend.tp_size > 1:
        check_tensor_parallel(model_config_only(recipe, tokenizer), backend)
    if backend.sp_size > 1:
        check_sequence_parallel(model_config_only(recipe, tokenizer), backend)
    if backend.ep_size > 1:  # experts to shard, a transformers expert-parallel plan, divisible experts
        check_expert_parallel(model_config_only(recipe, tokenizer), backend)
    if backend.pp_size > 1:
        check_pipeline(model_config_only(recipe, tokenizer), backend)


def fill_deepspeed_config(ds: dict, recipe: Recipe) -> None:
    """The recipe decides micro-batch, accumulation and clipping, whatever the JSON says."""
    ds["train_micro_batch_size_per_gpu"] = recipe.train.batch_size
    ds["gradient_accumulation_steps"] = recipe.train.grad_accum
    ds["gradient_clipping"] = recipe.train.max_grad_norm or 0.0
    ds.pop("train_batch_size", None)  # derived by accelerate from the three above and the world size


HIDDEN_SIZE_KEYS = {  # accelerate's fill-ins of DeepSpeed's "auto" sizes, from the model's hidden size
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def fill_hidden_size_keys(accelerator: Accelerator, model) -> None:
    """DeepSpeed's "auto" bucket sizes for a model whose config has no hidden_size of its own (an image-text
    model: its language model's), filled as accelerate does; accelerate would refuse them in `prepare`."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    text = getattr(model.config, "text_config", None)
    if plugin is None or hasattr(model.config, "hidden_size") or text is None:
        return
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    for key, size in HIDDEN_SIZE_KEYS.items():
        if zero.get(key) == "auto":
            zero[key] = size(text.hidden_size)


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


# ----------------------------------------------------------------------------- evaluation


# ----------------------------------------------------------------------------- lean FSDP start-up
