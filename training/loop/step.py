"""One optimizer step, and the two ways of executing it: chosen once at set-up, as torchtitan picks
`pp_forward_backward_step` beside `forward_backward_step`.

    train_step(run, window, stop)   counts -> forward/backward -> clip -> reduce -> StepStats -> apply_step

The loss is normalised by the objective's count (labelled tokens; pairs for preference tuning) over the
whole global window, so gradient accumulation, DDP, ZeRO, FSDP and pipeline replicas all give the loss of
one process seeing the global batch. The step ends with one host synchronisation (`.tolist()` on a reduced
tensor): the non-finite guard must know the loss and gradient norm before deciding to step, and every rank
must agree on a graceful stop before the next step starts.

The executors offer the same operations: the StepExecutor protocol (training.loop.run), which both satisfy
(checked by a test).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from accelerate import Accelerator, DistributedType

from training.config import Recipe
from training.core import faults
from training.core.errors import TrainingAborted
from training.loop.run import GracefulStop, Run, StepStats
from training.objectives.base import Objective
from training.parallel import pipeline
from training.parallel.mesh import Mesh
from training.parallel.sequence_parallel import counted_once, sequence_shards
from training.parallel.state_dict import full_state_dict, full_tensor

log = logging.getLogger("training")


@dataclass
class DataParallelStep:
    """Every backend that accelerate prepares (single, DDP, FSDP2, ZeRO, tensor/context/sequence/expert
    parallelism): each process runs the whole model (or its shards) on its micro-batches.

    Under tensor parallelism the ranks of one group count the same rows: numerator and denominator both
    carry the factor, and so does `world_scale`, while TP does not average gradients; it cancels. Under
    sequence/context parallelism each rank computes the loss of its shard of the sequences and
    `counted_once` counts every token once over the group."""

    accelerator: Accelerator
    mesh: Mesh
    model: torch.nn.Module
    padding_free = True  # packed rows may go padding-free (varlen attention; class attribute)

    def global_counts(self, counts: torch.Tensor) -> tuple[float, int, float]:
        n, tokens, flops = self.accelerator.reduce(counted_once(self.mesh, counts), "sum").tolist()
        return n, int(tokens) // self.mesh.tp, flops / self.mesh.tp

    def forward_backward(self, objective: Objective, balance, window: list[dict], n: float, step: int):
        acc, model = self.accelerator, self.model
        world_scale = acc.num_processes * len(window)  # undoes DDP's and accumulation's averaging
        loss_sum = torch.zeros((), device=acc.device)
        for i, batch in enumerate(window):
            with acc.accumulate(model), sequence_shards(self.mesh, acc, batch):  # CP: shards the batch
                s, _, outputs = objective.loss(model, batch, i)
                s = faults.inject(
                    step, s
                )  # test-only: NaN loss, SIGKILL or SIGTERM mid-step (LLM_FORGE_FAULT)
                # + this micro-batch's share of the router's load-balancing loss (MoE; 0 for dense models)
                acc.backward(s * world_scale / max(n, 1) + balance.loss(outputs, batch) * world_scale)
                loss_sum += s.detach()
        return loss_sum

    def clip(self, max_norm: float | None) -> float:
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm or float("inf"))
        return float(full_tensor(norm)) if norm is not None else float("nan")

    def sum_over_all(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, "sum")

    def eval_sums(self, objective: Objective, batches, split: str, balance) -> torch.Tensor:
        return objective.eval_sums(self.model, batches, split, balance)

    def full_state_dict(self) -> dict:
        return full_state_dict(self.accelerator, self.model)  # collective: gathers shards

    def whole_model(self):
        return self.accelerator.unwrap_model(self.model)

    def checkpoint_pairs(self, optimizer):
        return None  # accelerate's save_state/load_state hold model and optimizer

    def first_row(self) -> dict:
        return {}

    @staticmethod
    def eval_batch_size(recipe: Recipe) -> int:
        return recipe.eval_batch_size

    def tolerates_nonfinite_norm(self) -> bool:
        """DeepSpeed reports no finite gradient norm of its own before stepping (it skips by itself)."""
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED


@dataclass
class PipelineStep:
    """Pipeline stages (training.parallel.pipeline): the schedule runs the micro-batches through the
    stages, the loss lives on the last stage, the data are sharded over the replicas only."""

    pipe: pipeline.Pipeline
    mask_rows: object  # masks the rows accelerate repeats in the last eval batch (over the replicas)
    padding_free = False  # the stages exchange activations of one fixed shape (class attribute)

    @property
    def model(self) -> torch.nn.Module:
        return self.pipe.module

    def global_counts(self, counts: torch.Tensor) -> tuple[float, int, float]:
        n, tokens, flops = pipeline.reduce_over_replicas(self.pipe, counts).tolist()
        return n, int(tokens), flops

    def forward_backward(self, objective: Objective, balance, window: list[dict], n: float, step: int):
        return pipeline.forward_backward(self.pipe, window, n, lambda loss: faults.inject(step, loss))

    def clip(self, max_norm: float | None) -> float:
        return pipeline.clip(self.pipe, max_norm)

    def sum_over_all(self, t: torch.Tensor) -> torch.Tensor:
        return pipeline.sum_over_all(t)

    def eval_sums(self, objective: Objective, batches, split: str, balance) -> torch.Tensor:
        return pipeline.eval_totals(self.pipe, batches, self.mask_rows)

    def full_state_dict(self) -> dict:
        return pipeline.full_state_dict(self.pipe)  # every stage holds a part: gathered on rank 0

    def whole_model(self):
        return pipeline.whole_model(self.pipe)

    def checkpoint_pairs(self, optimizer):
        return [(self.pipe.module, optimizer)]  # every stage's files, through torch DCP

    def first_row(self) -> dict:
        return pipeline.first_row(self.pipe)

    @staticmethod
    def eval_batch_size(recipe: Recipe) -> int:
        return recipe.train.batch_size  # the stages exchange activations of one shape

    def tolerates_nonfinite_norm(self) -> bool:
        return False


def train_step(run: Run, window: list[dict], stop: GracefulStop) -> StepStats:
    """One optimizer step over the micro-batches of `window` (this rank's share of the global window)."""
    ex, objective, step = run.executor, run.objective, run.step + 1
    objective.start_window(ex.model, window, step)  # reference log-probabilities, KTO's KL point, rollouts
    counts = objective.counts(window)  # counted before the forward passes (context parallelism shards)
    flops = run.speed.window_flops(objective.trained_batches(window), counts.device)  # for MFU
    n, tokens, flops = ex.global_counts(torch.cat([counts.double(), flops.reshape(1)]))  # one reduction
    balance = run.router.begin(run.accelerator, ex.model, window)  # MoE: exact over the window
    loss_sum = ex.forward_backward(objective, balance, window, n, step)
    grad_norm = ex.clip(run.recipe.train.max_grad_norm)
    flags = torch.stack([loss_sum.float(), torch.tensor(float(stop.requested), device=loss_sum.device)])
    loss_total, stops = ex.sum_over_all(flags).tolist()
    stats = StepStats(loss_total / max(n, 1), grad_norm, tokens, stops > 0, flops)
    stats.moe, stats.metrics = balance.finish(), objective.step_metrics()
    check_some_gradient(stats, n, step)
    return apply_step(run, stats)


def check_some_gradient(stats: StepStats, n: float, step: int) -> None:
    """A step whose trained parameters all got exactly zero gradient trains nothing: TrainingAborted (exit 3)
    naming the likely cause, except where no signal is the data's answer (online RL whose every group
    scored alike: a warning). A norm that is not known (DeepSpeed's, nan here) is not judged."""
    if stats.grad_norm != 0.0 or not math.isfinite(stats.loss):
        return
    if stats.metrics.get("frac_reward_zero_std") == 1.0:
        log.warning("step %d: every group's completions scored alike: no advantage, zero gradient", step)
        return
    cause = (
        "the step's batches hold no labelled token (every label masked or cut: data.train_on, data.max_length)"
        if n == 0
        else f"its loss ({stats.loss:.6g}) does not reach any trained parameter: a loss computed without them "
        "(a fused or custom loss kernel that returns no gradient, adapters outside the forward, or every "
        "trained parameter detached)"
    )
    raise TrainingAborted(
        f"step {step}: every trained parameter's gradient is exactly zero, so the step would train nothing; "
        f"{cause}. The last good checkpoint is kept"
    )


def apply_step(run: Run, stats: StepStats) -> StepStats:
    """The optimizer and scheduler step of a computed window, unless the loss or norm is not finite."""
    acc, step, grad_norm = run.accelerator, run.step + 1, stats.grad_norm
    finite = math.isfinite(stats.loss) and (
        math.isfinite(grad_norm) or run.executor.tolerates_nonfinite_norm()
    )
    if finite:
        run.optimizer.step()
        if not acc.optimizer_step_was_skipped:
            run.scheduler.step()
    elif run.recipe.train.on_nonfinite == "stop":
        where = nonfinite_grads(run.executor.model)
        run.optimizer.zero_grad(set_to_none=True)
        raise TrainingAborted(
            f"non-finite loss ({stats.loss}) or gradient norm ({grad_norm}) at step {step}{where}; "
            f"the last good checkpoint is kept (train.on_nonfinite=skip would skip such steps)"
        )
    else:
        run.skipped += 1
        log.warning(
            "step %d: non-finite loss/grad norm%s, step skipped (%d so far)",
            step,
            nonfinite_grads(run.executor.model),
            run.skipped,
        )
    run.optimizer.zero_grad(set_to_none=True)
    run.step = step
    return stats


def nonfinite_grads(model: torch.nn.Module, shown: int = 3) -> str:
    """Where a non-finite step's gradients are not finite, for its message: the first parameters (in the
    model's order, so the one nearest the input comes first) whose gradient on this rank (its shard under
    FSDP) holds NaN or inf, and how many there are; "" when none does (a NaN loss before any gradient, or
    gradients that DeepSpeed keeps)."""
    bad = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor's shard
        if not bool(torch.isfinite(local).all()):
            bad.append(name)
    if not bad:
        return ""
    more = ", ..." if len(bad) > shown else ""
    return f" (on this rank, {len(bad)} parameters' gradients are not finite: {', '.join(bad[:shown])}{more})"
