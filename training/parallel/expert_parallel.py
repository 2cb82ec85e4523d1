"""Expert parallelism (accelerate_configs/ep.yaml): a Mixture-of-Experts model's experts sharded over the
DDP ranks, tokens sent to their experts' rank and back by all-to-all.

It is transformers' own expert-parallel plan (`config.base_model_ep_plan`: the experts' 3-D weights
`grouped_gemm`-sharded on the expert dimension, the experts module `ep_dispatch_experts` with the
`all_to_all` implementation), applied to the built model on a 1-D "ep" mesh of all processes, exactly
as `apply_tensor_parallel` applies the TP plan. It runs over gloo on CPU as on NCCL. What transformers
leaves to its own FSDP when it loads with `DistributedConfig(ep_size=...)`, and what DDP does not know,
is arranged here, in one place:

- every other weight stays whole on every rank and DDP averages its gradients; the sharded expert
  weights are hidden from DDP (`_ddp_params_and_buffers_to_ignore`) and their gradients, which the
  all-to-all backward already sums over every rank's tokens, are divided by the number of ranks so that
  they too are the average DDP would give (the training loss is scaled for DDP's average);
- the gradient norm is the whole model's: accelerate's clip_grad_norm_ already combines plain and
  DTensor gradients (the expert shards' norm reduced over the ranks);
- optimizer groups never mix DTensor and plain parameters (training.model.optim), since torch's foreach
  kernels refuse the mix.
Checkpoints go through training.parallel.checkpoint's DTensor path (torch distributed checkpoint: every rank
writes its expert shards, resume loads them in place), and final/ gathers the whole model.

Why not `from_pretrained(distributed_config=DistributedConfig(ep_size=N))`: it needs a model on disk
(from-scratch models are built from a config), and it FSDP-shards the dense weights with transformers'
own FSDP, outside accelerate's prepare/save/load path that every other backend here uses.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

from training.parallel.mesh import Mesh

log = logging.getLogger(__name__)


def apply_expert_parallel(model, mesh: Mesh, device: torch.device):
    """Shard the model's experts over all ranks with its transformers EP plan, when the launch asks for
    expert parallelism (parallelism_config_ep_size in the accelerate config); else the model unchanged."""
    ep_size = mesh.ep
    if ep_size <= 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    world = torch.distributed.get_world_size()
    if world != ep_size:  # training.launch refuses this before loading; a guard for other callers
        raise ValueError(f"expert parallelism over {ep_size} ranks needs {ep_size} processes, not {world}")
    mesh = init_device_mesh(device.type, (ep_size, 1), mesh_dim_names=("ep", "tp"))
    _, plan, _ = model._resolve_parallel_plans(DistributedConfig(ep_size=ep_size, fsdp_size=ep_size))
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    plan = {name: style for name, style in plan.items() if name in params or name in modules}
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")
    sharded = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    for p in model.parameters():
        if isinstance(p, DTensor):
            p.register_hook(lambda grad: grad / ep_size)  # summed over the ranks' tokens -> their average
    model._ddp_params_and_buffers_to_ignore = sharded
    log.info(
        "expert parallelism: %d expert weights sharded over %d ranks (all-to-all dispatch)",
        len(sharded),
        ep_size,
    )
    return model
