"""Whole-model views of a sharded model: global values of DTensors, the full state dict (collective), tied
weights made one tensor again, FSDP's wrapped classes undone while saving, and evaluation rows that accelerate repeats masked out."""

from __future__ import annotations

import contextlib

from accelerate import (
    Accelerator,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from training.core.batch import IGNORE
from training.parallel.mesh import Mesh


def full_tensor(value):
    """A DTensor's global value (collective: every rank calls it); anything else unchanged."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state_dict(accelerator: Accelerator, model) -> dict:
    """The whole model's state dict on the main process (collective: every rank calls it)."""
    state_dict = accelerator.get_state_dict(model)  # gathers FSDP / ZeRO-3 shards
    if state_dict and any(isinstance(v, DTensor) for v in state_dict.values()):  # tensor parallel only
        state_dict = {k: full_tensor(v) for k, v in state_dict.items()}
    return share_tied_tensors(state_dict, accelerator.unwrap_model(model))


@contextlib.contextmanager
def plain_module_classes(model):
    """While final/ is written: the modules FSDP2 wrapped show their own classes again. fully_shard swaps a
    wrapped module's class for a subclass named FSDP<Class>, and transformers looks up the weight renamings
    that save_pretrained reverts by class name: under the FSDP names an image-text model (LLaVA) would be
    saved with other keys than one process saves."""
    swapped = []
    for m in model.modules():
        cls = type(m)
        if isinstance(m, FSDPModule) and cls.__name__.startswith("FSDP"):
            swapped.append((m, cls))
            m.__class__ = next(b for b in cls.__bases__ if b is not FSDPModule)
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls


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


def mask_repeated_rows(batch: dict, accelerator: Accelerator, mesh: Mesh) -> dict:
    """Labels of the samples that accelerate repeats to give every rank a full last batch, masked.

    With several processes, `even_batches` pads the last global batch with samples from the start
    of the dataset; counting them would make the eval loss depend on the number of processes. The
    real rows of the last global batch come first in rank order (as `gather_for_metrics` assumes).
    """
    state = accelerator.gradient_state
    rank, size = mesh.dp_rank, mesh.dp_size
    if size == 1 or not state.end_of_dataloader or state.remainder <= 0:
        return batch
    rows = batch["labels"].shape[0]
    keep = max(0, min(rows, state.remainder - rank * rows))
    if keep == rows:
        return batch
    labels = batch["labels"].clone()
    labels[keep:] = IGNORE
    return {**batch, "labels": labels}
