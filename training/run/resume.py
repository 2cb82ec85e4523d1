"""A resume continues the run that wrote the checkpoint, or says why not.

Every checkpoint keeps the resolved recipe that wrote it (`recipe` in trainer_state.json). Resuming with a
recipe that differs from it in anything that changes the training (model, data, method, optimizer and its
schedule, batch shape, precision, seed, objective) would silently train something else from that state: it
is refused naming each key, its value then and now, and the override that accepts the change on purpose
(`resume_changes: [train.lr]`, a key or a whole section). Keys that do not change the trajectory (where and
how often to log, evaluate and save, trackers, kernels and memory switches that compute the same step) may
change freely, and the start-up log lists them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.config import Recipe
from training.core.errors import RecipeError
from training.run.rundir import checkpoint_state

STATE_KEY = "recipe"  # where a checkpoint's trainer_state.json keeps the recipe that wrote it
GLOBAL_BATCH = "global_batch"  # and the rows of one optimizer step (batch x accumulation x data replicas)

# Keys (or sections) whose change leaves the sequence of optimizer steps as it was.
SAME_TRAJECTORY = (
    "output_dir",
    "resume",
    "resume_changes",
    "report_to",
    "eval",
    "checkpoint",
    "train.log_every",
    "train.on_nonfinite",
    "train.collective_timeout_s",
    "train.torch_compile",
    "model.gradient_checkpointing",
    "model.tiled_mlp",  # the same computation, its memory bounded differently
    "model.activation_offloading",
    "data.cache_dir",
    "rl.log_samples",
    "rl.pass_reward",
)


def flatten(raw: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a recipe dict's leaves (a list is one value)."""
    if not isinstance(raw, dict):
        return {prefix: raw}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def covered(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def global_batch(recipe: Recipe, replicas: int) -> int:
    """Rows of one optimizer step: each data-parallel replica's batch, accumulated."""
    return recipe.train.batch_size * recipe.train.grad_accum * replicas


def changes(saved: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """(key, value then, value now) of every leaf that differs, in the recipe's order."""
    old, new = flatten(saved), flatten(now)
    keys = list(new) + [k for k in old if k not in new]
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def check_resume(recipe: Recipe, checkpoint: Path, step_rows: int) -> list[str]:
    """Lines naming the changes the resume takes (same trajectory, or accepted by resume_changes);
    RecipeError naming every other change. The per-process batch and accumulation may change with the
    process count where the global batch (`step_rows`: rows per optimizer step, `global_batch`) stays."""
    try:
        state = checkpoint_state(checkpoint)
    except (OSError, ValueError):  # unreadable: loading it says so
        return []
    saved = state.get(STATE_KEY)
    if saved is None:
        return []
    diffs = changes(saved, recipe.model_dump(mode="json"))
    same_batch = ("train.batch_size", "train.grad_accum") if state.get(GLOBAL_BATCH) == step_rows else ()
    accepted = (*SAME_TRAJECTORY, *same_batch, *(recipe.resume_changes or ()))
    refused = [d for d in diffs if not covered(d[0], accepted)]
    if refused:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise RecipeError(
            f"resume: {checkpoint} was written by a recipe that trained differently: {listed}. Resuming would "
            f"not continue that run. To resume with these changes on purpose, add 'resume_changes=[{keys}]' "
            "to the command (or resume_changes to the recipe); to start afresh, set resume: none or another "
            "output_dir"
        )
    return [f"resume: {k} {old!r} -> {new!r}" for k, old, new in diffs]
