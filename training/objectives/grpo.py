"""Online RL as an objective: GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025), DAPO (Yu et al. 2025)
and RLOO advantages, on prompt batches (training.data.prompts), with the rollout stage of rollout.py.

A window of prompt micro-batches becomes, in `start_window`, a window of rollouts: for each prompt,
`num_generations` completions (keyed sampling: the same for 1 and N processes, and after a resume),
their rewards (rewards.py: weighted sum of the recipe's functions) and advantages:
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
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
from accelerate.utils import gather_object

from training.config import Recipe, RLSection
from training.core.errors import DataError, UserError
from training.data.prompts import prompt_format, row_columns
from training.data.tokenize import probe_tools
from training.objectives.base import kept_rows
from training.objectives.drawn import Drawn
from training.objectives.episode import EpisodeRunner, env_seed
from training.objectives.rewards import Reward, RewardError, load_rewards, score, weights
from training.objectives.rollout import Sampler, sample_seed
from training.objectives.tools import check_deterministic, load_environment, load_tools
from training.objectives.vllm_rollout import VLLMSampler, check_vllm_installed

log = logging.getLogger(__name__)

EVAL_SUMS = ("reward", "passed", "n", "length")


# ----------------------------------------------------------------------------- the formulas


def token_logps(model, input_ids, attention_mask, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each next token [N, L-1] at `temperature`, the entropy of its distribution,
    detached)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.gather(logps, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logps.exp() * logps).sum(-1)
    return chosen, entropy


def advantages(
    totals: torch.Tensor, kind: str, scale: str, batch_std: torch.Tensor | None = None
) -> torch.Tensor:
    """[prompts, G] total rewards -> advantages (see the module doc). `batch_std`: the global batch's reward
    std (scale=batch)."""
    g = totals.shape[1]
    mean = totals.mean(1, keepdim=True)
    adv = totals - mean if kind == "grpo" else (totals - mean) * g / (g - 1)
    if scale == "group":
        adv = adv / (totals.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        adv = adv / (batch_std + 1e-4)
    return adv


def token_losses(
    logps, old_logps, ref_logps, adv, cfg: RLSection
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss [N, T], clipped low [N, T] bool, clipped high [N, T] bool, KL [N, T] or zeros).
    Clipped low: the ratio is below 1 - epsilon with a negative advantage (the min takes the clipped, constant
    term: no gradient); high: above 1 + epsilon_high with a positive one (TRL's clip_ratio/low, /high)."""
    ratio = torch.exp(logps - old_logps)
    a = adv.unsqueeze(-1)
    clipped_ratio = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    losses = -torch.min(ratio * a, clipped_ratio * a)
    low = (ratio < 1 - cfg.epsilon) & (a < 0)
    high = (ratio > 1 + cfg.epsilon_high) & (a > 0)
    kl = torch.zeros_like(losses)
    if cfg.beta > 0:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        losses = losses + cfg.beta * kl
    return losses, low, high, kl


