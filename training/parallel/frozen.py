"""A frozen model beside the trained one (a distillation teacher), sharded like it where the backend shards
parameters, never trained and without optimizer state:

- FSDP2: `fully_shard` on each decoder layer (the model's `_no_split_modules`) and on the root, over the
  same ranks as the student (plain FSDP: every process); its forward gathers one layer at a time.
- DeepSpeed ZeRO-3: `deepspeed.initialize` with the run's ZeRO config and no optimizer (TRL's
  `prepare_deepspeed` does the same for its reference and teacher models); the model's own forward hooks
  gather each module's parameters as it runs (offload included).
- Anything else (one process, DDP, ZeRO-1/2, meshes with more dimensions than data parallelism): whole on
  every process, as before.

`full_weights(module)` gives a sharded module's weight and bias whole while open (a collective: every rank
opens it the same number of times), for a head whose weights are used outside its model's forward.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
from accelerate import DistributedType
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from training.launch.backend import Backend

log = logging.getLogger(__name__)


def shard_frozen(model: torch.nn.Module, accelerator, backend: Backend, mesh) -> tuple[torch.nn.Module, str]:
    """(the model as this rank holds it, how: for the start-up log). `mesh`: the run's training.parallel.Mesh.
    Returns the module itself (a ZeRO-3 engine stays referenced by its hooks), in eval mode."""
    if accelerator.num_processes == 1 or not backend.shards_parameters:
        return model, "whole on every process"
    if accelerator.distributed_type == DistributedType.FSDP:
        if mesh.device_mesh is not None:  # a 2-D mesh (HSDP, FSDP x TP ...): not for a frozen model yet
            return model, "whole on every process (the launch has a multi-dimensional mesh)"
        layers = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module)
        fully_shard(model)
        return model.eval(), f"sharded by FSDP2 over {accelerator.num_processes} processes{held(model)}"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed  # a ZeRO-3 run has it loaded already

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        how = f"partitioned by ZeRO-3 over {accelerator.num_processes} processes{held(engine.module)}"
        return engine.module, how
    return model, "whole on every process"


def held(model: torch.nn.Module) -> str:
    """': N of M parameters on this process', N counting its shards (FSDP2's local tensors, ZeRO-3's
    partitions)."""
    here = total = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            here, total = here + p.to_local().numel(), total + p.numel()
        elif hasattr(p, "ds_tensor"):
            here, total = here + p.ds_tensor.numel(), total + p.ds_numel
        else:
            here, total = here + p.numel(), total + p.numel()
    return f": {here:,} of {total:,} parameters on this process"


@contextlib.contextmanager
def full_weights(module: torch.nn.Module):
    """(weight, bias) of `module` as whole tensors while open: FSDP2's DTensors gathered (full_tensor), ZeRO-3's
    partitioned parameters gathered in place (GatheredParameters), plain tensors as they are."""
    weight, bias = module.weight, getattr(module, "bias", None)
    if hasattr(weight, "ds_id"):  # ZeRO-3
        import deepspeed

        params = [p for p in (weight, bias) if p is not None]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield weight, bias
        return
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    yield weight, bias


@contextlib.contextmanager
def whole_for_generation(model: torch.nn.Module):
    """A sharded model's weights gathered whole once for a `generate` call, the backend's module hooks set aside
    while it runs: otherwise every decoding step gathers and frees each layer again (12x slower on the agent
    test's tiny model under ZeRO-3). ZeRO-3: its partitions gathered (as TRL's ds3_gather_for_generation); FSDP2:
    each `fully_shard` group unsharded, and resharded after. The ranks still enter together, once per call (the
    engine's `idle` calls match their calls); each then generates on its own, which holds because generation is
    refused beside tensor, sequence and pipeline parallelism (launch/refusals.py): gathered, the weights are plain
    tensors. Yields whether it gathered (not for a model that is not sharded)."""
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if groups:
        for m in groups:
            m.unshard()
        try:
            with hooks_set_aside(model, "torch.distributed.fsdp"):
                yield True
        finally:
            for m in groups:
                m.reshard()
        return
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield False
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None), hooks_set_aside(model, "deepspeed"):
        yield True


@contextlib.contextmanager
def hooks_set_aside(model: torch.nn.Module, package: str):
    """`model`'s forward hooks defined in `package` removed while open, and every hook dict as it was after."""
    kept = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
    for m, pre, post in kept:
        for hooks, old in ((m._forward_pre_hooks, pre), (m._forward_hooks, post)):
            for key in [k for k, h in old.items() if getattr(h, "__module__", "").startswith(package)]:
                del hooks[key]
    try:
        yield
    finally:
        for m, pre, post in kept:
            m._forward_pre_hooks.clear()
            m._forward_pre_hooks.update(pre)
            m._forward_hooks.clear()
            m._forward_hooks.update(post)
