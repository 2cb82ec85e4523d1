"""What online RL logs: the step's sums (this rank's, reduced over every rank in one collective) made into the
metrics row (reward, lengths, clipping, KL, entropy, timing, episodes' turns and tools), the held-out row,
and the samples file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from training.config import RLSection

EVAL_SUMS = ("reward", "passed", "n", "length")
MADE_NOW = ("gen_s", "gen_tokens", "idle_calls")  # a step that reuses the rollouts generates nothing


class Sums(dict):
    """Named float sums of this rank, reduced over every rank in one collective."""

    def add(self, **values) -> None:
        for k, v in values.items():
            self[k] = self.get(k, 0.0) + float(v)

    def reduced(self, accelerator) -> dict:
        keys = sorted(self)
        t = torch.tensor([self[k] for k in keys], dtype=torch.float64, device=accelerator.device)
        return dict(zip(keys, accelerator.reduce(t, "sum").tolist()))

    def kept(self) -> Sums:
        """The sums that describe the rollouts themselves (rewards, lengths), without what generating them cost:
        reported again by every step that reuses them."""
        return Sums({k: v for k, v in self.items() if k not in MADE_NOW})


def step_row(s: dict, cfg: RLSection, procs: int) -> dict:
    """The metrics row of a step from its sums reduced over every rank (`procs` processes)."""
    n = max(s["n"], 1)
    tokens = max(s["tokens"], 1)
    mean = s["reward"] / n
    row = {
        "reward": mean,
        "reward_std": max(0.0, (s["reward_sq"] - n * mean**2) / max(n - 1, 1)) ** 0.5,
        **{k: v / n for k, v in s.items() if k.startswith("reward/")},
        "completion_length": s["length"] / n,
        "truncated_fraction": s["truncated"] / n,
        "frac_reward_zero_std": s["zero_std_groups"] / max(s["groups"], 1),
        "clip_fraction": s["clipped"] / tokens,
        "clip_ratio/low_mean": s["clip_low"] / tokens,
        "clip_ratio/high_mean": s["clip_high"] / tokens,
        "clip_ratio/region_mean": s["clipped"] / tokens,
        "entropy": s["entropy"] / tokens,
        "generation_s": s["gen_s"] / procs,
        "generation_tokens_per_s": s["gen_tokens"] / max(s["gen_s"] / procs, 1e-9),
        "train_s": s["train_s"] / procs,
    }
    if cfg.beta > 0:
        row["kl"] = s["kl"] / tokens
    if "staleness" in s:  # rl.async: the same on every rank
        row["staleness"] = s["staleness"] / procs
        row["rollout_wait_s"] = s["wait_s"] / procs
        row["importance_ratio/mean"] = s["is_ratio"] / tokens
        row["importance_ratio/truncated_fraction"] = s["is_truncated"] / tokens
    for k in ("turns", "tool_calls", "tool_errors", "tool_tokens"):  # per episode
        if k in s:
            row[k] = s[k] / n
    for k in ("resampled_groups", "flat_after_resampling", "idle_calls"):  # counts of the step
        if k in s:
            row[k] = s[k]
    return row


def eval_row(total: torch.Tensor, rewards: list, suffix: str = "") -> dict:
    """eval_reward, eval_pass_rate, eval_completion_length and each function's mean reward."""
    n = max(total[2].item(), 1)
    row = {
        f"eval_reward{suffix}": total[0].item() / n,
        f"eval_pass_rate{suffix}": total[1].item() / n,
        f"eval_completion_length{suffix}": total[3].item() / n,
    }
    for j, f in enumerate(rewards):
        row[f"eval_reward/{f.name}{suffix}"] = total[len(EVAL_SUMS) + j].item() / n
    return row


def eval_line(row: dict) -> str:
    return (
        f"eval reward {row['eval_reward']:.3f}, pass rate {row['eval_pass_rate']:.3f}, "
        f"completion length {row['eval_completion_length']:.1f}"
    )


def write_samples(path: Path, step: int, prompts_of, samples: list[dict], limit: int) -> None:
    """The first `limit` samples of the step appended to samples.jsonl, each with its prompt."""
    lines = [
        json.dumps({"step": step, "prompt": prompts_of[s["row"]], **s}, ensure_ascii=False)
        for s in samples[:limit]
    ]
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
