"""Tiled MLP (the sequence tiling of Arctic Long Sequence Training): each decoder layer's MLP runs over
tiles of the sequence, each tile under its own activation checkpoint, so the MLP's intermediate activations
(intermediate_size wide, 3-4x the hidden size) exist for one tile at a time, in the forward and in the
backward, instead of for the whole sequence.

Each tile is torch.utils.checkpoint'ed (non-reentrant): its forward keeps only the tile's input (a view of
the layer's normed hidden states, which are kept anyway); its backward recomputes that one tile. This nests
inside gradient checkpointing of the whole layer and works under every backend that checkpointing does.
The output is exact (each token's MLP is the same computation); the weight gradients are the same sums
taken tile by tile, equal up to float rounding of the order of additions.

The decoder layer's norms (its RMSNorm / LayerNorm children, which normalise each token's hidden vector) are
tiled the same way. Once the MLP is tiled they are the layer's largest remainder: their fp32 working copies
and the temporaries of their backward, about 18 bytes per hidden feature and token in bf16 beyond the layer's
saved tensors, made the post-attention norm's backward the recomputed layer's peak past ~12K tokens at the
Llama-3-8B shape (measured: docs/long-context.md).

`model.tiled_mlp`: true = tiles of about hidden_size tokens (ALST's "auto": ceil(seq / hidden_size)), or a
tile count. Only dense MLPs are tiled: a Mixture-of-Experts block routes each token and records its router's
logits for the load-balancing loss once per call, so it is left whole (said at start-up)."""

from __future__ import annotations

import inspect
import logging
import math
import types

import torch
from torch.utils.checkpoint import checkpoint

from training.core.errors import RecipeError

log = logging.getLogger(__name__)

MLP_NAMES = ("mlp", "feed_forward", "ffn")
_MOE_MARKS = ("expert", "router")
_NORM_CLASSES = ("RMSNorm", "LayerNorm")


def tile_count(tiles: bool | int, seq_len: int, hidden_size: int) -> int:
    """How many tiles a sequence of seq_len tokens is cut into (never more than its tokens)."""
    n = math.ceil(seq_len / hidden_size) if tiles is True else int(tiles)
    return max(1, min(n, seq_len))


def tiled_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    """A per-token block's forward ([..., seq, hidden] -> same shape) over sequence tiles; bound to the MLP
    or norm, whose `_tiled` holds (its own forward function, tiles, hidden_size). A bound method, so that a
    deep copy of the model (RL's reference) runs its own copy of the block."""
    forward, tiles, hidden_size = self._tiled
    dim = hidden.dim() - 2 if hidden.dim() >= 2 else 0
    n = tile_count(tiles, hidden.shape[dim], hidden_size)
    if n == 1 or not torch.is_grad_enabled():
        return forward(self, hidden)
    parts = hidden.split(math.ceil(hidden.shape[dim] / n), dim=dim)
    return torch.cat(
        [checkpoint(_on_tile, forward, self, part, use_reentrant=False) for part in parts], dim=dim
    )


def _on_tile(forward, module: torch.nn.Module, part: torch.Tensor) -> torch.Tensor:
    """The block's forward on one tile, made contiguous inside the checkpoint: a tile of a batch of several
    rows is a strided view, which blocks that `view` their input (GPT-2's Conv1D) refuse; the copy lives for
    the tile's forward and its recompute only (the checkpoint keeps the view)."""
    return forward(module, part.contiguous())


def _one_tensor_in(module: torch.nn.Module) -> bool:
    params = [
        p
        for p in inspect.signature(type(module).forward).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(params) == 1


def _routes(module: torch.nn.Module) -> bool:
    """A Mixture-of-Experts block: experts or a router among its modules or parameters."""
    names = [n.lower() for n, _ in module.named_modules()] + [n.lower() for n, _ in module.named_parameters()]
    return any(mark in n for n in names for mark in _MOE_MARKS)


def is_dense_mlp(module: torch.nn.Module) -> bool:
    """A feed-forward block that maps each token on its own: no experts or router, one tensor in."""
    return not _routes(module) and _one_tensor_in(module)


def is_token_norm(module: torch.nn.Module) -> bool:
    """An RMSNorm or LayerNorm over each token's hidden vector (torch's and the models' own classes): no
    children, one tensor in. Gated norms (Mamba's, which take the gate too) are not."""
    return (
        type(module).__name__.endswith(_NORM_CLASSES)
        and next(module.children(), None) is None
        and _one_tensor_in(module)
    )


def _tile(module: torch.nn.Module, tiles: bool | int, hidden_size: int) -> None:
    # the forward the instance has now (Liger binds its own there), as a plain function
    own = getattr(module.forward, "__func__", type(module).forward)
    module._tiled = (own, tiles, hidden_size)
    module.forward = types.MethodType(tiled_forward, module)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks: instances of the classes in its `_no_split_modules`."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in classes]


def apply_tiled_mlp(model, tiles: bool | int) -> int:
    """Tile every dense MLP of the model's decoder layers, and their norms, in place (state-dict keys
    unchanged); the number of MLPs tiled. Refused (RecipeError naming model.tiled_mlp) when the model has
    none."""
    # BLT's text config names no hidden_size: the width its embeddings have
    hidden_size = (
        getattr(model.config.get_text_config(), "hidden_size", None)
        or model.get_input_embeddings().embedding_dim
    )
    layers = decoder_layers(model)
    blocks = [
        m
        for layer in layers
        for m in (getattr(layer, n, None) for n in MLP_NAMES)
        if isinstance(m, torch.nn.Module)
    ]
    dense = [m for m in blocks if is_dense_mlp(m)]
    whole = _left_whole([m for m in blocks if m not in dense])
    if not dense:
        raise RecipeError(
            f"model.tiled_mlp: {model.config.model_type} has no dense MLP in its decoder layers to tile"
            + (f" ({whole})" if whole else "")
        )
    norms = [m for layer in layers for m in layer.children() if is_token_norm(m)]
    for module in dense + norms:
        _tile(module, tiles, hidden_size)
    how = "tiles of about hidden_size tokens" if tiles is True else f"{tiles} tiles per sequence"
    log.info(
        "tiled MLP: %d decoder layers' MLPs and %d norms run over %s, each tile recomputed in the backward%s",
        len(dense),
        len(norms),
        how,
        f"; {whole}" if whole else "",
    )
    return len(dense)


def _left_whole(blocks: list[torch.nn.Module]) -> str:
    """Why the MLP blocks that are not tiled stay whole: Mixture-of-Experts blocks route tokens; the others
    (BLOOM's, MPT's, RWKV's) take more than the hidden states."""
    routed = [_routes(m) for m in blocks]
    other = sorted({type(m).__name__ for m, r in zip(blocks, routed) if not r})
    parts = (
        [f"{sum(routed)} Mixture-of-Experts blocks are left whole: they route tokens"] if any(routed) else []
    )
    if other:
        parts.append(f"the forward of {', '.join(other)} takes more than the hidden states")
    return "; ".join(parts)
