"""Asynchronous, off-policy steps (rl.async = K): the rollouts of step s are generated in the background, on a
copy of the policy, while the steps before it train (as verl's one-step-off-policy and prime-rl's bounded
staleness; TRL's AsyncGRPOTrainer streams from a server with max_staleness).

The schedule is fixed, not a race: the rollouts of step s come from the policy after max(0, s - 1 - K) updates,
so step s trains on completions exactly min(K, s - 1) updates old (logged as `staleness`), whatever the speed of
either side. At the start of step t (the live policy has t - 1 updates) the worker is handed a snapshot of the
trainable weights and the window of step t + K (read ahead of the loop, training.loop.run.Windows), and step t
waits for its own rollouts, handed over K steps earlier. Since nothing is ever generated from weights older than
K updates, no sample is dropped for staleness.

Each token's loss is weighted by the truncated importance weight min(p_current / p_generating,
rl.importance_sampling_cap) (TIS: Yao et al. 2025; TRL's vllm_importance_sampling_correction, token_truncate),
with p_current the policy at the step's start (the PPO ratio is then 1, as with num_iterations 1).

Keyed as the synchronous steps: a request's tokens depend on (seed, step, row, generation, turn) and on the
weights that draw it, never on timing, so 1 and N processes draw the same, and a resumed run too: the checkpoint
of step c waits for the rollouts of steps c + 1 .. c + K (drawn from weights before c that a resumed run no
longer has) and keeps them, as num_iterations keeps its rollouts.

The copy shares the frozen weights (a LoRA base) with the policy and holds its own trainable ones (the adapter,
or for full fine-tuning the whole model); each handed-over snapshot is a copy of the trainable weights, K of them
at most in flight. Sharded parameters (FSDP, ZeRO-3) and the colocated vLLM engine are refused
(training/launch/refusals.py, training/config)."""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from training.rl.drawn import Drawn
from training.rl.metrics import Sums
from training.rl.rollouts import RolloutStage

log = logging.getLogger(__name__)


def version_of(step: int, k: int) -> int:
    """How many updates the policy that generates the rollouts of `step` (from 1) has had."""
    return max(0, step - 1 - k)


@dataclass
class Ahead:
    """One step's window drawn ahead: its completions scored, the generating policy's log-probabilities of each
    micro-batch [N, L-1] (CPU), what drawing them cost, and the version of the weights that drew them."""

    step: int
    version: int
    rows: list[list[int]]  # each micro-batch's prompt rows
    made: list[Drawn]
    behaviour: list[torch.Tensor]
    sums: Sums

    def portable(self) -> dict:
        """What the checkpoint keeps (the episodes' environments and tools dropped: the rewards have read them)."""
        for d in self.made:
            d.envs = None
            for e in d.episodes or []:
                e.env, e.tools = None, {}
        return {**vars(self), "sums": dict(self.sums)}

    @classmethod
    def restored(cls, state: dict) -> Ahead:
        return cls(**{**state, "sums": Sums(state["sums"])})


class PolicyCopy:
    """The generating copy of the policy: its frozen weights shared with the live policy, its trainable ones
    its own, loaded from a snapshot before each window it draws; in eval mode (no dropout)."""

    def __init__(self, model: torch.nn.Module):
        shared = {id(p): p for p in model.parameters() if not p.requires_grad}
        # its trainable weights keep requires_grad (what a push to a server reads); it draws under no_grad
        self.module = copy.deepcopy(model, shared)
        self.module.eval()
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]

    @staticmethod
    @torch.no_grad()
    def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A copy of the live policy's trainable weights, as they are now."""
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def load(self, snapshot: dict[str, torch.Tensor]) -> None:
        params = dict(self.module.named_parameters())
        for name in self.trainable:
            params[name].copy_(snapshot[name])


class Worker:
    """One daemon thread running jobs in the order they come (a killed or failed run does not wait for it)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="rl-rollouts", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args = self.jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (handed to the step that waits for it)
                future.set_exception(e)


class AheadRollouts:
    """The rollouts of the next K steps, drawn in the background (see the module doc)."""

    def __init__(self, stage: RolloutStage, k: int, live: torch.nn.Module, upcoming, last_step: int):
        self.stage, self.k, self.upcoming, self.last_step = stage, k, upcoming, last_step
        self.copy = PolicyCopy(live)
        self.worker = Worker()
        self.pending: dict[int, Future] = {}  # step -> its Ahead, being drawn
        self.done: dict[int, Ahead] = {}  # step -> its Ahead, restored from a checkpoint
        self.waited_s = 0.0

    def take(self, live: torch.nn.Module, window: list[dict], step: int) -> Ahead:
        """Step `step`'s rollouts (collective: a reward that failed on any rank stops every rank), after handing
        the worker the windows of the steps up to step + K that it does not have yet."""
        self.hand_over(live, window, step)
        start = time.perf_counter()
        error, ahead = None, self.done.pop(step, None)
        if ahead is None:
            try:
                ahead = self.pending.pop(step).result()
            except Exception as e:  # noqa: BLE001 (a reward's or a tool's failure, raised on every rank below)
                error = e
        self.waited_s = time.perf_counter() - start
        self.stage.check_every_rank(error)
        return ahead

    def hand_over(self, live: torch.nn.Module, window: list[dict], step: int) -> None:
        """Submit the steps step .. step + K not yet drawn: each from the weights the schedule says, which are
        the live ones for step + K (and for every step at the start of a run)."""
        have = self.pending.keys() | self.done.keys()
        todo = [s for s in range(step, min(step + self.k, self.last_step) + 1) if s not in have]
        if not todo:
            return
        windows = [window, *self.upcoming(todo[-1] - step)]
        snapshot = PolicyCopy.snapshot(live)
        for s in todo:
            if version_of(s, self.k) != step - 1:
                log.warning(
                    "rl.async: the rollouts of step %d are drawn from the weights of step %d, not %d (nothing "
                    "was kept for them: a checkpoint written without rl.async?)",
                    s,
                    step - 1,
                    version_of(s, self.k),
                )
            self.pending[s] = self.worker.submit(self.draw, s, windows[s - step], step - 1, snapshot)

    def draw(self, step: int, window: list[dict], version: int, snapshot: dict) -> Ahead:
        """In the worker: the window drawn and scored by the copy loaded with `snapshot`."""
        self.copy.load(snapshot)
        stage = self.stage.on_its_own()
        with torch.no_grad():
            made = stage.draw_window(self.copy.module, window, step)
            behaviour = [self.generating_logps(stage, d) for d in made]
        rows = [b["row"].tolist() for b in window]
        return Ahead(step, version, rows, made, behaviour, stage.sums)

    def generating_logps(self, stage: RolloutStage, d: Drawn) -> torch.Tensor:
        """The copy's log-probabilities of what it drew (CPU): the importance weight's denominator."""
        ids, attention, mask = d.tensors(stage.tokenizer.pad_token_id)
        dev = next(self.copy.module.parameters()).device
        return stage.sampling_logps(self.copy.module, ids.to(dev), attention.to(dev), mask.to(dev)).cpu()

    # ------------------------------------------------------------------ the checkpoint

    def state(self, step: int) -> list[dict]:
        """The rollouts drawn ahead of `step` (the one just done), waited for: what a resumed run cannot draw
        again (see the module doc)."""
        kept = {s: a for s, a in self.done.items() if s > step}
        kept |= {s: f.result() for s, f in self.pending.items() if s > step}
        return [kept[s].portable() for s in sorted(kept)]

    def restore(self, states: list[dict]) -> None:
        self.done = {a.step: a for a in map(Ahead.restored, states)}
