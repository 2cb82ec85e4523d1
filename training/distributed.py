"""The Accelerator for the backend `accelerate launch` asked for, the launches refused before anything
loads, and the backend-specific parts of model building, export and evaluation.

The backend is chosen only by the accelerate config file (accelerate_configs/*.yaml): `accelerate
launch` turns it into environment variables (ACCELERATE_USE_DEEPSPEED, ACCELERATE_USE_FSDP,
WORLD_SIZE, ...) that training.backends reads. The recipe stays the single source of batch size,
accumulation, clipping and precision: the DeepSpeed configs say "auto" and are filled from it here.

CPU-only machines: accelerate runs real multi-process DDP on CPU only when told it is on CPU (without
that it inits the process group but leaves the model unwrapped), DeepSpeed shards over several CPU
processes only with the gloo backend (its default, NCCL, needs GPUs), and FSDP2 / device meshes need
the one adaptation in `_present_cpu_as_multi_device`; `build_accelerator` arranges all three, so the
same config files and commands work with or without GPUs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

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
from torch.distributed.tensor import DTensor
from transformers.integrations import deepspeed as hf_deepspeed

from training.backends import (
    Backend,
    check_expert_parallel,
    check_pipeline,
    check_sequence_parallel,
    check_tensor_parallel,
    launched_backend,
    precision_note,
    refusal,
    world_size,
)
from training.config import Recipe
from training.data import IGNORE
from training.errors import UserError
from training.models import model_config_only
from training.sequence_parallel import cp_size, use_recipe_attention
from training.sequence_parallel import describe as describe_sequence_parallel
from training.trackers import log_with, project_config

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
    pp dimension it does not know. training/pipeline.py builds the (pp, dp) mesh instead: while the
    Accelerator is created, the variable is hidden."""
    saved = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None) if backend.pp_size > 1 else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = saved


def build_accelerator(recipe: Recipe) -> Accelerator:
    """The Accelerator for whatever backend the launcher asked for, configured from the recipe."""
    backend = check_launch(recipe)
    trackers = log_with(recipe)  # report_to, refused here when not installed
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
        elif backend.pp_size > 1:  # training/pipeline.py builds the (pp, dp) mesh; gloo between stages
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


def tp_size(accelerator: Accelerator) -> int:
    pc = accelerator.parallelism_config
    return pc.tp_size if pc is not None and pc.tp_enabled else 1


def data_parallel(accelerator: Accelerator) -> tuple[int, int]:
    """(this rank's data-parallel index, data-parallel size): ranks of one tensor- or context-parallel
    group share a batch, so they are one data-parallel rank (as accelerate's loaders shard the data)."""
    group = tp_size(accelerator) * cp_size(accelerator)
    return accelerator.process_index // group, accelerator.num_processes // group


def describe_mesh(accelerator: Accelerator) -> str:
    """e.g. "mesh dp_shard=2 x tp=2", "DeepSpeed Ulysses sp=2", or "" without a parallelism_config."""
    mesh = accelerator.torch_device_mesh if accelerator.parallelism_config is not None else None
    if mesh is None:  # DeepSpeed Ulysses builds its own groups, no torch mesh
        return describe_sequence_parallel(accelerator)  # "" too for ep.yaml (accelerate sizes all 1)
    return "mesh " + " x ".join(f"{n}={mesh[n].size()}" for n in mesh.mesh_dim_names)


def check_model_parallelism(recipe: Recipe, tokenizer) -> None:
    """Before any weight loads: the model (from its config alone) can be split as the mesh asks."""
    backend = launched_backend()
    if backend.tp_size > 1:
        check_tensor_parallel(model_config_only(recipe, tokenizer), backend)
    if backend.sp_size > 1:
        check_sequence_parallel(model_config_only(recipe, tokenizer), backend)
    if backend.ep_size > 1:  # experts to shard, a transformers expert-parallel plan, divisible experts
        check_expert_parallel(model_config_only(recipe, tokenizer), backend)
    if backend.pp_size > 1:
        check_pipeline(model_config_only(recipe, tokenizer), backend)


def apply_tensor_parallel(model, accelerator: Accelerator):
    """Shard the model with its own transformers tensor-parallel plan on accelerate's "tp" mesh.

    The plan is the model class's (`base_model_tp_plan`: column-wise q/k/v/gate/up, row-wise o/down),
    so every architecture transformers gives a plan works without project code. It is applied to
    the built model on accelerate's own mesh (not through `from_pretrained(distributed_config=...)`,
    which builds a second mesh of its own and cannot be combined with FSDP's dp_shard dimension).
    """
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    size = tp_size(accelerator)
    if size == 1:
        return model
    dc = DistributedConfig(tp_size=size)
    plan, _, _ = model._resolve_parallel_plans(dc)  # the class's plan with layer indices expanded
    # A tied output head (lm_head.weight is embed_tokens.weight) is not a parameter of its own: the
    # embedding's shard is its shard (both split the vocabulary dimension), only its forward hook is kept.
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    plan = {name: style for name, style in plan.items() if name in params or name in modules}
    apply_tensor_parallelism(model, accelerator.torch_device_mesh["tp"], plan)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # point the head at the sharded embedding again
    model.config.distributed_config = dc  # accelerate reads the tp size from here
    _ensure_replicate_parallel()
    return model


