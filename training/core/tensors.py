"""A distributed tensor (torch's DTensor: FSDP2's and tensor/expert parallelism's parameters) recognised by what
it offers, so that the layers below training.parallel never import torch.distributed to ask."""

from __future__ import annotations


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor: it has a device mesh, placements and a local shard."""
    return all(hasattr(t, name) for name in ("device_mesh", "placements", "to_local"))
