"""Online RL as an objective: GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025), DAPO (Yu et al. 2025)
and RLOO advantages, on prompt batches (training.data.prompts), with the rollout stage of rollouts.py.

A window of prompt micro-batches becomes, in `start_window`, a window of rollouts: for each prompt,
`num_generations` completions (keyed sampling: the same for 1 and N processes, and after a resume),
their rewards (rewards.py: weighted sum of the recipe's functions) and advantages (advantages.py):
    grpo   A_i = r_i - mean(r of the group)
    rloo   A_i = r_i - mean(r of the group's other completions)     = G/(G-1) (r_i - mean)
divided by the reward std of the group (scale_rewards=group), of the global batch (batch), or not (none).
The loss of completion i, token t (PPO's clipped surrogate; the ratio is 1 with one update per rollout,
and its gradient is then the policy gradient A grad log p; p_old is the policy that sampled o_i):
    l_it = -min(rho A_i, clip(rho, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_it
    rho = p(o_it) / p_old(o_it),  KL_it = exp(ref - logp) - (ref - logp) - 1   (k3 estimator, as in GRPO)
with log-probabilities of logits / temperature, as the completions were sampled. Normalisation (the
step divides the summed loss by `counts` summed over the global window, so every backend gives the
one-process loss):
    grpo     sum_i (sum_t l_it / |o_i|)      / completions
    dr_grpo  sum_i sum_t l_it                / (completions x max_new_tokens)
    dapo     sum_i sum_t l_it                / completion tokens
The KL reference (beta > 0) is the base under the LoRA adapter (peft's disable_adapter: no second copy),
or, for full fine-tuning, a frozen copy of the initial policy (`frozen_copy`: eval mode, no gradients, no
optimizer state), made at set-up before a checkpoint is loaded, so a resumed run keeps the initial policy as
its reference. It is a whole module on every rank: FSDP and ZeRO-3 refuse it (training/launch/refusals.py).

rl.num_iterations = mu (TRL's num_iterations): each batch of rollouts trains mu optimizer steps, and each
counts as a step (max_steps, schedule, checkpoints), as in TRL. Steps 1, 1 + mu, ... sample; with mu > 1
they also compute p_old once, without gradients (TRL's old_per_token_logps), and keep it with the rollouts;
the next mu - 1 steps reuse them. The loop stays as it is: it hands every step its window of prompts, and
the prompt loader (training.data.prompts.RepeatedWindows, TRL's RepeatSampler with repeat_count) yields each
window mu times in a row, so a reusing step gets the prompts of its rollouts (checked) and no prompt is
skipped; the order is keyed by (seed, epoch) alone, the same for 1 and N processes and after a resume. The
kept rollouts are the objective's only state between steps: the checkpoint holds them (`state_dict`, every
rank's, gathered) while a later step of the cycle still needs them, since sampling again after an update
would draw other completions; a resumed run reuses them bit for bit.

The objective is split along its concerns: rollouts.py draws and prepares the rollouts, advantages.py and
loss.py hold the formulas, metrics.py the step's and the held-out metrics; build.py builds it from a recipe
and registers it (training.objectives.registry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from training.config import RLSection
from training.core.errors import UserError
from training.objectives.base import kept_rows
from training.rl.ahead import AheadRollouts
from training.rl.drawn import Drawn
from training.rl.loss import importance_weight, normaliser, summed_loss, token_logps, token_losses
from training.rl.metrics import EVAL_SUMS, Sums, eval_line, eval_row, step_row, write_samples
from training.rl.rewards import weights
from training.rl.rollouts import Rollout, RolloutStage, prompt_ids

log = logging.getLogger(__name__)


@dataclass
class RLObjective:
    """Online RL as a training.objectives.base.Objective (see the module doc)."""

    checkpoint_label: ClassVar[str] = "RL's kept rollouts (rl.num_iterations > 1)"  # in resume's refusals

    cfg: RLSection
    accelerator: object
    stage: RolloutStage
    mask_rows: Callable  # masks the rows accelerate repeats in the last eval batch
    gather: Callable[[list], list]  # every process's objects (the checkpoint's kept rollouts)
    samples_path: Path | None = None  # run_dir/samples.jsonl (written by the main process)
    ahead: AheadRollouts | None = None  # rl.async: the rollouts of the next steps, drawn in the background
    rollouts: list[Rollout] = field(default_factory=list)  # the window's, kept for num_iterations steps
    rollout_sums: Sums = field(default_factory=Sums)  # their reward/length sums, for every step using them
    sums: Sums = field(default_factory=Sums)
    step: int = 0
    _trained_from: float = 0.0

    @property
    def rewards(self) -> list:
        return self.stage.rewards

    def generates(self, step: int) -> bool:
        """Whether optimizer step `step` (from 1) samples new rollouts: steps 1, 1 + mu, 1 + 2 mu, ...; the
        others reuse the last ones (TRL: every steps_per_generation x num_iterations micro-steps)."""
        return (step - 1) % self.cfg.num_iterations == 0

    def start_window(self, model, window: list[dict], step: int = 0) -> RLObjective:
        """The window's rollouts: completions, rewards, advantages (and the reference's and the sampling
        policy's log-probabilities), sampled on the first step of each num_iterations cycle and kept for the
        others, whose window holds the same prompts again (training.data.prompts.RepeatedWindows)."""
        self.step = step
        if self.ahead is not None:
            self.take_ahead(model, window, step)
        elif self.generates(step) or not self.rollouts:
            if not self.generates(step):  # resumed from a checkpoint that does not keep them
                log.warning("step %d: no kept rollouts to reuse; sampling new ones", step)
            self.rollouts = self.stage.roll_out(model, window, step)
            self.sums = Sums(self.stage.sums)
            self.rollout_sums = self.stage.sums.kept()
        else:
            if [b["row"].tolist() for b in window] != [r.rows for r in self.rollouts]:
                raise RuntimeError(f"step {step}: the window's prompts are not those of the kept rollouts")
            # the reused rollouts report their rewards and lengths again, and no generation time
            self.sums = Sums(self.rollout_sums, gen_s=0.0, gen_tokens=0.0)
        self._trained_from = time.perf_counter()
        return self

    def take_ahead(self, model, window: list[dict], step: int) -> None:
        """rl.async: the rollouts drawn in the background for this step, made ready on the live policy
        (advantages, the reference's log-probabilities), with their staleness and the wait for them."""
        a = self.ahead.take(self.accelerator.unwrap_model(model), window, step)
        if a.rows != [b["row"].tolist() for b in window]:
            raise RuntimeError(f"step {step}: the rollouts drawn ahead are not of the window's prompts")
        self.stage.sums = Sums()
        self.rollouts = self.stage.ready_window(model, window, a.made, a.behaviour)
        self.sums = Sums(a.sums)
        self.sums.add(**self.stage.sums, staleness=step - 1 - a.version, wait_s=self.ahead.waited_s)

    # ------------------------------------------------------------------ the loss

    def counts(self, window: list[dict]) -> torch.Tensor:
        """[normaliser of the loss type, real tokens] of this rank's rollouts (after start_window)."""
        n = sum(normaliser(r.mask, self.cfg.loss_type, self.cfg.max_new_tokens) for r in self.rollouts)
        tokens = sum(float(r.attention_mask.sum()) for r in self.rollouts)
        return torch.tensor([n, tokens], dtype=torch.float64, device=self.accelerator.device)

    def loss(self, model, batch: dict, i: int) -> tuple[torch.Tensor, None, None]:
        """(the summed loss of rollout i of the window, None, None); `batch` (its prompts) is done with."""
        r, cfg = self.rollouts[i], self.cfg
        logps, entropy = token_logps(model, r.input_ids, r.attention_mask, cfg.temperature, r.mask)
        # num_iterations 1: one update per rollout, the sampling policy is the current one (ratio 1, as TRL)
        old = r.old_logps if r.old_logps is not None else logps.detach()
        weight, m = None, r.mask
        if r.behaviour_logps is not None:  # rl.async: weighted for the older policy that drew the rollout
            weight, ratio = importance_weight(logps, r.behaviour_logps, cfg.importance_sampling_cap)
            cut = ratio > cfg.importance_sampling_cap
            self.sums.add(is_ratio=(ratio * m).sum(), is_truncated=(cut * m).sum())
        losses, low, high, kl = token_losses(logps, old, r.ref_logps, r.adv, cfg, weight)
        self.sums.add(
            tokens=m.sum(),
            clip_low=(low * m).sum(),
            clip_high=(high * m).sum(),
            clipped=((low | high) * m).sum(),
            kl=(kl.detach() * m).sum(),
            entropy=(entropy * m).sum(),
        )
        return summed_loss(losses, m, cfg.loss_type), None, None

    def trained_batches(self, window: list[dict]) -> list[dict]:
        """The rollouts (prompt + completion rows) the window's loss is taken on, not its prompts; their labels
        are the scored tokens (the positions whose logits the loss makes: MFU counts the head there)."""
        return [
            {"input_ids": r.input_ids, "attention_mask": r.attention_mask, "labels": r.labels()}
            for r in self.rollouts
        ]

    def step_metrics(self) -> dict:
        """The window's reward, length, clipping, KL and timing metrics over every rank (a collective)."""
        self.sums.add(train_s=time.perf_counter() - self._trained_from)
        row = step_row(self.sums.reduced(self.accelerator), self.cfg, self.accelerator.num_processes)
        if self.samples_path is not None and self.accelerator.is_main_process and self.cfg.log_samples:
            samples = [x for r in self.rollouts for x in r.samples]
            write_samples(
                self.samples_path, self.step, self.stage.columns["train"][0], samples, self.cfg.log_samples
            )
        return row

    # ------------------------------------------------------------------ the checkpoint (num_iterations > 1)

    def checkpointed(self) -> list:
        """What the checkpoint keeps of the objective: the rollouts a later step of the cycle reuses (they
        cannot be sampled again once the weights moved), with num_iterations > 1; nothing otherwise."""
        return [self] if self.cfg.num_iterations > 1 or self.ahead is not None else []

    def state_dict(self) -> dict:
        """Collective: accelerate calls it on every rank and the main process writes it. Every rank's kept
        rollouts (token ids, masks, advantages, sampling and reference log-probabilities, their reward sums
        and samples, on the CPU), by rank; None where the cycle is complete (the next step samples anew)."""
        mine = None
        if self.rollouts and self.step % self.cfg.num_iterations != 0:
            mine = {"rollouts": [vars(r.to("cpu")) for r in self.rollouts], "sums": dict(self.rollout_sums)}
        ahead = None if self.ahead is None else self.gather([self.ahead.state(self.step)])
        return {
            "num_iterations": self.cfg.num_iterations,
            "ranks": self.gather([mine]),
            "async": self.cfg.async_,
            "ahead": ahead,
        }

    def load_state_dict(self, state: dict) -> None:
        """This rank's kept rollouts from the checkpoint (the process count must be the one that saved them,
        each rank holding its own prompts)."""
        ranks, acc = state["ranks"], self.accelerator
        if state["num_iterations"] != self.cfg.num_iterations:
            raise UserError(
                f"resume: the checkpoint was written with rl.num_iterations={state['num_iterations']} (its prompt "
                f"order and kept rollouts follow it); resume with it, or set resume: none to start afresh"
            )
        self.load_ahead(state)
        if all(r is None for r in ranks):
            return
        if len(ranks) != acc.num_processes:
            raise UserError(
                f"resume: the checkpoint keeps the rollouts of {len(ranks)} processes in the middle of an "
                f"rl.num_iterations cycle; resume it with {len(ranks)} processes, or from the checkpoint of a "
                f"step that ends a cycle (a multiple of {state['num_iterations']})"
            )
        mine = ranks[acc.process_index]
        self.rollouts = [Rollout(**r).to(acc.device) for r in mine["rollouts"]]
        self.rollout_sums = Sums(mine["sums"])

    def load_ahead(self, state: dict) -> None:
        """rl.async: this rank's rollouts drawn ahead of the checkpoint's step."""
        if self.ahead is None or not state.get("ahead"):
            return
        ranks, k = state["ahead"], state.get("async", 0)
        if k != self.cfg.async_ or len(ranks) != self.accelerator.num_processes:
            raise UserError(
                f"resume: the checkpoint keeps the rollouts drawn ahead by {len(ranks)} processes with rl.async="
                f"{k}; resume with those (or set resume: none to start afresh)"
            )
        self.ahead.restore(ranks[self.accelerator.process_index])

    # ------------------------------------------------------------------ held-out prompts

    @torch.no_grad()
    def eval_sums(self, model, batches, split: str, balance=None) -> torch.Tensor:
        """[reward, passed, prompts, completion length, reward of each function] summed over the held-out
        prompts' greedy completions and every rank (the rows accelerate repeats counted once)."""
        acc, stage = self.accelerator, self.stage
        unwrapped = acc.unwrap_model(model)
        total = torch.zeros(len(EVAL_SUMS) + len(self.rewards), dtype=torch.float64)
        for batch in batches:
            keep = kept_rows(self.mask_rows, batch["row"]).cpu()
            rows = batch["row"].tolist()
            if stage.runner is not None:
                starts = [stage.episode_start(r, r, split) for r in rows]
                episodes = stage.runner.run(unwrapped, starts, self.step, 1, acc.device, greedy=True)
                d = Drawn.of_episodes(episodes, rows)
            else:
                prompts = prompt_ids(batch)
                c = stage.engine.greedy(unwrapped, prompts, acc.device, version=self.step)
                shown = [stage.columns[split][0][r] for r in rows]
                d = Drawn.of_completions([c], prompts, rows, stage.tokenizer, stage.engine, shown)
            lengths = torch.tensor(d.lengths)
            r = stage.score(split, rows, d.completions, d.completion_ids, d.envs)[keep]
            t = r @ weights(self.rewards)
            passed = (t >= self.cfg.pass_reward - 1e-9).double()
            total += torch.cat(
                [
                    torch.stack([t.sum(), passed.sum(), keep.sum().double(), lengths[keep].double().sum()]),
                    r.sum(0),
                ]
            )
        return acc.reduce(total.to(acc.device), "sum")

    def eval_row(self, total: torch.Tensor, suffix: str = "") -> dict:
        """eval_reward, eval_pass_rate, eval_completion_length and each function's mean reward."""
        return eval_row(total, self.rewards, suffix)

    @staticmethod
    def eval_line(row: dict) -> str:
        return eval_line(row)