def summed_loss(losses: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The micro-batch's loss summed as its normaliser counts (see the module doc)."""
    if loss_type == "grpo":
        return ((losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    return (losses * mask).sum()


def normaliser(mask: torch.Tensor, loss_type: str, max_new_tokens: int) -> float:
    if loss_type == "grpo":
        return float(mask.shape[0])
    if loss_type == "dr_grpo":
        return float(mask.shape[0] * max_new_tokens)
    return float(mask.sum())


# ----------------------------------------------------------------------------- rollouts


@dataclass
class Rollout:
    """One prompt micro-batch's completions, ready for the loss: sequences [N, L] (prompt + completion,
    right-padded), the completion mask of the predicted tokens [N, L-1], advantages [N], the reference's
    log-probabilities (beta > 0), the sampling policy's (num_iterations > 1), the prompt rows and what the
    samples file shows."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)

    def to(self, device) -> Rollout:
        """A copy with its tensors on `device` (the checkpoint keeps them on the CPU)."""
        moved = {
            f.name: v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
            for f in fields(self)
        }
        return Rollout(**moved)


def prompt_ids(batch: dict) -> list[list[int]]:
    """The token ids of each prompt of a prompt batch (right-padded rows cut at their prompt_len)."""
    return [ids[:n].tolist() for ids, n in zip(batch["input_ids"], batch["prompt_len"])]


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The KL reference of full fine-tuning: a copy of the policy as it is now, frozen (eval mode, no
    gradients; the optimizer never sees it). Taken from the prepared model's module, so it computes as the
    policy does (accelerate's autocast forward is copied with it, bound to the copy)."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


# ----------------------------------------------------------------------------- the objective


class Sums(dict):
    """Named float sums of this rank, reduced over every rank in one collective."""

    def add(self, **values) -> None:
        for k, v in values.items():
            self[k] = self.get(k, 0.0) + float(v)

    def reduced(self, accelerator) -> dict:
        keys = sorted(self)
        t = torch.tensor([self[k] for k in keys], dtype=torch.float64, device=accelerator.device)
        return dict(zip(keys, accelerator.reduce(t, "sum").tolist()))


@dataclass
class RLObjective:
    """Online RL as a training.objectives.base.Objective (see the module doc)."""

    checkpoint_label: ClassVar[str] = "RL's kept rollouts (rl.num_iterations > 1)"  # in resume's refusals

    cfg: RLSection
    accelerator: object
    sampler: Sampler | VLLMSampler
    rewards: list[Reward]
    tokenizer: object
    columns: dict  # split -> (prompts, extra columns), by row
    mask_rows: object  # masks the rows accelerate repeats in the last eval batch
    samples_path: Path | None = None  # run_dir/samples.jsonl (written by the main process)
    reference: torch.nn.Module | None = None  # rl.reference=frozen_copy: the initial policy, frozen
    runner: EpisodeRunner | None = None  # rl.tools / rl.environment: episodes of several turns
    messages_of: object = None  # a prompt record's prompt -> the messages it renders as (episodes)
    train_prompts: object = None  # the tokenized training prompts (dynamic sampling draws replacements)
    rollouts: list[Rollout] = field(default_factory=list)  # the window's, kept for num_iterations steps
    rollout_sums: Sums = field(default_factory=Sums)  # their reward/length sums, for every step using them
    sums: Sums = field(default_factory=Sums)
    step: int = 0
    _trained_from: float = 0.0

    # ------------------------------------------------------------------ the rollout stage

    def _score(self, split: str, rows: list[int], completions: list, ids: list[list[int]], envs=None):
        """[len(completions), functions] rewards of the completions of `rows` (one row per completion), checked
        on every rank together: a failing function stops every rank (exit 2), named where it failed. Every
        rank calls it the same number of times (a rank with no completions too)."""
        prompts_of, extras_of = self.columns[split]
        prompts = [prompts_of[r] for r in rows]
        keys = sorted({k for r in rows for k in extras_of[r]})
        cols = {k: [extras_of[r].get(k) for r in rows] for k in keys}
        if envs is not None:  # TRL passes the episodes' environments to every reward function
            cols["environments"] = envs
        error, out = None, torch.zeros(0, len(self.rewards), dtype=torch.float64)
        try:
            if completions:
                out = score(self.rewards, prompts, completions, ids, cols)
        except RewardError as e:
            error = e
        flag = torch.tensor([float(error is not None)], device=self.accelerator.device)
        if error is not None:
            self.accelerator.reduce(flag, "sum")
            raise error
        if self.accelerator.reduce(flag, "sum").item() > 0:
            raise RewardError("a reward function failed on another process (its message is above)")
        return out

    def _calls(self, n: int) -> int:
        """This rank's count of generate calls -> the most any rank makes (ZeRO-3/FSDP generate in step). A
        collective: call it before the generate calls it counts, on every rank."""
        if not self.sampler.synced:
            return n
        most = self._across(n, "max")
        self.sums.add(idle_calls=most - n)  # the idle generate calls this rank runs to keep in step
        return most

    def _draw(self, model, groups: list[tuple[list[int], int, int | str]], step: int) -> Drawn:
        """The completions (or episodes) of each (prompt ids, row, key) group, scored: `key` is the row, or a
        replacement's own key (dynamic sampling)."""
        g, dev = self.cfg.num_generations, self.accelerator.device
        unwrapped = self.accelerator.unwrap_model(model)
        rows = [r for _, r, _ in groups for _ in range(g)]
        if self.runner is not None:
            episodes = self.runner.run(
                unwrapped, [self._episode_start(r, key) for _, r, key in groups], step, g, dev
            )
            drawn = Drawn.of_episodes(episodes, rows)
            self.sums.add(gen_s=self.runner.seconds, gen_tokens=sum(e.policy_tokens for e in episodes))
        else:
            calls = self._calls(len(groups))  # before generating: every rank must know the count first
            made = self.sampler.groups(
                unwrapped, [p for p, *_ in groups], step, [k for *_, k in groups], g, dev
            )
            for _ in range(calls - len(made)):
                self.sampler.idle(unwrapped, dev)
            shown = [self.columns["train"][0][r] for r in rows]
            each = [p for p, *_ in groups for _ in range(g)]
            drawn = Drawn.of_completions(made, each, rows, self.tokenizer, self.sampler, shown)
            self.sums.add(gen_s=sum(c.seconds for c in made), gen_tokens=sum(drawn.lengths))
        drawn.key_rows = [key for *_, key in groups for _ in range(g)]
        drawn.rewards = self._score("train", rows, drawn.completions, drawn.completion_ids, drawn.envs)
        return drawn

    def _episode_start(self, row: int, key: int | str, split: str = "train"):
        """(the prompt's messages, the record's columns, the sampling key) of an episode's row."""
        prompt = self.columns[split][0][row]
        return self.messages_of(prompt), {"prompt": prompt, **self.columns[split][1][row]}, key

    def generates(self, step: int) -> bool:
        """Whether optimizer step `step` (from 1) samples new rollouts: steps 1, 1 + mu, 1 + 2 mu, ...; the
        others reuse the last ones (TRL: every steps_per_generation x num_iterations micro-steps)."""
        return (step - 1) % self.cfg.num_iterations == 0

    def start_window(self, model, window: list[dict], step: int = 0) -> RLObjective:
        """The window's rollouts: completions, rewards, advantages (and the reference's and the sampling
        policy's log-probabilities), sampled on the first step of each num_iterations cycle and kept for the
        others, whose window holds the same prompts again (training.data.prompts.RepeatedWindows)."""
        self.step = step
        if self.generates(step) or not self.rollouts:
            if not self.generates(step):  # resumed from a checkpoint that does not keep them
                log.warning("step %d: no kept rollouts to reuse; sampling new ones", step)
            self._roll_out(model, window, step)
        else:
            if [b["row"].tolist() for b in window] != [r.rows for r in self.rollouts]:
                raise RuntimeError(f"step {step}: the window's prompts are not those of the kept rollouts")
            # the reused rollouts report their rewards and lengths again, and no generation time
            self.sums = Sums(self.rollout_sums, gen_s=0.0, gen_tokens=0.0)
        self._trained_from = time.perf_counter()
        return self

    def _roll_out(self, model, window: list[dict], step: int) -> None:
        cfg, acc, g = self.cfg, self.accelerator, self.cfg.num_generations
        self.sums, self.rollouts = Sums(), []
        made = []
        for batch in window:
            prompts = prompt_ids(batch)
            rows = batch["row"].tolist()
            made.append(self._draw(model, list(zip(prompts, rows, rows)), step))
        w = weights(self.rewards)
        if cfg.dynamic_sampling:
            self.sums.add(**self.refill(model, made, step, w))
        totals = [d.rewards @ w for d in made]
        batch_std = None
        if cfg.scale_rewards == "batch":  # the std of every completion's reward in the global window
            t = torch.cat(totals)
            s = acc.reduce(
                torch.stack([t.sum(), (t * t).sum(), torch.tensor(float(len(t)))]).to(acc.device), "sum"
            )
            n = s[2].cpu()
            batch_std = ((s[1].cpu() - s[0].cpu() ** 2 / n) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
        for batch, d, total in zip(window, made, totals):
            grouped = total.view(-1, g)
            adv = advantages(grouped, cfg.advantage, cfg.scale_rewards, batch_std).reshape(-1)
            input_ids, attention, mask = d.tensors(self.tokenizer.pad_token_id)
            dev = acc.device
            rows = batch["row"].tolist()
            ro = Rollout(input_ids.to(dev), attention.to(dev), mask.to(dev), adv.float().to(dev), rows=rows)
            if cfg.beta > 0:
                ro.ref_logps = self._reference_logps(model, ro)
            if cfg.num_iterations > 1:  # the ratio's denominator, for each of the mu steps
                ro.old_logps = self._sampling_logps(model, ro)
            ro.samples = d.samples(total, adv, self.rewards, cfg.log_samples)
            self.rollouts.append(ro)
            self.sums.add(
                n=len(total),
                reward=total.sum(),
                reward_sq=(total * total).sum(),
                length=sum(d.lengths),
                truncated=sum(not e for e in d.ended),
                groups=grouped.shape[0],
                zero_std_groups=(grouped.std(1) < 1e-6).sum(),
                **{f"reward/{f.name}": d.rewards[:, j].sum() for j, f in enumerate(self.rewards)},
                **d.episode_sums(),
            )
        made_now = ("gen_s", "gen_tokens", "idle_calls")  # a step that reuses the rollouts generates nothing
        self.rollout_sums = Sums({k: v for k, v in self.sums.items() if k not in made_now})

    def refill(self, model, made: list[Drawn], step: int, w: torch.Tensor) -> dict:
        """DAPO's dynamic sampling: each group whose rewards are all equal (no signal) is replaced by the group
        of another training prompt, drawn by the key (seed, step, row, try), up to rl.dynamic_sampling tries;
        a group still flat after them is kept (its advantages are 0). Rounds run on every rank together."""
        g, replaced = self.cfg.num_generations, 0
        for attempt in range(1, self.cfg.dynamic_sampling + 1):
            flat = [(i, k) for i, d in enumerate(made) for k in d.flat_groups(w, g)]
            if self._across(len(flat), "sum") == 0:
                break
            groups = [self._replacement(made[i].key_rows[k * g], step, attempt) for i, k in flat]
            drawn = self._draw(model, groups, step)
            for n, (i, k) in enumerate(flat):
                made[i].replace(k, drawn, n, g)
            replaced += len(flat)
        still = sum(len(d.flat_groups(w, g)) for d in made)
        return {"resampled_groups": replaced, "flat_after_resampling": still}

    def _across(self, n: int, op: str) -> int:
        """A count of this rank reduced over every rank (`op`: sum or max); a collective where several run."""
        if self.accelerator.num_processes == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.accelerator.device)
        return int(self.accelerator.reduce(t, op).item())

    def _replacement(self, key_row, step: int, attempt: int) -> tuple[list[int], int, str]:
        """(prompt ids, row, key) of the training prompt that replaces a flat group: drawn by its key alone, so
        every backend and a resumed run draw the same one."""
        key = f"{str(key_row).split('~')[0]}~{attempt}"
        pos = sample_seed(self.sampler.seed, step, key, 0) % len(self.train_prompts)
        rec = self.train_prompts[pos]
        return rec["input_ids"], rec["row"], key

    @torch.no_grad()
    def _sampling_logps(self, model, ro: Rollout) -> torch.Tensor:
        """The log-probabilities of the policy that sampled the rollout, before its first update (TRL's
        old_per_token_logps): kept for the ratio of every step that reuses the rollout."""
        return token_logps(model, ro.input_ids, ro.attention_mask, self.cfg.temperature)[0]

    @torch.no_grad()
    def _reference_logps(self, model, ro: Rollout) -> torch.Tensor:
        """The KL reference's log-probabilities of the rollout: the frozen copy of the initial policy (full
        fine-tuning), or the base under the LoRA adapter."""
        if self.reference is not None:
            return token_logps(self.reference, ro.input_ids, ro.attention_mask, self.cfg.temperature)[0]
        with self.accelerator.unwrap_model(model).disable_adapter():
            return token_logps(model, ro.input_ids, ro.attention_mask, self.cfg.temperature)[0]

    # ------------------------------------------------------------------ the loss

    def counts(self, window: list[dict]) -> torch.Tensor:
        """[normaliser of the loss type, real tokens] of this rank's rollouts (after start_window)."""
        n = sum(normaliser(r.mask, self.cfg.loss_type, self.cfg.max_new_tokens) for r in self.rollouts)
        tokens = sum(float(r.attention_mask.sum()) for r in self.rollouts)
        return torch.tensor([n, tokens], dtype=torch.float64, device=self.accelerator.device)

    def loss(self, model, batch: dict, i: int) -> tuple[torch.Tensor, None, None]:
        """(the summed loss of rollout i of the window, None, None); `batch` (its prompts) is done with."""
        r, cfg = self.rollouts[i], self.cfg
        logps, entropy = token_logps(model, r.input_ids, r.attention_mask, cfg.temperature)
        # num_iterations 1: one update per rollout, the sampling policy is the current one (ratio 1, as TRL)
        old = r.old_logps if r.old_logps is not None else logps.detach()
        losses, low, high, kl = token_losses(logps, old, r.ref_logps, r.adv, cfg)
        m = r.mask
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
        """The rollouts (prompt + completion rows) the window's loss is taken on, not its prompts."""
        return [{"input_ids": r.input_ids, "attention_mask": r.attention_mask} for r in self.rollouts]

    def step_metrics(self) -> dict:
        """The window's reward, length, clipping, KL and timing metrics over every rank (a collective)."""
        train_s = time.perf_counter() - self._trained_from
        self.sums.add(train_s=train_s)
        s = self.sums.reduced(self.accelerator)
        n, procs = max(s["n"], 1), self.accelerator.num_processes
        mean = s["reward"] / n
        row = {
            "reward": mean,
            "reward_std": max(0.0, (s["reward_sq"] - n * mean**2) / max(n - 1, 1)) ** 0.5,
            **{k: v / n for k, v in s.items() if k.startswith("reward/")},
            "completion_length": s["length"] / n,
            "truncated_fraction": s["truncated"] / n,
            "frac_reward_zero_std": s["zero_std_groups"] / max(s["groups"], 1),
            "clip_fraction": s["clipped"] / max(s["tokens"], 1),
            "clip_ratio/low_mean": s["clip_low"] / max(s["tokens"], 1),
            "clip_ratio/high_mean": s["clip_high"] / max(s["tokens"], 1),
            "clip_ratio/region_mean": s["clipped"] / max(s["tokens"], 1),
            "entropy": s["entropy"] / max(s["tokens"], 1),
            "generation_s": s["gen_s"] / procs,
            "generation_tokens_per_s": s["gen_tokens"] / max(s["gen_s"] / procs, 1e-9),
            "train_s": s["train_s"] / procs,
        }
        if self.cfg.beta > 0:
            row["kl"] = s["kl"] / max(s["tokens"], 1)
        for k in ("turns", "tool_calls", "tool_errors", "tool_tokens"):  # per episode
            if k in s:
                row[k] = s[k] / n
        for k in ("resampled_groups", "flat_after_resampling", "idle_calls"):  # counts of the step
            if k in s:
                row[k] = s[k]
        self._write_samples()
        return row

    def _write_samples(self) -> None:
        if self.samples_path is None or not self.accelerator.is_main_process or not self.cfg.log_samples:
            return
        prompts_of = self.columns["train"][0]
        lines = [
            json.dumps({"step": self.step, "prompt": prompts_of[s["row"]], **s}, ensure_ascii=False)
            for s in [x for r in self.rollouts for x in r.samples][: self.cfg.log_samples]
        ]
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))

    # ------------------------------------------------------------------ the checkpoint (num_iterations > 1)

    def checkpointed(self) -> list:
        """What the checkpoint keeps of the objective: the rollouts a later step of the cycle reuses (they
        cannot be sampled again once the weights moved), with num_iterations > 1; nothing otherwise."""
        return [self] if self.cfg.num_iterations > 1 else []

    def state_dict(self) -> dict:
        """Collective: accelerate calls it on every rank and the main process writes it. Every rank's kept
        rollouts (token ids, masks, advantages, sampling and reference log-probabilities, their reward sums
        and samples, on the CPU), by rank; None where the cycle is complete (the next step samples anew)."""
        mine = None
        if self.rollouts and self.step % self.cfg.num_iterations != 0:
            mine = {"rollouts": [vars(r.to("cpu")) for r in self.rollouts], "sums": dict(self.rollout_sums)}
        return {"num_iterations": self.cfg.num_iterations, "ranks": gather_object([mine])}

    def load_state_dict(self, state: dict) -> None:
        """This rank's kept rollouts from the checkpoint (the process count must be the one that saved them,
        each rank holding its own prompts)."""
        ranks, acc = state["ranks"], self.accelerator
        if state["num_iterations"] != self.cfg.num_iterations:
            raise UserError(
                f"resume: the checkpoint was written with rl.num_iterations={state['num_iterations']} (its prompt "
                f"order and kept rollouts follow it); resume with it, or set resume: none to start afresh"
            )
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

    # ------------------------------------------------------------------ held-out prompts

    @torch.no_grad()
    def eval_sums(self, model, batches, split: str, balance=None) -> torch.Tensor:
        """[reward, passed, prompts, completion length, reward of each function] summed over the held-out
        prompts' greedy completions and every rank (the rows accelerate repeats counted once)."""
        acc, unwrapped = self.accelerator, self.accelerator.unwrap_model(model)
        total = torch.zeros(len(EVAL_SUMS) + len(self.rewards), dtype=torch.float64)
        for batch in batches:
            keep = kept_rows(self.mask_rows, batch["row"]).cpu()
            rows = batch["row"].tolist()
            if self.runner is not None:
                starts = [self._episode_start(r, r, split) for r in rows]
                episodes = self.runner.run(unwrapped, starts, self.step, 1, acc.device, greedy=True)
                d = Drawn.of_episodes(episodes, rows)
            else:
                prompts = prompt_ids(batch)
                c = self.sampler.greedy(unwrapped, prompts, acc.device, version=self.step)
                shown = [self.columns[split][0][r] for r in rows]
                d = Drawn.of_completions([c], prompts, rows, self.tokenizer, self.sampler, shown)
            lengths = torch.tensor(d.lengths)
            r = self._score(split, rows, d.completions, d.completion_ids, d.envs)[keep]
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
        n = max(total[2].item(), 1)
        row = {
            f"eval_reward{suffix}": total[0].item() / n,
            f"eval_pass_rate{suffix}": total[1].item() / n,
            f"eval_completion_length{suffix}": total[3].item() / n,
        }
        for j, f in enumerate(self.rewards):
            row[f"eval_reward/{f.name}{suffix}"] = total[len(EVAL_SUMS) + j].item() / n
        return row

    @staticmethod
    def eval_line(row: dict) -> str:
        return (
            f"eval reward {row['eval_reward']:.3f}, pass rate {row['eval_pass_rate']:.3f}, "
            f"completion length {row['eval_completion_length']:.1f}"
        )


def check_columns(cfg: RLSection, columns: dict) -> None:
    """Every row of every split has the columns the built-in rewards read (a cached split skips the load-time
    check)."""
    for split, (_, extras) in columns.items():
        for column in cfg.columns():
            missing = next((i for i, e in enumerate(extras) if e.get(column) is None), None)
            if missing is not None:
                raise DataError(
                    f"data.{split}: prompt row {missing} has no column '{column}', which a reward reads"
                )


def build_rl_objective(
    recipe: Recipe, accelerator, tokenizer, splits: dict, mask_rows, run_dir, synced: bool, model
) -> RLObjective:
    """The recipe's RL objective; `splits`: {split name: tokenized prompt dataset}; `synced`: the model is
    sharded (ZeRO-3/FSDP), so every rank steps generation together; `model`: the prepared policy, still
    with its initial weights (rl.reference=frozen_copy copies it: call this before resuming)."""
    cfg = recipe.rl
    sampler = make_sampler(recipe, accelerator, tokenizer, synced)
    columns = {name: row_columns(ds) for name, ds in splits.items() if ds is not None}
    check_columns(cfg, columns)
    rewards = load_rewards(cfg, accelerator.device)
    runner = None
    if cfg.episodes:
        runner = episode_runner(recipe, tokenizer, sampler, columns["train"])
        if runner.environments is not None and runner.environments.owns_reward:
            rewards.append(environment_reward(runner.environments))
        if cfg.pass_reward is None:
            cfg.pass_reward = sum(r.weight for r in rewards if r.weight > 0)
    reference = None
    if cfg.reference == "frozen_copy":
        reference = frozen_copy(accelerator.unwrap_model(model, keep_torch_compile=False))
    log.info("online RL: %s", described(cfg, rewards))
    objective = RLObjective(
        cfg,
        accelerator,
        sampler,
        rewards,
        tokenizer,
        columns,
        mask_rows,
        run_dir.samples,
        reference=reference,
        runner=runner,
        messages_of=prompt_messages(recipe.data),
        train_prompts=splits["train"].select_columns(["input_ids", "row"]) if cfg.dynamic_sampling else None,
    )
    if runner is not None:
        runner.calls_of = objective._calls
    return objective


def make_sampler(recipe: Recipe, accelerator, tokenizer, synced: bool) -> Sampler | VLLMSampler:
    """What draws the completions: transformers' generate (keyed), or a colocated vLLM engine."""
    cfg = recipe.rl
    eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.pad_token_id is None:
        raise UserError(
            f"model.tokenizer: {recipe.model.tokenizer or recipe.model.name_or_path} has no pad token"
        )
    sampler = Sampler(
        recipe.seed, cfg.max_new_tokens, cfg.temperature, cfg.top_p, eos_ids, tokenizer.pad_token_id, synced
    )
    if cfg.generator != "vllm":
        return sampler
    check_vllm_installed()
    return VLLMSampler(
        sampler,
        accelerator,
        tokenizer,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        max_model_len=recipe.data.max_length + cfg.max_new_tokens,
    )


def described(cfg: RLSection, rewards: list[Reward]) -> str:
    """The start-up line's account of the objective."""
    to = {
        "frozen_copy": "a frozen copy of the initial model",
        "adapter_disabled": "the base under the adapter",
    }
    source = "a colocated vLLM engine" if cfg.generator == "vllm" else "transformers' generate"
    return (
        f"{cfg.loss_type} loss, {cfg.advantage} advantages (scale {cfg.scale_rewards}), {cfg.num_generations} "
        f"completions per prompt from {source}, rewards {', '.join(f'{r.name} x {r.weight:g}' for r in rewards)}"
        + (f", KL beta {cfg.beta:g} to {to[cfg.reference]}" if cfg.beta > 0 else "")
    )


def prompt_messages(data):
    """A prompt record's prompt (as the columns keep it) -> the messages it was rendered from."""
    fmt = prompt_format(data)
    return lambda prompt: fmt.messages({fmt.name("prompt"): prompt})


def episode_runner(recipe: Recipe, tokenizer, sampler: Sampler, train_columns) -> EpisodeRunner:
    """rl.tools and rl.environment loaded and checked: the chat template renders tools, every tool has a schema,
    the environment resets alike twice under one seed (else a warning naming it)."""
    cfg, data = recipe.rl, recipe.data
    if why := probe_tools(tokenizer, data.chat_template_kwargs):
        raise UserError(
            f"rl.tools / rl.environment: the chat template cannot render tools ({why}); give one that does: "
            "data.chat_template: data/tools/chatml_tools.jinja (Hermes/Qwen tags) or the model family's own"
        )
    (tools, schemas), envs = load_tools(cfg), load_environment(cfg)
    if envs is not None:
        schemas = schemas + envs.schemas
        first = {"prompt": train_columns[0][0], **train_columns[1][0]}
        if warning := check_deterministic(envs, first, env_seed(recipe.seed, 0, 0)):
            log.warning(warning)
    names = [s["function"]["name"] for s in schemas]
    log.info(
        "episodes: up to %d turns and %d tokens after the prompt; tools %s%s",
        cfg.max_turns,
        cfg.max_new_tokens,
        ", ".join(names) or "none",
        f"; environment {envs.name}" + (" (its own reward)" if envs.owns_reward else "") if envs else "",
    )
    return EpisodeRunner(
        sampler,
        tokenizer,
        tools,
        envs,
        cfg.max_turns,
        cfg.max_new_tokens,
        cfg.tool_output_chars,
        dict(data.chat_template_kwargs),
        schemas,
        calls_of=lambda n: n,
    )


def environment_reward(envs) -> Reward:
    """The environment's get_reward as one more reward (weight 1, named after its class), as TRL adds it."""

    def get_reward(environments, **kw):
        return [e.get_reward() for e in environments]

    return Reward(envs.name, 1.0, get_reward, f"rl.environment ({envs.name}).get_reward")
