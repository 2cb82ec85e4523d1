"""What one training run holds between set-up and the end of the loop, and what a step returns."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator

from training.config import Recipe
from training.model.speed import SpeedReport
from training.objectives.base import Objective
from training.objectives.router_balance import NoRouter, RouterBalance
from training.parallel.checkpoint import Checkpointer
from training.parallel.mesh import Mesh
from training.run.metrics import MetricsWriter
from training.run.rundir import RunDir

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything one training run holds between set-up and the end of the loop."""

    recipe: Recipe
    accelerator: Accelerator
    mesh: Mesh
    run_dir: RunDir
    tokenizer: object
    executor: object  # training.loop.step.DataParallelStep or PipelineStep, chosen once at set-up
    objective: Objective  # next-token (SFT, pretraining) or a preference objective
    router: RouterBalance | NoRouter  # Mixture-of-Experts load balancing (NoRouter for a dense model)
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_dl: object
    eval_dls: dict  # held-out set name -> loader ({} without held-out data)
    train_examples: int
    total_steps: int
    speed: SpeedReport
    metrics: MetricsWriter
    checkpointer: Checkpointer  # writes checkpoints/step-N (in the background with checkpoint.async_save)
    step: int = 0
    skipped: int = 0  # non-finite steps skipped (train.on_nonfinite=skip)

    @property
    def model(self) -> torch.nn.Module:
        """What the optimizer steps and checkpoints hold (this process's stage under pipelining)."""
        return self.executor.model


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
