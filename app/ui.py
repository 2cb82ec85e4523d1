"""The Gradio Blocks: Configure, Run, Export & evaluate and Chat tabs wired to the workspace, run manager and
chat models.

`build_app` lays out the page; each tab is built by its own function (`configure_tab` in app/configure_tab.py,
`run_tab` here, `export_tab` in app/export_tab.py, `chat_tab` in app/chat_tab.py) from one `AppContext`
(app/context.py), which holds what the tabs share. What an endpoint decides (is the recipe launchable, which
command runs it, what the planner says, one chat turn) lives in module-level functions, so tests call them
without a server.

Named API endpoints (see the app's "Use via API" page or `gradio_client.Client.view_api()`):
form_to_yaml, yaml_to_form, find_setting, load_recipe, save_recipe, launch_command, memory_plan, data_preview,
start_run, stop_run, run_status (structured), compare_runs (structured), export_merge, export_gguf, export_push,
evaluate (these four queue a background job), job_status (structured), load_model, unload_models, chat.
"""

from __future__ import annotations

import gradio as gr

from app.charts import run_figure
from app.chat_models import ChatModels
from app.chat_tab import chat_tab
from app.compare import compare_section
from app.configure_tab import configure_tab
from app.context import REFRESH_S, AppContext, changed_only, user_error
from app.export_tab import export_tab
from app.jobs import JobQueue
from app.recipe_check import RecipeRefused, checked_recipe
from app.recipe_form import form_fields, grouped
from app.run_views import RunViews, eval_markdown, progress_markdown, tracker_markdown
from app.runs import LOG, LaunchRefused, RunRegistry
from app.samples import episode_messages, samples_markdown
from app.workspace import PathRefused, Workspace

CSS = """
.field-error .info, .field-error span[data-testid='block-info'] + div { color: #c62828 !important; }
.field-error { outline: 2px solid #e53935; border-radius: 6px; }
.section-errors p { color: #c62828; }
#status-ok p { color: #2e7d32; }
.preview-example { white-space: pre-wrap; font-size: 0.85em; }
.preview-example mark { background: #ffe08a; }
"""
LOG_LINES = 15


def build_app(ws: Workspace) -> gr.Blocks:
    """The page: a header and the Configure, Run and Chat tabs."""
    runs = RunRegistry(ws)
    ctx = AppContext(
        ws, runs, RunViews(runs), ChatModels(ws), JobQueue(ws, runs.run_dirs), grouped(form_fields())
    )
    with gr.Blocks(title="llm-forge", analytics_enabled=False) as ctx.demo:
        gr.Markdown(
            f"# llm-forge\nWorkspace: `{ws.root}` — runs in `runs/`, recipes in `recipes/`, data in `data/`."
        )
        with gr.Tabs() as ctx.tabs:
            with gr.Tab("Configure", id="configure"):
                configure_tab(ctx)
            with gr.Tab("Run", id="run"):
                run_tab(ctx)
            with gr.Tab("Export & evaluate", id="export"):
                export_tab(ctx)
            with gr.Tab("Chat", id="chat"):
                chat_tab(ctx)
    return ctx.demo


# ---------------------------------------------------------------------------------------- Run


def run_tab(ctx: AppContext) -> None:
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
        [ctx.yaml_box, ctx.backend, ctx.nprocs],
        [run_msg, run_pick, ctx.tabs],
        api_name="start_run",
    )
    stop_btn.click(stop_run, run_pick, run_msg, api_name="stop_run")
    for event in (timer.tick, run_pick.change):
        event(refresh, [run_pick, shown], refresh_out, api_visibility="private", show_progress="hidden")
    ctx.demo.load(reattach, None, run_pick, api_visibility="private")
    # a run started since the page loaded (from the command line too) is offered when the picker opens
    run_pick.focus(lambda: gr.update(choices=ctx.runs.names()), None, run_pick, api_visibility="private")
    run_status_api(ctx)
    compare_section(ctx)


def run_view() -> list:
    """What the Run tab shows of the chosen run: [progress, trackers and evaluation, chart (app/charts.py),
    log tail, runs table, latest agent episodes] (refreshed together)."""
    progress = gr.Markdown("No run yet.", label="Progress", elem_id="progress")
    outputs_md = gr.Markdown("", label="Trackers and evaluation", elem_id="run-outputs")
    chart = gr.Plot(
        label="Loss; rewards below it for preference tuning (chosen and rejected completions) and online RL "
        "(mean reward of the rollouts, of greedy held-out answers)",
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
