"""What one training run holds between set-up and the end of the loop, and what a step returns."""

from __future__ import annotations

import logging
import signal
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from accelerate import Accelerator
from torch.optim.lr_scheduler import LRScheduler

from training.config import Recipe
from training.model.speed import SpeedReport
from training.objectives.base import Objective
from training.objectives.router_balance import NoRouter, RouterBalance
from training.parallel.checkpoint import Checkpointer
from training.parallel.mesh import Mesh
from training.run.metrics import MetricsWriter
from training.run.rundir import RunDir

log = logging.getLogger(__name__)


@runtime_checkable
class StepExecutor(Protocol):
    """How one optimizer step executes under a launch: chosen once at set-up (training.loop.step holds the two,
    DataParallelStep and PipelineStep; tests/unit/core/test_step_executor.py checks that both satisfy this)."""

    padding_free: bool  # packed rows may go padding-free (varlen attention)

    @property
    def model(self) -> torch.nn.Module:
        """What the optimizer steps and a checkpoint holds (this process's stage under pipelining)."""

    def global_counts(self, counts: torch.Tensor) -> tuple[float, int, float]:
        """(normaliser, real tokens, model FLOPs) of the window summed over the processes that see other rows."""

    def forward_backward(self, objective: Objective, balance, window: list[dict], n: float, step: int):
        """The window's forward and backward passes; this rank's summed loss."""

    def clip(self, max_norm: float | None) -> float:
        """The whole model's gradient norm, clipped to `max_norm` (None: not clipped)."""

    def sum_over_all(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor summed over every process."""

    def eval_sums(self, objective: Objective, batches, split: str, balance) -> torch.Tensor:
        """A held-out set's sums over every process."""

    def full_state_dict(self) -> dict:
        """The whole model's state dict (a collective: every rank calls it)."""

    def whole_model(self) -> torch.nn.Module:
        """The model as one module (unwrapped; the stages joined under pipelining)."""

    def checkpoint_pairs(self, optimizer) -> list | None:
        """(module, optimizer) pairs a checkpoint saves through torch DCP, or None: accelerate's own state."""

    def first_row(self) -> dict:
        """What the first metrics row says of the execution (the pipeline's schedule), or {}."""

    def eval_batch_size(self, recipe: Recipe) -> int:
        """The held-out loaders' batch size."""

    def tolerates_nonfinite_norm(self) -> bool:
        """Whether a non-finite gradient norm is the backend's own business (DeepSpeed skips by itself)."""


class Loader(Protocol):
    """What the loop reads batches from: a (prepared) DataLoader, a streamed loader, a pipeline's loader."""

    def __iter__(self) -> Iterator[dict]: ...

    def __len__(self) -> int: ...


@dataclass
class Run:
    """Everything one training run holds between set-up and the end of the loop."""

    recipe: Recipe
    accelerator: Accelerator
    mesh: Mesh
    run_dir: RunDir
    tokenizer: object
    executor: StepExecutor  # training.loop.step.DataParallelStep or PipelineStep, chosen once at set-up
    objective: Objective  # the recipe's registered objective kind (training.objectives.registry)
    router: RouterBalance | NoRouter  # Mixture-of-Experts load balancing (NoRouter for a dense model)
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    train_dl: Loader
    eval_dls: dict[str, Loader]  # held-out set name -> loader ({} without held-out data)
    train_examples: int
    total_steps: int
    speed: SpeedReport
    metrics: MetricsWriter
    checkpointer: Checkpointer  # writes checkpoints/step-N (in the background with checkpoint.async_save)
    windows: Windows  # the loop's windows of micro-batches, which the objective may read ahead
    step: int = 0
    skipped: int = 0  # non-finite steps skipped (train.on_nonfinite=skip)

    @property
    def model(self) -> torch.nn.Module:
        """What the optimizer steps and checkpoints hold (this process's stage under pipelining)."""
        return self.executor.model


class Windows:
    """The loop's windows (each `size` micro-batches of this rank), read from the batch stream in order; an
    objective may read the next ones ahead of the step it is at (`peek`: asynchronous RL generates the
    rollouts of the steps to come), and the loop then gets those same windows in turn. The stream starts at
    the run's position (after a resume, the window after the checkpoint's)."""

    def __init__(self, size: int):
        self.size = size
        self._stream = None
        self._ahead: deque[list[dict]] = deque()

    def start(self, batches) -> None:
        self._stream, self._ahead = batches, deque()

    def next(self) -> list[dict]:
        return self._ahead.popleft() if self._ahead else self._read()

    def peek(self, n: int) -> list[list[dict]]:
        """The next `n` windows, which `next` then returns one by one."""
        while len(self._ahead) < n:
            self._ahead.append(self._read())
        return list(self._ahead)[:n]

    def _read(self) -> list[dict]:
        if self._stream is None:
            raise RuntimeError("the windows are read once the loop has started them (Windows.start)")
        return [next(self._stream) for _ in range(self.size)]


@dataclass
class StepStats:
    loss: float  # mean loss over the normaliser of the global window (labelled tokens, pairs)
    grad_norm: float
    tokens: int  # real (non-padding) tokens in the global window
    stop_requested: bool  # any rank got SIGTERM/SIGINT
    flops: float = 0.0  # model FLOPs of the global window, counted from its batches (training.model.speed)
    moe: dict = field(default_factory=dict)  # MoE: aux_loss and expert load of the global window
    metrics: dict = field(default_factory=dict)  # the objective's own (preference rewards and accuracy)


class GracefulStop:
    """SIGTERM/SIGINT ask the loop to finish the current step, save a checkpoint and exit 0. Python takes
    signal handlers in the main thread only: a loop run in another thread (a Ray Train worker) installs
    none, and a stop there is Ray's (the last complete checkpoint is what a restart resumes from)."""

    def __init__(self):
        self.requested = False
        if threading.current_thread() is not threading.main_thread():
            log.info("graceful stop on SIGTERM/SIGINT: not here (training runs outside the main thread)")
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = True
