"""The one protocol every training objective offers to the step (training.loop.step) and to validation.

An objective decides what a window of micro-batches is normalised by and what each micro-batch's loss
is; the step executor (one per mode of execution) decides how gradients and counts move between
processes. Supervised next-token training (training.objectives.next_token.NextToken), preference tuning
(training.objectives.preference.PreferenceObjective), distillation (training.objectives.distill.Distill)
and online RL (training.rl.objective.RLObjective, whose rollout stage turns a window of prompts into
completions in start_window) implement it, each registered as a kind (training.objectives.registry) and
built from one context: a new objective is a class and a registration, never a branch in the loop.

Collectives reach an objective as values it is given (the Accelerator's `reduce`, a row mask built
from the mesh): objectives never import training.parallel.
"""

from __future__ import annotations

from typing import Protocol

import torch

from training.core.batch import IGNORE


class Objective(Protocol):
    def counts(self, window: list[dict]) -> torch.Tensor:
        """[normaliser, real tokens] of this rank's micro-batches: the loss of the global window is the
        sum of the micro-batch losses divided by the normaliser summed over it (labelled tokens, pairs)."""

    def start_window(self, model, window: list[dict], step: int) -> object:
        """Before the window's forward passes of optimizer step `step` (e.g. reference log-probabilities,
        or RL's rollouts, whose sampling is keyed by the step)."""

    def loss(self, model, batch: dict, i: int) -> tuple[torch.Tensor, object, object]:
        """(summed loss of micro-batch i of the window, its count or None, the model outputs or None)."""

    def trained_batches(self, window: list[dict]) -> list[dict]:
        """The batches the model trains on in this window (after start_window): the window itself, or RL's
        rollouts. The step's model FLOPs are counted from them (training.model.speed)."""

    def step_metrics(self) -> dict:
        """Extra metrics of the window for the metrics row (a collective: every rank calls it)."""

    def eval_sums(self, model, batches, split: str, balance) -> torch.Tensor:
        """Sums over a held-out set's batches, reduced over every rank; `balance` observes MoE routing."""

    def eval_row(self, total: torch.Tensor, suffix: str = "") -> dict:
        """The metrics row (eval_loss, ...) of `eval_sums`' total, keys ending in `suffix`."""

    def eval_line(self, row: dict) -> str:
        """The log line of an eval row."""


def checkpointed(objective) -> list:
    """The objects (with state_dict/load_state_dict) of what an objective keeps from one optimizer step to
    the next and a checkpoint must hold: the set-up registers them with accelerate's checkpointing. Online RL
    keeps its rollouts for rl.num_iterations steps (RLObjective.checkpointed); the others keep nothing and
    need not offer the method."""
    keeps = getattr(objective, "checkpointed", None)
    return keeps() if keeps is not None else []


def kept_rows(mask_rows, rows: torch.Tensor) -> torch.Tensor:
    """[B] bool: which rows of an eval batch count (False for those accelerate repeats to even out the last
    batch), from the mesh's `mask_rows`, which masks the labels of repeated rows."""
    marks = mask_rows({"labels": torch.zeros_like(rows).unsqueeze(1)})
    return marks["labels"][:, 0] != IGNORE
