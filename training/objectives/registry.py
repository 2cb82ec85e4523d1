"""Objectives as plug-ins: each objective module registers a kind (what recipes it applies to, how it is built,
and the data pass it needs, if any), and the training set-up asks `kind_of(recipe)` which one a recipe trains
with. Adding an objective touches its own module and one import in its package's `__init__`; nothing in
training/loop.

Every kind is built from one typed `ObjectiveContext`, which the set-up fills once (collectives and sharding
come in as callables: objectives never import training.parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from training.config import Recipe
from training.core.errors import RecipeError
from training.objectives.base import Objective
from training.run.rundir import RunDir


@dataclass(frozen=True)
class ObjectiveContext:
    """What an objective is built from."""

    recipe: Recipe
    accelerator: Any  # accelerate's Accelerator: device, reduce, unwrap_model, process counts
    tokenizer: Any
    model: torch.nn.Module  # the prepared model the step executor trains, still with its initial weights
    splits: dict  # "train" and the held-out splits by their objective names -> tokenized dataset (or None)
    mask_rows: Callable[[dict], dict]  # masks the rows accelerate repeats to even out the last eval batch
    dp: tuple[int, int]  # (data-parallel rank, data-parallel size)
    run_dir: RunDir
    synced: bool  # parameters sharded over several processes (ZeRO-3/FSDP): generation steps together
    shard_frozen: Callable  # a frozen model (a teacher) -> (it sharded like the trained model, how)
    full_weights: Callable  # a (sharded) module -> its whole weights, for a head computed by hand
    gather: Callable[[list], list]  # every process's objects, in rank order (a collective)
    # a model -> a context in which ZeRO-3's or FSDP2's sharded weights are whole for one generation call (yields
    # whether it gathered: training.parallel.frozen.whole_for_generation)
    whole_for_generation: Callable
    upcoming: Callable[[int], list[list[dict]]] = lambda n: []  # the loop's next n windows (read ahead)
    total_steps: int = 0  # the run's optimizer steps


@dataclass(frozen=True)
class DataPass:
    """What an objective's data pass is given: the datasets as training.data built them."""

    recipe: Recipe
    tokenizer: Any
    train: Any  # the training split (None when streamed)
    evals: dict  # held-out name -> dataset
    device: torch.device


@dataclass(frozen=True)
class ObjectiveKind:
    """One registered objective: `applies(recipe)` says whether a recipe trains with it (kinds are asked in
    order of `priority`, highest first); `build(context)` makes it; `prepare_data(pass)`, where given, runs once
    before the model loads (the main process first) and returns (train, evals) with what the objective reads
    from the batches (distillation's precomputed top-k of the teacher)."""

    name: str
    applies: Callable[[Recipe], bool]
    build: Callable[[ObjectiveContext], Objective]
    priority: int = 0
    prepare_data: Callable[[DataPass], tuple] | None = None


_KINDS: dict[str, ObjectiveKind] = {}


def register(kind: ObjectiveKind) -> ObjectiveKind:
    """Add (or replace, by name) an objective kind."""
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def kinds() -> list[ObjectiveKind]:
    """The registered kinds, in the order they are asked."""
    return sorted(_KINDS.values(), key=lambda k: -k.priority)


def kind_of(recipe: Recipe) -> ObjectiveKind:
    """The objective the recipe trains with: the first registered kind that applies."""
    for kind in kinds():
        if kind.applies(recipe):
            return kind
    names = ", ".join(k.name for k in kinds()) or "none"
    raise RecipeError(
        f"{recipe._source}: no registered objective applies to this recipe (registered: {names})"
    )
