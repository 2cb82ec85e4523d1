"""Validation: the held-out loss (and perplexity, or the objective's own metrics) during training."""

from __future__ import annotations

import itertools
import logging

import torch

from training.data import eval_split_names
from training.loop.run import Run

log = logging.getLogger("training")


@torch.no_grad()
def evaluate(run: Run) -> None:
    """Eval loss (and perplexity, or the reward metrics) over the held-out data (each set's first
    eval.max_batches), logged as a row. Named sets (data.eval: {web: ..., code: ...}) are scored on
    their own as eval_loss/NAME, ...; eval_loss itself covers the tokens (pairs) of all of them."""
    acc, model, objective, limit = run.accelerator, run.model, run.objective, run.recipe.eval.max_batches
    named = isinstance(run.recipe.data.eval, dict)
    split_of = {name: split for split, name in eval_split_names(run.recipe.data).items()}  # reference keys
    model.eval()
    balance = run.router.begin(acc, model, [])  # MoE: expert load on eval text
    totals = {
        name: run.executor.eval_sums(objective, itertools.islice(loader, limit), split_of[name], balance)
        for name, loader in run.eval_dls.items()
    }
    model.train()
    row = objective.eval_row(sum(totals.values()))
    for name, total in totals.items() if named else ():
        row |= objective.eval_row(total, f"/{name}")
    run.metrics.write({"step": run.step, **row, **balance.finish("eval_")})
    log.info("step %d: %s", run.step, objective.eval_line(row))
    for name in totals if named else ():
        own = {k.removesuffix(f"/{name}"): v for k, v in row.items() if k.endswith(f"/{name}")}
        log.info("step %d:   %s: %s", run.step, name, objective.eval_line(own))
