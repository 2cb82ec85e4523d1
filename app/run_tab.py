"""The Run tab: start the Configure tab's recipe (its YAML, backend and process count: `RecipeInputs`, handed
over by app/ui.py), stop a run, watch the chosen one (progress, trackers and evaluation, chart, log, the runs
table, the latest agent episodes) and compare runs. What it shows of a run is app/run_views.py; the runs,
started and stopped, are app/runs.py's registry."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from app.charts import X_AXES, run_figure
from app.compare import compare_figure, compare_table, compared
from app.context import REFRESH_S, AppContext, Page, RecipeInputs, changed_only, user_error
from app.recipe_check import RecipeRefused, checked_recipe
from app.run_views import eval_markdown, progress_markdown, tracker_markdown
from app.runs import LOG, LaunchRefused
from app.samples import episode_messages, samples_markdown
from app.workspace import PathRefused

LOG_LINES = 15


def run_tab(ctx: AppContext, page: Page, recipe: RecipeInputs) -> None:
    """Start the Configure tab's recipe, stop a run, and watch the chosen one (progress, loss, log, table)."""
    with gr.Row():
        start_btn = gr.Button("Start run (recipe from Configure)", variant="primary")
        stop_btn = gr.Button("Stop (saves a checkpoint)", variant="stop")
        run_pick = gr.Dropdown([], label="Run", allow_custom_value=True)
    run_msg = gr.Markdown(label="Run message")
    shown = gr.State({})  # what the page shows of the run (app.context.changed_only)
    refresh_out = [*run_view(), stop_btn, shown]
    timer = gr.Timer(REFRESH_S)
    start_run, stop_run, refresh, reattach = run_handlers(ctx)
    start_btn.click(
        start_run,
        [recipe.yaml_box, recipe.backend, recipe.nprocs],
        [run_msg, run_pick, page.tabs],
        api_name="start_run",
    )
    stop_btn.click(stop_run, run_pick, run_msg, api_name="stop_run")
    for event in (timer.tick, run_pick.change):
        event(refresh, [run_pick, shown], refresh_out, api_visibility="private", show_progress="hidden")
    page.demo.load(reattach, None, run_pick, api_visibility="private")
    # a run started since the page loaded (from the command line too) is offered when the picker opens
    run_pick.focus(lambda: gr.update(choices=ctx.runs.names()), None, run_pick, api_visibility="private")
    run_status_api(ctx)
    compare_section(ctx, page)


def run_view() -> list:
    """What the Run tab shows of the chosen run: [progress, trackers and evaluation, chart (app/charts.py),
    log tail, runs table, latest agent episodes] (refreshed together)."""
    progress = gr.Markdown("No run yet.", label="Progress", elem_id="progress")
    outputs_md = gr.Markdown("", label="Trackers and evaluation", elem_id="run-outputs")
    chart = gr.Plot(  # no label shown: it lay over the chart's top (its first eval point, its top tick)
        label="Loss; rewards below it for preference tuning (chosen and rejected completions) and online RL "
        "(mean reward of the rollouts, of greedy held-out answers); gradient norm and learning rate",
        show_label=False,
        elem_id="run-chart",
    )
    log_box = gr.Textbox(
        label=f"Log ({LOG}, last lines)",
        lines=LOG_LINES,
        max_lines=LOG_LINES,
        autoscroll=True,
        interactive=False,
    )
    runs_table = gr.Dataframe(
        headers=["run", "state", "step", "loss", "backend", "started"], label="Runs", interactive=False
    )
    episodes = gr.Chatbot(label="Latest episodes (online RL with tools)", visible=False, elem_id="episodes")
    return [progress, outputs_md, chart, log_box, runs_table, episodes]


