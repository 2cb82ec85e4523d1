"""The rollout stage of online RL: a window of prompt micro-batches -> rollouts ready for the loss. Each prompt's
`num_generations` completions (or episodes, with tools and an environment) are drawn by the generation engine
(keyed: the same for 1 and N processes, and after a resume), scored by the rewards, refilled where a group
has no signal (DAPO's dynamic sampling), and given advantages, the reference's log-probabilities (beta > 0)
and the sampling policy's (num_iterations > 1)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, fields, replace

import torch

from training.config import RLSection
from training.core.batch import IGNORE
from training.generation import Engine, sample_seed
from training.rl.advantages import advantages, batch_std
from training.rl.drawn import Drawn
from training.rl.episode import EpisodeRunner
from training.rl.loss import token_logps
from training.rl.metrics import Sums
from training.rl.rewards import Reward, RewardError, score, weights

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One prompt micro-batch's completions, ready for the loss: sequences [N, L] (prompt + completion,
    right-padded), the completion mask of the last W predicted tokens [N, W] (Drawn.tensors), advantages [N], the reference's
    log-probabilities (beta > 0), the sampling policy's (num_iterations > 1), the prompt rows and what the
    samples file shows."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    behaviour_logps: torch.Tensor | None = None  # rl.async: the generating (older) policy's
    rows: list[int] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)

    def labels(self) -> torch.Tensor:
        """[N, L]: the scored tokens' ids, IGNORE elsewhere (the mask's W columns are the last predicted)."""
        labels = torch.full_like(self.input_ids, IGNORE)
        w = self.mask.shape[1]
        labels[:, -w:] = torch.where(self.mask > 0, self.input_ids[:, -w:], IGNORE)
        return labels

    def to(self, device) -> Rollout:
        """A copy with its tensors on `device` (the checkpoint keeps them on the CPU)."""
        moved = {
            f.name: v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
            for f in fields(self)
        }
        return Rollout(**moved)


def first_key(key_row) -> str:
    """The key of the group a replacement stands in for ("12~2" -> "12"): every try's key derives from it."""
    return str(key_row).split("~")[0]


def prompt_ids(batch: dict) -> list[list[int]]:
    """The token ids of each prompt of a prompt batch (right-padded rows cut at their prompt_len)."""
    return [ids[:n].tolist() for ids, n in zip(batch["input_ids"], batch["prompt_len"])]


