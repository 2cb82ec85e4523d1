"""metrics.jsonl (one JSON object per logged step) and the loss plot."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from training.run.trackers import numeric


class MetricsWriter:
    """Appends rows to metrics.jsonl. On resume, rows after the resumed step are dropped first, so a
    resumed run's file reads like the uninterrupted run's.

    `tracker_log` (the Accelerator's `log`, when the recipe has report_to) gets the numeric fields of
    every row at its step: the one place rows reach the experiment trackers."""

    def __init__(
        self,
        path: Path,
        resume_step: int | None,
        enabled: bool = True,
        tracker_log: Callable[..., None] | None = None,
    ):
        self.path, self.enabled, self.tracker_log = Path(path), enabled, tracker_log
        self.resumed_elapsed_s = 0.0  # the training time the kept rows had reached (a resumed run goes on)
        if not enabled:
            return
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a kill
                if row.get("step", 0) <= resume_step:
                    kept.append(line)
                    self.resumed_elapsed_s = float(row.get("elapsed_s") or self.resumed_elapsed_s)
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tracker_log is not None and (values := numeric(clean)):
            self.tracker_log(values, step=row.get("step"))


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a torn last line from a kill
                rows.append(json.loads(line))
    return rows


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def plot_loss(metrics_path: Path, out_png: Path) -> None:
    """The loss curves; preference runs get a second panel with the reward curves and the accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    rewards = any(
        r.get("rewards_chosen") is not None or r.get("eval_rewards_chosen") is not None for r in rows
    )
    fig, axes = plt.subplots(1, 2 if rewards else 1, figsize=(12 if rewards else 7, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    named = sorted({k for r in rows for k in r if k.startswith("eval_loss/")})  # data.eval's named sets
    for key in named:
        ax.plot(*zip(*[(r["step"], r[key]) for r in rows if r.get(key) is not None]), ".--", lw=1, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if rewards:
        plot_rewards(axes[0][1], rows)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def plot_rewards(ax, rows: list[dict]) -> None:
    """Rewards of the chosen and rejected completions (train lines, eval dots), accuracy on the right."""
    for prefix, style in (("", "-"), ("eval_", "o--")):
        for key, color in (("rewards_chosen", "tab:green"), ("rewards_rejected", "tab:red")):
            pts = [(r["step"], r[prefix + key]) for r in rows if r.get(prefix + key) is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=color, lw=1, label=f"{prefix or 'train_'}{key}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    acc = [
        (r["step"], r["eval_preference_accuracy"])
        for r in rows
        if r.get("eval_preference_accuracy") is not None
    ]
    if acc:
        right = ax.twinx()
        right.plot(*zip(*acc), "s:", color="tab:blue", label="eval preference accuracy")
        right.set_ylim(0, 1.05)
        right.set_ylabel("preference accuracy")
        right.legend(loc="lower right", fontsize=8)
