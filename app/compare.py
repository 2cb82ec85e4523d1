"""Runs side by side (the Run tab's "Compare runs"): their loss curves, training and eval, and their reward
curves where they have them, on one chart against steps or tokens (app/charts.py), and a table of each run's
latest figures and the recipe keys in which the runs differ."""

from __future__ import annotations

import gradio as gr
import pandas as pd
import yaml

from app.charts import X_AXES, curves_figure, loss_points, reward_points
from app.context import AppContext
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


def compare_points(chosen: dict[str, tuple[RunView, dict]], points, x: str = "step") -> list[dict]:
    """Every chosen run's points (`points`: charts.loss_points or reward_points), each series named
    'RUN · train', 'RUN · eval', 'RUN · reward' and so on."""
    return [
        {**p, "series": f"{name} · {p['series']}"}
        for name, (view, _) in chosen.items()
        for p in points(view.rows, x)
    ]


def compare_figure(chosen: dict[str, tuple[RunView, dict]], x: str = "step"):
    """The chart: the runs' losses, and below them their rewards where some run has them."""
    return curves_figure(
        [
            ("loss", compare_points(chosen, loss_points, x)),
            ("reward", compare_points(chosen, reward_points, x)),
        ],
        x,
    )


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
        latest = ["" if x is None else x for x in (v.loss, v.eval_loss)]
        rows.append([name, v.state, v.step, *latest, *(str(flat.get(k, "")) for k in keys)])
    return ["run", "state", "step", "loss", "eval loss", *keys], rows


def compare_section(ctx: AppContext) -> None:
    """The Run tab's "Compare runs": pick runs (and the x axis), see their curves and how they differ."""
    views = ctx.views
    with gr.Accordion("Compare runs", open=False):
        with gr.Row():
            pick = gr.Dropdown([], multiselect=True, label="Runs to compare", scale=4)
            axis = gr.Radio(list(X_AXES), value="steps", label="x axis", scale=1)
        plot = gr.Plot(label="Loss (and rewards) of the runs compared", elem_id="compare-plot")
        table = gr.Dataframe(
            label="The runs compared: latest figures and the recipe keys in which they differ",
            interactive=False,
            elem_id="compare-table",
        )

    def compare(names, x_axis):
        chosen, x = compared(views, names or []), X_AXES.get(x_axis, "step")
        headers, rows = compare_table(chosen)
        return compare_figure(chosen, x), pd.DataFrame(rows, columns=headers)

    for event in (pick.change, axis.change):
        event(compare, [pick, axis], [plot, table], api_visibility="private")

    @gr.api(api_name="compare_runs")
    def compare_runs(names: list[str]) -> dict:
        """The compare table of runs `names`: {"headers": [...], "rows": [[...], ...]} (for scripts and tests)."""
        headers, rows = compare_table(compared(views, names))
        return {"headers": headers, "rows": rows}

    for event in (ctx.demo.load, pick.focus):  # the runs as they are now (see run_tab)
        event(lambda: gr.update(choices=ctx.runs.names()), None, pick, api_visibility="private")