@dataclass
class RolloutStage:
    """Draws, scores and prepares the rollouts of a window (see the module doc); `sums`: what the current
    roll-out drew and what it cost (generation time, idle calls), for the step's metrics."""

    cfg: RLSection
    accelerator: object
    engine: Engine
    rewards: list[Reward]
    tokenizer: object
    columns: dict  # split -> (prompts, extra columns), by row
    reference: torch.nn.Module | None = None  # rl.reference=frozen_copy: the initial policy, frozen
    runner: EpisodeRunner | None = None  # rl.tools / rl.environment: episodes of several turns
    messages_of: object = None  # a prompt record's prompt -> the messages it renders as (episodes)
    train_prompts: object = None  # the tokenized training prompts (dynamic sampling draws replacements)
    sums: Sums = field(default_factory=Sums)
    local: bool = False  # rl.async's copy: draws on its own, without collectives (see `on_its_own`)

    def on_its_own(self) -> RolloutStage:
        """A copy that draws a window on its own, beside the training step (rl.async): its own sums, its
        episodes' own environment instances, and no collective (each rank's dynamic sampling runs its own
        rounds, which draw what the shared rounds would: a group's tries depend on its key alone); a reward
        that fails raises here, and `check_every_rank` then stops every rank together."""
        runner = self.runner
        if runner is not None:
            envs = runner.environments and replace(runner.environments, pool=[])
            runner = replace(runner, environments=envs, calls_of=lambda n: n, seconds=0.0)
        return replace(self, sums=Sums(), local=True, runner=runner)

    def check_every_rank(self, error: Exception | None) -> None:
        """Collective: raise `error` on this rank, and a pointer to it on every other (exit 2 on each)."""
        flag = torch.tensor([float(error is not None)], device=self.accelerator.device)
        failed = self.accelerator.reduce(flag, "sum").item() > 0
        if error is not None:
            raise error
        if failed:
            raise RewardError("a reward function failed on another process (its message is above)")

    def score(self, split: str, rows: list[int], completions: list, ids: list[list[int]], envs=None):
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
            if self.local:
                raise
            error = e
        if not self.local:
            self.check_every_rank(error)
        return out

    def calls(self, n: int) -> int:
        """This rank's count of generate calls -> the most any rank makes (under ZeRO-3/FSDP each call gathers
        collectively, or each forward pass where the weights stay sharded). A
        collective: call it before the generate calls it counts, on every rank."""
        if not self.engine.synced:
            return n
        most = self.across(n, "max")
        self.sums.add(idle_calls=most - n)  # the idle generate calls this rank runs to keep in step
        return most

    def across(self, n: int, op: str) -> int:
        """A count of this rank reduced over every rank (`op`: sum or max); a collective where several run."""
        if self.accelerator.num_processes == 1 or self.local:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.accelerator.device)
        return int(self.accelerator.reduce(t, op).item())

    def episode_start(self, row: int, key: int | str, split: str = "train"):
        """(the prompt's messages, the record's columns, the sampling key) of an episode's row."""
        prompt = self.columns[split][0][row]
        return self.messages_of(prompt), {"prompt": prompt, **self.columns[split][1][row]}, key

    def draw(self, model, groups: list[tuple[list[int], int, int | str]], step: int) -> Drawn:
        """The completions (or episodes) of each (prompt ids, row, key) group, scored: `key` is the row, or a
        replacement's own key (dynamic sampling)."""
        g, dev = self.cfg.num_generations, self.accelerator.device
        unwrapped = self.accelerator.unwrap_model(model)
        rows = [r for _, r, _ in groups for _ in range(g)]
        if self.runner is not None:
            episodes = self.runner.run(
                unwrapped, [self.episode_start(r, key) for _, r, key in groups], step, g, dev
            )
            drawn = Drawn.of_episodes(episodes, rows)
            self.sums.add(gen_s=self.runner.seconds, gen_tokens=sum(e.policy_tokens for e in episodes))
        else:
            mine = 1 if groups else 0  # the window's groups are drawn in one engine call
            calls = self.calls(mine)  # before generating: every rank must know the count first
            prompts, keys = [p for p, *_ in groups], [k for *_, k in groups]
            made = self.engine.groups(unwrapped, prompts, step, keys, g, dev) if groups else []
            for _ in range(calls - mine):
                self.engine.idle(unwrapped, dev)
            shown = [self.columns["train"][0][r] for r in rows]
            each = [p for p, *_ in groups for _ in range(g)]
            drawn = Drawn.of_completions(made, each, rows, self.tokenizer, self.engine, shown)
            self.sums.add(gen_s=sum(c.seconds for c in made), gen_tokens=sum(drawn.lengths))
        drawn.key_rows = [key for *_, key in groups for _ in range(g)]
        drawn.rewards = self.score("train", rows, drawn.completions, drawn.completion_ids, drawn.envs)
        return drawn

    def roll_out(self, model, window: list[dict], step: int) -> list[Rollout]:
        """The window's rollouts; `sums` holds what they drew and cost."""
        self.sums = Sums()
        return self.ready_window(model, window, self.draw_window(model, window, step))

    def draw_window(self, model, window: list[dict], step: int) -> list[Drawn]:
        """Each micro-batch's completions (or episodes), scored, flat groups refilled (dynamic sampling); with
        rl.refill_ahead, the window's groups and all their replacements drawn in one call."""
        groups = [list(zip(prompt_ids(b), b["row"].tolist(), b["row"].tolist())) for b in window]
        spare = None
        if self.cfg.refill_ahead:
            made, spare = self.draw_ahead(model, groups, step)
        else:
            made = [self.draw(model, gs, step) for gs in groups]
        if self.cfg.dynamic_sampling:
            self.sums.add(**self.refill(model, made, step, weights(self.rewards), spare))
        return made

    def draw_ahead(self, model, groups: list[list[tuple]], step: int) -> tuple[list[Drawn], tuple]:
        """(each micro-batch's Drawn, (the replacements' Drawn, where each (key, try) lies in it)): every group
        of the window, and its replacement for each try of dynamic sampling, drawn in one call."""
        g, tries = self.cfg.num_generations, range(1, self.cfg.dynamic_sampling + 1)
        own = [group for gs in groups for group in gs]
        spares = [(str(key), attempt) for *_, key in own for attempt in tries]
        everything = self.draw(model, own + [self.replacement(k, step, a) for k, a in spares], step)
        bounds = list(itertools.accumulate(map(len, groups), initial=0))
        made = [everything.groups(a, b, g) for a, b in itertools.pairwise(bounds)]
        spare = everything.groups(len(own), len(own) + len(spares), g)
        return made, (spare, {s: n for n, s in enumerate(spares)})

    def ready_window(self, model, window: list[dict], made: list[Drawn], behaviour=None) -> list[Rollout]:
        """The drawn window as rollouts (a collective with scale_rewards=batch); `behaviour`: the generating
        policy's log-probabilities of each micro-batch (rl.async)."""
        w = weights(self.rewards)
        totals = [d.rewards @ w for d in made]
        std = batch_std(totals, self.accelerator) if self.cfg.scale_rewards == "batch" else None
        behaviour = behaviour or [None] * len(made)
        return [
            self.ready(model, batch, d, total, std, b)
            for batch, d, total, b in zip(window, made, totals, behaviour)
        ]

    def ready(self, model, batch: dict, d: Drawn, total: torch.Tensor, std, behaviour=None) -> Rollout:
        """One micro-batch's drawn completions as a Rollout: advantages, the reference's and the sampling
        policy's log-probabilities where the recipe needs them, and their sums."""
        cfg, dev = self.cfg, self.accelerator.device
        grouped = total.view(-1, cfg.num_generations)
        adv = advantages(grouped, cfg.advantage, cfg.scale_rewards, std).reshape(-1)
        input_ids, attention, mask = d.tensors(self.tokenizer.pad_token_id)
        rows = batch["row"].tolist()
        ro = Rollout(input_ids.to(dev), attention.to(dev), mask.to(dev), adv.float().to(dev), rows=rows)
        ro.behaviour_logps = None if behaviour is None else behaviour.to(dev)
        if cfg.beta > 0:
            ro.ref_logps = self.reference_logps(model, ro)
        if cfg.num_iterations > 1:  # the ratio's denominator, for each of the mu steps
            ro.old_logps = self.sampling_logps(model, ro.input_ids, ro.attention_mask, ro.mask)
        ro.samples = d.samples(total, adv, self.rewards, cfg.log_samples)
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
        return ro

    def refill(self, model, made: list[Drawn], step: int, w: torch.Tensor, spare=None) -> dict:
        """DAPO's dynamic sampling: each group whose rewards are all equal (no signal) is replaced by the group
        of another training prompt, drawn by the key (seed, step, row, try), up to rl.dynamic_sampling tries;
        a group still flat after them is kept (its advantages are 0). Rounds run on every rank together.
        `spare`: the replacements drawn ahead (draw_ahead), taken instead of drawing each round's."""
        g, replaced = self.cfg.num_generations, 0
        for attempt in range(1, self.cfg.dynamic_sampling + 1):
            flat = [(i, k) for i, d in enumerate(made) for k in d.flat_groups(w, g)]
            if self.across(len(flat), "sum") == 0:
                break
            keys = [first_key(made[i].key_rows[k * g]) for i, k in flat]
            if spare is None:
                drawn = self.draw(model, [self.replacement(k, step, attempt) for k in keys], step)
                at = range(len(keys))
            else:
                drawn, where = spare
                at = [where[(k, attempt)] for k in keys]
            for n, (i, k) in zip(at, flat):
                made[i].replace(k, drawn, n, g)
            replaced += len(flat)
        still = sum(len(d.flat_groups(w, g)) for d in made)
        return {"resampled_groups": replaced, "flat_after_resampling": still}

    def replacement(self, key_row, step: int, attempt: int) -> tuple[list[int], int, str]:
        """(prompt ids, row, key) of the training prompt that replaces a flat group: drawn by its key alone, so
        every backend and a resumed run draw the same one."""
        key = f"{first_key(key_row)}~{attempt}"
        pos = sample_seed(self.engine.seed, step, key, 0) % len(self.train_prompts)
        rec = self.train_prompts[pos]
        return rec["input_ids"], rec["row"], key

    @torch.no_grad()
    def sampling_logps(self, model, input_ids, attention_mask, mask) -> torch.Tensor:
        """The log-probabilities (at `mask`'s positions, 0 elsewhere) of the policy that sampled these sequences:
        before its first update (TRL's old_per_token_logps, the ratio's denominator for every step that reuses
        the rollout), or rl.async's older copy that drew them (the importance weight's denominator)."""
        return token_logps(model, input_ids, attention_mask, self.cfg.temperature, mask)[0]

    @torch.no_grad()
    def reference_logps(self, model, ro: Rollout) -> torch.Tensor:
        """The KL reference's log-probabilities of the rollout: the frozen copy of the initial policy (full
        fine-tuning), or the base under the LoRA adapter."""
        args = ro.input_ids, ro.attention_mask, self.cfg.temperature, ro.mask
        if self.reference is not None:
            return token_logps(self.reference, *args)[0]
        with self.accelerator.unwrap_model(model).disable_adapter():
            return token_logps(model, *args)[0]
