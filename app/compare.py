"""Runs side by side (the Run tab's "Compare runs"): their loss curves, training and eval, on one chart against
steps or tokens, and a table of each run's latest figures and the recipe keys in which the runs differ."""

from __future__ import annotations

import gradio as gr
import pandas as pd
import yaml
from matplotlib.figure import Figure

from app.context import AppContext
from app.runs import RunManager, RunView
from training.run.resume import flatten

X_AXES = {"steps": "step", "tokens": "tokens"}  # what the chart's x axis counts -> the metrics key
SAME_FOR_ALL = ("output_dir",)  # differs between any two runs, says nothing


def loss_rows(rows: list[dict], x: str = "step") -> list[dict]:
    """A run's metrics rows -> its loss points, one series for training and one for eval (x: the metrics
    key of the x axis; tokens are counted cumulatively from the rows' `tokens` where the run logs them)."""
    seen, out = 0, []
    for r in rows:
        seen += r.get("tokens") or 0
        at = seen if x == "tokens" else r.get("step")
        if at is None:
            continue
        if r.get("loss") is not None:
            out.append({x: at, "loss": r["loss"], "series": "train"})
        if r.get("eval_loss") is not None:
            out.append({x: at, "loss": r["eval_loss"], "series": "eval"})
    return out


def compared(runs: RunManager, names: list[str]) -> dict[str, tuple[RunView, dict]]:
    """The listed runs among `names`, each read once: name -> (its view, its recipe as a dict)."""
    out = {}
    for name in names:
        found = runs.find(name)
        if found is None:
            continue
        try:
            recipe = yaml.safe_load(found.dir.config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            recipe = {}
        out[name] = (runs.view(name), recipe)
    return out


def compare_points(chosen: dict[str, tuple[RunView, dict]], x: str = "step") -> list[dict]:
    """Every chosen run's loss points, each series named 'RUN · train' / 'RUN · eval'."""
    out = []
    for name, (view, _) in chosen.items():
        for p in loss_rows(view.rows, x):
            out.append({**p, "series": f"{name} · {p['series']}"})
    return out


def compare_figure(points: list[dict], x: str = "step") -> Figure | None:
    """The chart: one line per series, eval dashed (matplotlib: a new set of series redraws whole)."""
    if not points:
        return None
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for series in dict.fromkeys(p["series"] for p in points):
        mine = [p for p in points if p["series"] == series]
        style = "--" if series.endswith("eval") else "-"
        ax.plot(
            [p[x] for p in mine],
            [p["loss"] for p in mine],
            style,
            marker="." if len(mine) < 30 else None,
            label=series,
        )
    ax.set_xlabel("tokens" if x == "tokens" else "step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


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
    runs = ctx.runs
    with gr.Accordion("Compare runs", open=False):
        with gr.Row():
            pick = gr.Dropdown([], multiselect=True, label="Runs to compare", scale=4)
            axis = gr.Radio(list(X_AXES), value="steps", label="x axis", scale=1)
        plot = gr.Plot(label="Loss of the runs compared", elem_id="compare-plot")
        table = gr.Dataframe(
            label="The runs compared: latest figures and the recipe keys in which they differ",
            interactive=False,
        )

    def compare(names, x_axis):
        chosen, x = compared(runs, names or []), X_AXES.get(x_axis, "step")
        headers, rows = compare_table(chosen)
        return compare_figure(compare_points(chosen, x), x), pd.DataFrame(rows, columns=headers)

    for event in (pick.change, axis.change):
        event(compare, [pick, axis], [plot, table], api_visibility="private")

    @gr.api(api_name="compare_runs")
    def compare_runs(names: list[str]) -> dict:
        """The compare table of runs `names`: {"headers": [...], "rows": [[...], ...]} (for scripts and tests)."""
        headers, rows = compare_table(compared(runs, names))
        return {"headers": headers, "rows": rows}

    for event in (ctx.demo.load, pick.focus):  # the runs as they are now (see run_tab)
        event(lambda: gr.update(choices=[f.name for f in runs.runs()]), None, pick, api_visibility="private")
