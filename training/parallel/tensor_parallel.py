"""Tensor parallelism with the model's own transformers TP plan on accelerate's tp mesh, and final/
written from a tensor-parallel model as a plain one."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from training.parallel.mesh import Mesh


def apply_tensor_parallel(model, mesh: Mesh):
    """Shard the model with its own transformers tensor-parallel plan on accelerate's "tp" mesh.

    The plan is the model class's (`base_model_tp_plan`: column-wise q/k/v/gate/up, row-wise o/down),
    so every architecture transformers gives a plan works without project code. It is applied to
    the built model on accelerate's own mesh (not through `from_pretrained(distributed_config=...)`,
    which builds a second mesh of its own and cannot be combined with FSDP's dp_shard dimension).
    """
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    size = mesh.tp
    if size == 1:
        return model
    dc = DistributedConfig(tp_size=size)
    plan, _, _ = model._resolve_parallel_plans(dc)  # the class's plan with layer indices expanded
    # A tied output head (lm_head.weight is embed_tokens.weight) is not a parameter of its own: the
    # embedding's shard is its shard (both split the vocabulary dimension), only its forward hook is kept.
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    plan = {name: style for name, style in plan.items() if name in params or name in modules}
    apply_tensor_parallelism(model, mesh.device_mesh["tp"], plan)
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
