"""FSDP2 start-up in which no process holds the whole model (fsdp_cpu_ram_efficient_loading), and
accelerator.prepare for every backend."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import (
    Accelerator,
    DistributedType,
)
from torch.distributed.tensor import DTensor

from training.config import Recipe
from training.parallel.accelerator import fill_hidden_size_keys
from training.parallel.mesh import Mesh
from training.parallel.state_dict import full_state_dict

log = logging.getLogger(__name__)


@dataclass
class LeanStart:
    """FSDP2 with `fsdp_cpu_ram_efficient_loading: true`: no process holds the whole model at start-up.

    pretrained: the main process reads the weights; the others build the model with parameters on
    the meta device (training.model.build.build_model(hollow=True)) and receive their shards from it in
    `accelerator.prepare` (accelerate's own fsdp2_load_full_state_dict: one tensor at a time).
    scratch: every process builds on meta, FSDP shards the empty model, then each process
    initialises only its shards (init_shards_from_scratch), with the values one process would have.
    """

    kind: str  # "pretrained" or "scratch"
    hollow: bool  # this process builds its model on the meta device


def lean_start(recipe: Recipe, accelerator: Accelerator, mesh: Mesh) -> LeanStart | None:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if (
        accelerator.distributed_type != DistributedType.FSDP
        or plugin is None
        or plugin.fsdp_version != 2
        or not plugin.cpu_ram_efficient_loading
        or mesh.tp > 1  # the tensor-parallel plan is applied to built weights
        or recipe.method.type == "qlora"  # accelerate loads 4-bit bases on every rank regardless
        or recipe.data.images is not None  # an image-text model is built (or loaded) whole on every process
        or recipe.method.qat is not None  # torchao swaps the built model's linear layers
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
    fill_hidden_size_keys(accelerator, model)  # DeepSpeed, for a config without hidden_size (image-text)
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
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)  # FSDP2 re-registers its sharded parameters (FSDPModule._apply)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    init = _ShardInit(dtypes, device, {id(p): n for n, p in model.named_parameters()})
    init.stats["total"] = sum(p.numel() for p in model.parameters())
    custom = model.is_custom_code()  # as PreTrainedModel.initialize_weights passes it

    def walk(module, fn) -> list:
        held = []
        for child in module.children():
            held += walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        own = init.materialise(module)
        fn(module, custom)
        init.flush(held)  # the children's tensors, now that this module (their parent) has had its turn
        return own

    now = torch.get_rng_state()
    if start_rng is not None:
        torch.set_rng_state(start_rng)
    with torch.no_grad(), guard_torch_init_functions():
        init.flush(walk(model, model._initialize_weights))
    if start_rng is not None and not torch.equal(now, start_rng):
        torch.set_rng_state(now)  # something drew since the build: keep that stream as it was
    stats = init.stats
    log.info(
        "initialised the new model shard by shard: at most %s of its %s parameter elements whole at once",
        f"{stats['peak']:,}",
        f"{stats['total']:,}",
    )
    if path := os.environ.get("LLM_FORGE_INIT_STATS"):  # tests: what each process materialised
        rank = int(os.environ.get("RANK", "0"))
        Path(f"{path}.rank{rank}.json").write_text(json.dumps({k: stats[k] for k in ("peak", "total")}))


class _ShardInit:
    """init_shards_from_scratch's bookkeeping: full-size tensors given to a module for its turn, and
    each written back into its shard (once per parameter) when its parent's turn is over."""

    def __init__(self, dtypes: dict, device: torch.device, names: dict):
        self.dtypes, self.device, self.names = dtypes, device, names
        self.done: set[int] = set()
        self.stats = {"resident": 0, "peak": 0, "total": 0}

    def materialise(self, module) -> list:
        entries = []
        for name, sharded in list(module._parameters.items()):
            if sharded is None:
                continue
            full = torch.nn.Parameter(
                torch.empty(sharded.shape, dtype=self.dtypes[self.names[id(sharded)]], device=self.device),
                requires_grad=sharded.requires_grad,
            )
            keep = id(sharded) not in self.done
            self.done.add(id(sharded))
            module._parameters[name] = full
            entries.append((module, name, sharded, full, keep))
            self.stats["resident"] += full.numel()
        self.stats["peak"] = max(self.stats["peak"], self.stats["resident"])
        return entries

    def flush(self, entries: list) -> None:
        from torch.distributed.tensor import distribute_tensor

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
            self.stats["resident"] -= full.numel()
