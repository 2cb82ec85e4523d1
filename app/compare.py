"""Runs side by side (the Run tab's "Compare runs"): their loss curves, training and eval, and their reward
curves where they have them, on one chart against steps or tokens (app/charts.py), and a table of each run's
latest figures and the recipe keys in which the runs differ."""

from __future__ import annotations

import yaml

from app.charts import curve_points, curves_figure, panels_of
from app.run_views import RunView, RunViews
from training.run.resume import flatten

SAME_FOR_ALL = ("output_dir",)  # differs between any two runs, says nothing


def compared(views: RunViews, names: list[str]) -> dict[str, tuple[RunView, dict]]:
    """The listed runs among `names`, each read once: name -> (its view, its recipe as a dict)."""
    out = {}
    for name in names:
        found = views.runs.find(name)
        if found is None:
            continue
        try:
            recipe = yaml.safe_load(found.dir.config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            recipe = {}
        out[name] = (views.view(name), recipe)
    return out


def compare_points(
    chosen: dict[str, tuple[RunView, dict]], keys: dict[str, str], x: str = "step"
) -> list[dict]:
    """Every chosen run's points of the metrics `keys` ({metrics key: series}, as charts.curve_points takes),
    each series named 'RUN · train', 'RUN · eval', 'RUN · reward' and so on."""
    return [
        {**p, "series": f"{name} · {p['series']}"}
        for name, (view, _) in chosen.items()
        for p in curve_points(view.rows, keys, x)
    ]


def compare_figure(chosen: dict[str, tuple[RunView, dict]], x: str = "step"):
    """The chart: the runs' losses, below them their rewards where some run has them, then their gradient norms
    and learning rates."""
    return curves_figure(panels_of(lambda keys: compare_points(chosen, keys, x)), x)


def differing_keys(recipes: dict[str, dict]) -> list[str]:
    """The dotted recipe keys whose values are not the same in every run (a key one run lacks differs)."""
    flat = {name: flatten(raw) for name, raw in recipes.items()}
    keys = sorted({k for f in flat.values() for k in f})
    missing = object()
    return [
        k for k in keys if k not in SAME_FOR_ALL and len({repr(f.get(k, missing)) for f in flat.values()}) > 1
    ]


def compare_table(chosen: dict[str, tuple[RunView, dict]]) -> tuple[list[str], list[list]]:
    """(headers, rows): per run its state, step, latest loss and eval loss, then the differing recipe keys."""
    keys = differing_keys({name: recipe for name, (_, recipe) in chosen.items()})
    rows = []
    for name, (v, recipe) in chosen.items():
        flat = flatten(recipe)
        latest = ["" if x is None else round(x, 4) for x in (v.loss, v.eval_loss)]  # not 2.7000000000000002
        rows.append([name, v.state, v.step, *latest, *(str(flat.get(k, "")) for k in keys)])
    return ["run", "state", "step", "loss", "eval loss", *keys], rows