def _ensure_replicate_parallel() -> None:
    """accelerate 1.15's FSDP2 x TP preparation (Accelerator._prepare_tp) imports
    transformers.integrations.tensor_parallel.ReplicateParallel, which transformers 5 removed: any
    dp_shard x tp mesh fails with ImportError, on GPUs too. It only makes the parameters the plan leaves
    whole (norms) Replicate DTensors on the tp mesh, with hooks that give such a module DTensor inputs
    and a local output. This restores that class when it is missing."""
    import transformers.integrations.tensor_parallel as hf_tp
    from torch.distributed.tensor import Replicate, distribute_module

    if hasattr(hf_tp, "ReplicateParallel"):
        return

    def to_dtensor(module, inputs, mesh):
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(module, outputs, mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    class ReplicateParallel:
        def prepare_module_tp(self, module, device_mesh):
            if getattr(module, "_llm_forge_replicated", False):  # called once per parameter
                return
            distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)
            module._llm_forge_replicated = True

    hf_tp.ReplicateParallel = ReplicateParallel


@contextlib.contextmanager
def saved_as_plain_model(model):
    """While final/ is written: a tensor-parallel model's config says so (`distributed_config`, which
    accelerate reads in `prepare`), and `save_pretrained` would then gather and synchronise by itself,
    on the main process only (a hang). final/ gets the already gathered state dict and a config
    without distributed settings, loadable anywhere."""
    config = model.config
    saved = getattr(config, "distributed_config", None)
    config.distributed_config = None
    try:
        yield
    finally:
        config.distributed_config = saved


def full_tensor(value):
    """A DTensor's global value (collective: every rank calls it); anything else unchanged."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state_dict(accelerator: Accelerator, model) -> dict:
    """The whole model's state dict on the main process (collective: every rank calls it)."""
    state_dict = accelerator.get_state_dict(model)  # gathers FSDP / ZeRO-3 shards
    if state_dict and any(isinstance(v, DTensor) for v in state_dict.values()):  # tensor parallel only
        state_dict = {k: full_tensor(v) for k, v in state_dict.items()}
    return share_tied_tensors(state_dict, accelerator.unwrap_model(model))


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


def mask_repeated_rows(batch: dict, accelerator: Accelerator, dp: tuple[int, int] | None = None) -> dict:
    """Labels of the samples that accelerate repeats to give every rank a full last batch, masked.

    With several processes, `even_batches` pads the last global batch with samples from the start
    of the dataset; counting them would make the eval loss depend on the number of processes. The
    real rows of the last global batch come first in rank order (as `gather_for_metrics` assumes).
    """
    state = accelerator.gradient_state
    rank, size = dp or data_parallel(accelerator)  # dp: (rank, size) of a pipeline's replicas
    if size == 1 or not state.end_of_dataloader or state.remainder <= 0:
        return batch
    rows = batch["labels"].shape[0]
    keep = max(0, min(rows, state.remainder - rank * rows))
    if keep == rows:
        return batch
    labels = batch["labels"].clone()
    labels[keep:] = IGNORE
    return {**batch, "labels": labels}


# ----------------------------------------------------------------------------- lean FSDP start-up


@dataclass
class LeanStart:
    """FSDP2 with `fsdp_cpu_ram_efficient_loading: true`: no process holds the whole model at start-up.

    pretrained: the main process reads the weights; the others build the model with parameters on
    the meta device (training.models.build_model(hollow=True)) and receive their shards from it in
    `accelerator.prepare` (accelerate's own fsdp2_load_full_state_dict: one tensor at a time).
    scratch: every process builds on meta, FSDP shards the empty model, then each process
    initialises only its shards (init_shards_from_scratch), with the values one process would have.
    """

    kind: str  # "pretrained" or "scratch"
    hollow: bool  # this process builds its model on the meta device


def lean_start(recipe: Recipe, accelerator: Accelerator) -> LeanStart | None:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if (
        accelerator.distributed_type != DistributedType.FSDP
        or plugin is None
        or plugin.fsdp_version != 2
        or not plugin.cpu_ram_efficient_loading
        or tp_size(accelerator) > 1  # the tensor-parallel plan is applied to built weights
        or recipe.method.type == "qlora"  # accelerate loads 4-bit bases on every rank regardless
    ):
        return None
    if recipe.model.from_scratch is None:
        return LeanStart("pretrained", hollow=not accelerator.is_main_process)
    if recipe.method.type != "full":  # adapters on a new model: initialised by peft, not replayed here
        return None
    return LeanStart("scratch", hollow=True)


