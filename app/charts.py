"""The app's curves: the Run tab's chart of one run and the chart of "Compare runs". Points come from a run's
metrics rows; each chart is one matplotlib figure with a loss panel and, for preference and RL runs, a reward
panel below it, x in whole steps (or tokens), eval series dashed.

matplotlib rather than gradio's LinePlot, which fixes its colour domain at its first render (a series that
appears later, such as the first eval row, is never drawn) and puts fractional ticks on a step axis.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

X_AXES = {"steps": "step", "tokens": "tokens"}  # what the x axis counts -> the metrics key
LOSS_KEYS = {"loss": "train", "eval_loss": "eval"}  # metrics key -> series
REWARD_KEYS = {
    # preference tuning: the implicit rewards of the chosen and rejected completions
    "rewards_chosen": "chosen",
    "rewards_rejected": "rejected",
    "eval_rewards_chosen": "eval chosen",
    "eval_rewards_rejected": "eval rejected",
    # online RL: the mean reward of the rollouts, of greedy held-out answers
    "reward": "reward",
    "eval_reward": "eval reward",
}


def curve_points(rows: list[dict], keys: dict[str, str], x: str = "step") -> list[dict]:
    """A run's metrics rows -> points {x: at, "value": v, "series": name} of the metrics in `keys` (x: the
    metrics key of the x axis; tokens are counted cumulatively from the rows' `tokens`, where the run logs them)."""
    seen, out = 0, []
    for r in rows:
        seen += r.get("tokens") or 0
        at = seen if x == "tokens" else r.get("step")
        if at is None:
            continue
        out += [{x: at, "value": r[k], "series": s} for k, s in keys.items() if r.get(k) is not None]
    return out


def loss_points(rows: list[dict], x: str = "step") -> list[dict]:
    return curve_points(rows, LOSS_KEYS, x)


def reward_points(rows: list[dict], x: str = "step") -> list[dict]:
    """The reward panel's points (none for a supervised run)."""
    return curve_points(rows, REWARD_KEYS, x)


def _is_eval(series: str) -> bool:
    return series.split(" · ")[-1].startswith("eval")  # "eval", "eval reward", "RUN · eval"


def curves_figure(panels: list[tuple[str, list[dict]]], x: str = "step") -> Figure | None:
    """One figure of the panels (y label, points) that have points, stacked, sharing the x axis; None when
    none has."""
    panels = [(label, points) for label, points in panels if points]
    if not panels:
        return None
    fig = Figure(figsize=(10, 3.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, points) in zip(axes, panels):
        for series in dict.fromkeys(p["series"] for p in points):
            mine = [p for p in points if p["series"] == series]
            ax.plot(
                [p[x] for p in mine],
                [p["value"] for p in mine],
                "--" if _is_eval(series) else "-",
                marker="." if len(mine) < 30 else None,
                label=series,
            )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes[-1].set_xlabel("tokens" if x == "tokens" else "step")
    return fig


def run_figure(rows: list[dict]) -> Figure | None:
    """The Run tab's chart of one run: its loss, and its rewards where it has them."""
    return curves_figure([("loss", loss_points(rows)), ("reward", reward_points(rows))])
