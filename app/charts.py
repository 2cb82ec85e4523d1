"""The app's curves: the Run tab's chart of one run and the chart of "Compare runs". Points come from a run's
metrics rows; each chart is one matplotlib figure with a loss panel, for preference and RL runs a reward panel
below it, then smaller panels of the gradient norm and the learning rate, x in whole steps (or tokens), eval
series dashed.

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


STEP_KEYS = {"grad_norm": "grad norm", "lr": "learning rate"}  # the optimizer's figures, one panel each


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


def panels_of(points) -> list[tuple[str, list[dict]]]:
    """The chart's panels (y label, points), top to bottom: the loss, the rewards, the gradient norm and the
    learning rate; `points(keys)` gives a panel's points of the metrics `keys` ({metrics key: series})."""
    return [
        ("loss", points(LOSS_KEYS)),
        ("reward", points(REWARD_KEYS)),
        *((name, points({key: name})) for key, name in STEP_KEYS.items()),
    ]


def _is_eval(series: str) -> bool:
    return series.split(" · ")[-1].startswith("eval")  # "eval", "eval reward", "RUN · eval"


def curves_figure(panels: list[tuple[str, list[dict]]], x: str = "step") -> Figure | None:
    """One figure of the panels (y label, points) that have points, stacked, sharing the x axis; None when
    none has."""
    panels = [(label, points) for label, points in panels if points]
    if not panels:
        return None
    heights = [3.0 if label in ("loss", "reward") else 1.6 for label, _ in panels]  # the optimizer's: smaller
    fig = Figure(figsize=(10, sum(heights) + 0.4), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (label, points) in zip(axes, panels):
        names = list(dict.fromkeys(p["series"] for p in points))
        for series in names:
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
        if names != [label]:  # a panel of one series is named by its axis
            ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes[-1].set_xlabel("tokens" if x == "tokens" else "step")
    return fig


def run_figure(rows: list[dict]) -> Figure | None:
    """The Run tab's chart of one run: its loss, its rewards where it has them, its gradient norm and learning
    rate."""
    return curves_figure(panels_of(lambda keys: curve_points(rows, keys)))