def prepare_model(accelerator: Accelerator, lean: LeanStart | None, model, optimizer, train_dl):
    """accelerator.prepare(model, optimizer, train_dl), with the lean start's two additions.

    accelerate (1.15, _prepare_fsdp2) re-points the optimizer at the sharded parameters by matching
    `data_ptr()`, which is 0 for every meta tensor: all would map to one parameter. The groups are
    re-pointed here by parameter name instead. A new model skips accelerate's broadcast from the main
    process (there is nothing to broadcast) and is initialised shard by shard afterwards."""
    if lean is None:
        return dump_initial_weights(accelerator, *accelerator.prepare(model, optimizer, train_dl))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    dtypes = {n: p.dtype for n, p in model.named_parameters()}  # before FSDP's fp32 upcast
    plugin = accelerator.state.fsdp_plugin
    start_rng = getattr(model, "_llm_forge_init_rng", None)
    if lean.kind == "scratch":
        plugin.cpu_ram_efficient_loading = False
    try:
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    finally:
        plugin.cpu_ram_efficient_loading = True
    params = dict(accelerator.unwrap_model(model).named_parameters())
    for group, group_names in zip(optimizer.param_groups, groups):
        group["params"] = [params[n] for n in group_names]
    if lean.kind == "scratch":
        init_shards_from_scratch(accelerator.unwrap_model(model), dtypes, accelerator.device, start_rng)
    return dump_initial_weights(accelerator, model, optimizer, train_dl)


def dump_initial_weights(accelerator: Accelerator, model, *rest):
    """LLM_FORGE_DUMP_INITIAL=file.safetensors (tests): the prepared model's full initial state dict,
    gathered (collective) and written by the main process, to compare start-ups across backends."""
    if path := os.environ.get("LLM_FORGE_DUMP_INITIAL"):
        from safetensors.torch import save_file

        state = full_state_dict(accelerator, model)
        if accelerator.is_main_process:
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, path)
        accelerator.wait_for_everyone()
    return (model, *rest)


def init_shards_from_scratch(model, dtypes: dict, device: torch.device, start_rng=None) -> None:
    """Give a new FSDP2-sharded model on the meta device its initial weights, shard by shard.

    One process initialises a new model with transformers' walk (PreTrainedModel.initialize_weights:
    children first, then `_init_weights(module)`), drawing from the global random stream. Here every
    process walks the same modules in the same order, gives each module's parameters a full-size
    tensor of their original dtype only for that module's turn, runs the same `_initialize_weights`
    (so it draws exactly what one process draws), keeps its own shard and frees the full tensor.
    As in transformers' ZeRO-3 walk, `_init_weights(module)` may also write its direct children's
    parameters (GPT-2 rescales `c_proj`), so a module's full tensors are kept until its parent's turn
    has run: at most one module with its children is whole at a time, never the whole model.
    A parameter met a second time (a tied output head) gets a throw-away tensor, as the untied head of
    a one-process build does before `tie_weights` discards it. Buffers keep their values.
    """
    from torch.distributed.tensor import distribute_tensor
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)  # FSDP2 re-registers its sharded parameters (FSDPModule._apply)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    names = {id(p): n for n, p in model.named_parameters()}
    done: set[int] = set()
    stats = {"resident": 0, "peak": 0, "total": sum(p.numel() for p in model.parameters())}

    def materialise(module) -> list:
        entries = []
        for name, sharded in list(module._parameters.items()):
            if sharded is None:
                continue
            full = torch.nn.Parameter(
                torch.empty(sharded.shape, dtype=dtypes[names[id(sharded)]], device=device),
                requires_grad=sharded.requires_grad,
            )
            keep = id(sharded) not in done
            done.add(id(sharded))
            module._parameters[name] = full
            entries.append((module, name, sharded, full, keep))
            stats["resident"] += full.numel()
        stats["peak"] = max(stats["peak"], stats["resident"])
        return entries

    def flush(entries: list) -> None:
        for module, name, sharded, full, keep in entries:
            if keep:
                value = full.detach().to(sharded.dtype)
                if isinstance(sharded, DTensor):
                    value = distribute_tensor(
                        value, sharded.device_mesh, sharded.placements, src_data_rank=None
                    )
                    sharded.to_local().copy_(value.to_local())
                else:
                    sharded.copy_(value)
            module._parameters[name] = sharded
            stats["resident"] -= full.numel()

    custom = model.is_custom_code()  # as PreTrainedModel.initialize_weights passes it

    def walk(module, fn) -> list:
        held = []
        for child in module.children():
            held += walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        own = materialise(module)
        fn(module, custom)
        flush(held)  # the children's tensors, now that this module (their parent) has had its turn
        return own

    now = torch.get_rng_state()
    if start_rng is not None:
        torch.set_rng_state(start_rng)
    with torch.no_grad(), guard_torch_init_functions():
        flush(walk(model, model._initialize_weights))
    if start_rng is not None and not torch.equal(now, start_rng):
        torch.set_rng_state(now)  # something drew since the build: keep that stream as it was
    log.info(
        "initialised the new model shard by shard: at most %s of its %s parameter elements whole at once",
        f"{stats['peak']:,}",
        f"{stats['total']:,}",
    )
    if path := os.environ.get("LLM_FORGE_INIT_STATS"):  # tests: what each process materialised
        rank = int(os.environ.get("RANK", "0"))
        Path(f"{path}.rank{rank}.json").write_text(json.dumps({k: stats[k] for k in ("peak", "total")}))