def run_handlers(ctx: AppContext):
    """(start_run, stop_run, refresh, reattach): what the Run tab's buttons, timer and page load call."""
    runs = ctx.runs

    def start_run(text, backend_name, n):
        try:
            raw, run_dir = checked_recipe(ctx.ws, text)
        except RecipeRefused as e:
            raise user_error(str(e), duration=None) from None
        try:
            rec = runs.start(text, run_dir, backend_name, int(n or 1))
        except (LaunchRefused, PathRefused) as e:
            raise user_error(f"not started: {e}", duration=None) from None
        return (
            f"started **{rec.name}** (pid {rec.pid}): `{' '.join(rec.argv)}`",
            gr.update(choices=runs.names(), value=rec.name),
            gr.Tabs(selected="run"),
        )

    def stop_run(name):
        try:
            return runs.stop(name)
        except LaunchRefused as e:
            raise user_error(str(e)) from None

    def refresh(name, shown):
        """The chosen run as it is now, each part sent only when it changed (`shown`: what the page shows, kept
        per page; the chart is drawn again only when the run has new rows)."""
        values, shown = changed_only(run_outputs(ctx, name), shown)
        return [*values, shown]

    def reattach():
        """On page load: select the run still going (or the newest one)."""
        active = runs.active()
        names = runs.names()
        return gr.update(choices=names, value=active.name if active else (names[0] if names else None))

    return start_run, stop_run, refresh, reattach


def run_outputs(ctx: AppContext, name: str) -> dict:
    """The Run tab's outputs for run `name` (app.context.changed_only's shape): name -> (key, value)."""
    views = ctx.views
    table = views.table()
    found = ctx.runs.find(name) if name else None
    if found is None:
        progress, extra, log_tail, episodes, running, chart = (
            "No run selected.",
            "",
            "",
            [],
            False,
            ("", None),
        )
    else:
        v = views.view(name)
        samples = views.latest_samples(name)
        parts = (tracker_markdown(ctx.ws, found.dir), eval_markdown(found.dir), samples_markdown(samples))
        progress, extra = progress_markdown(v), "\n\n".join(t for t in parts if t)
        log_tail, episodes, running = (
            views.log_tail(name, LOG_LINES),
            episode_messages(samples),
            v.state == "running",
        )
        chart = (f"{name}:{len(v.rows)}", lambda: run_figure(v.rows))
    return {
        "progress": (progress, progress),
        "extra": (extra, extra),
        "chart": chart,
        "log": (log_tail, log_tail),
        "table": (repr(table), table),
        "episodes": (repr(episodes), gr.update(value=episodes, visible=bool(episodes))),
        "stop": (running, gr.update(interactive=running)),  # offered only while the chosen run is going
    }


def run_status_api(ctx: AppContext) -> None:
    """The `run_status` API endpoint (for scripts and tests)."""
    runs, views = ctx.runs, ctx.views

    @gr.api(api_name="run_status")
    def run_status(name: str) -> dict:
        """A run's state, progress and metrics (for scripts and tests)."""
        try:
            v = views.view(name)
        except LaunchRefused as e:
            raise user_error(str(e)) from None
        return {
            "name": v.name,
            "state": v.state,
            "step": v.step,
            "total_steps": v.total_steps,
            "elapsed_s": v.elapsed_s,
            "remaining_s": v.remaining_s,
            "loss": v.loss,
            "eval_loss": v.eval_loss,
            # preference tuning: the latest rewards_* and (eval_)preference_accuracy values; online RL: reward*,
            # eval_reward*, eval_pass_rate
            "rewards": {
                k: x
                for r in v.rows
                for k, x in r.items()
                if "reward" in k or "preference_accuracy" in k or k == "eval_pass_rate"
            },
            "samples": views.latest_samples(
                name
            ),  # online RL: the last step's prompt/completion/reward samples
            "message": v.message,
            "metrics_rows": len(v.rows),
            "active": getattr(runs.active(), "name", None),
        }


def compare_section(ctx: AppContext, page: Page) -> None:
    """The Run tab's "Compare runs": pick runs (and the x axis), see their curves and how they differ
    (app/compare.py)."""
    views = ctx.views
    with gr.Accordion("Compare runs", open=False):
        with gr.Row():
            pick = gr.Dropdown([], multiselect=True, label="Runs to compare", scale=4)
            axis = gr.Radio(list(X_AXES), value="steps", label="x axis", scale=1)
        plot = gr.Plot(
            label="Loss (and rewards), gradient norm and learning rate of the runs compared",
            show_label=False,  # the label lay over the chart's top
            elem_id="compare-plot",
        )
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

    for event in (page.demo.load, pick.focus):  # the runs as they are now (see run_tab)
        event(lambda: gr.update(choices=ctx.runs.names()), None, pick, api_visibility="private")
