"""The Export tab: exports (merged model, GGUF, Hub push, evaluation) as background jobs, one at a time, and
the job queue's status (the jobs, their commands and how they read: app/jobs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from app.context import REFRESH_S, AppContext, Page, changed_only, one_listener, user_error
from app.export_size import gguf_estimate
from app.jobs import EXPORT_ACTIONS, evaluate_argv, export_argv, job_markdown, jobs_rows
from app.runs import LaunchRefused, display_command


@dataclass(frozen=True)
class ExportView:
    """The Export tab's components."""

    run_pick: gr.Dropdown
    options: list  # what an export reads besides the run: [GGUF outtype, Hub repository, private]
    buttons: list  # merge, GGUF, push (in EXPORT_ACTIONS' order)
    estimate: gr.Markdown  # the GGUF file's size, before
    evaluation: list  # what Evaluate reads besides the run: [tasks, limit]
    eval_btn: gr.Button
    command: gr.Code
    job_md: gr.Markdown
    output: gr.Textbox
    jobs_table: gr.Dataframe


def export_tab(ctx: AppContext, page: Page) -> None:
    """Merge / GGUF / push a run with `python -m training.export`, score it with `python -m training.evaluate`.
    Each button queues a background job (app.jobs: one at a time, the others wait) and shows its exact
    command; the page polls the picked run's newest job: its state, its output and the queue."""
    view = _export_layout()
    timer = gr.Timer(REFRESH_S)
    export, evaluate, poll = _export_handlers(ctx)
    inputs = [view.run_pick, *view.options]
    for btn, action in zip(view.buttons, EXPORT_ACTIONS):
        btn.click(export(action), inputs, [view.command, view.job_md], api_name=f"export_{action}")
    view.eval_btn.click(
        evaluate, [view.run_pick, *view.evaluation], [view.command, view.job_md], api_name="evaluate"
    )
    shown = gr.State({})
    polled = [view.command, view.job_md, view.output, view.jobs_table, shown]
    polling = dict(
        fn=poll,
        inputs=[view.run_pick, shown],
        outputs=polled,
        api_visibility="private",
        show_progress="hidden",
    )
    timer.tick(**polling)
    for event in (
        page.demo.load,
        view.run_pick.focus,
    ):  # on page load, and when the picker opens (see run_tab)
        event(lambda: gr.update(choices=ctx.runs.names()), None, view.run_pick, api_visibility="private")
    outtype = view.options[0]

    def estimate(name, chosen):
        found = ctx.runs.find(name) if name else None
        return gguf_estimate(found.dir.root, chosen) if found is not None else ""

    estimating = dict(
        fn=estimate,
        inputs=[view.run_pick, outtype],
        outputs=view.estimate,
        api_visibility="private",
        show_progress="hidden",
    )
    outtype.change(**estimating)
    one_listener(view.run_pick.change, polling, estimating)
    job_status_api(ctx)


def _export_layout() -> ExportView:
    """The run and the export options, the buttons, Evaluate's tasks, then the job's command, state and output
    and the jobs table."""
    with gr.Row():
        run_pick = gr.Dropdown([], label="Run (runs/...)", allow_custom_value=True)
        outtype = gr.Dropdown(["f16", "bf16", "q8_0"], value="f16", label="GGUF outtype")
        repo = gr.Textbox(label="Hub repository (ORG/NAME)", placeholder="my-org/my-model")
        private = gr.Checkbox(False, label="private")
    with gr.Row():
        merge_btn = gr.Button("Merge adapter")
        gguf_btn = gr.Button("GGUF (llama.cpp / Ollama)")
        push_btn = gr.Button("Push to Hub")
    estimate = gr.Markdown("", elem_id="export-estimate")  # the GGUF file's size, before the job writes it
    with gr.Row():
        tasks = gr.Textbox("dates_exact_match", label="lm-eval tasks (comma-separated)")
        # a text box: a gr.Number cannot be empty (it showed 0)
        limit = gr.Textbox("", label="Limit (examples per task)", placeholder="empty: all")
        eval_btn = gr.Button("Evaluate", variant="primary")
    command = gr.Code(label="Command", language="shell", interactive=False)
    job_md = gr.Markdown("No job yet.", label="Job", elem_id="job-status")
    output = gr.Textbox(label="Job output (last lines)", lines=12, interactive=False)
    jobs_table = gr.Dataframe(
        headers=["job", "run", "state", "exit code", "queued"],
        label="Jobs (one at a time; the others wait)",
        interactive=False,
    )
    return ExportView(
        run_pick,
        [outtype, repo, private],
        [merge_btn, gguf_btn, push_btn],
        estimate,
        [tasks, limit],
        eval_btn,
        command,
        job_md,
        output,
        jobs_table,
    )


def _export_handlers(ctx: AppContext):
    """(export(action) -> its button's handler, evaluate, poll): what the Export tab's buttons and timer call."""

    def run_dir(name: str) -> Path:
        found = ctx.runs.find(name) if name else None
        if found is None:
            raise user_error(f"run: no run named {name!r} under runs/" if name else "pick a run first")
        return found.dir.root

    def queue(name: str, action: str, make_argv):
        """Queue the job `make_argv(run_rel)` builds on run `name`: (its command, its state)."""
        path = run_dir(name)
        try:
            argv = make_argv(ctx.ws.rel(path))
        except LaunchRefused as e:
            raise user_error(str(e)) from None
        job = ctx.jobs.submit(path, action, argv)
        return display_command(ctx.ws, argv), job_markdown(ctx.ws, job, ctx.jobs.waiting_before(job))

    def export(action):
        def handler(name, outtype, repo, private):
            return queue(
                name,
                action,
                lambda rel: export_argv(rel, action, outtype=outtype, repo=repo or "", private=private),
            )

        return handler

    def evaluate(name, tasks, limit):
        return queue(name, "evaluate", lambda rel: evaluate_argv(rel, tasks, limit))

    def poll(name, shown):
        """The picked run's newest job (command, state, output) and the queue, each sent only when it changed
        (`shown`: what the page shows, app.context.changed_only)."""
        table = jobs_rows(ctx.jobs.jobs())
        found = ctx.runs.find(name) if name else None
        job = ctx.jobs.latest(found.dir.root) if found is not None else None
        if job is None:
            command_text, state = None, "No job for this run yet." if found else "No run selected."
            tail = ""
        else:
            command_text = display_command(ctx.ws, job.argv)
            state, tail = job_markdown(ctx.ws, job, ctx.jobs.waiting_before(job)), ctx.jobs.log_tail(job)
        values, shown = changed_only(
            {
                # no job: the command box keeps what a button just queued
                "command": (command_text, gr.update() if command_text is None else command_text),
                "state": (state, state),
                "output": (tail, tail),
                "table": (repr(table), table),
            },
            shown,
        )
        return [*values, shown]

    return export, evaluate, poll


def job_status_api(ctx: AppContext) -> None:
    """The `job_status` API endpoint: a run's newest export/evaluate job (for scripts and tests)."""

    @gr.api(api_name="job_status")
    def job_status(name: str) -> dict:
        """The newest export/evaluate job of run `name`: id, action, state, exit code, command, output."""
        found = ctx.runs.find(name)
        job = ctx.jobs.latest(found.dir.root) if found is not None else None
        if job is None:
            raise user_error(
                f"run {name!r}: no export or evaluate job" if found else f"run: no run named {name!r}"
            )
        return {
            "id": job.id,
            "action": job.action,
            "state": job.state,
            "returncode": job.returncode,
            "command": display_command(ctx.ws, job.argv),
            "waiting_before": ctx.jobs.waiting_before(job),
            "log": ctx.ws.rel(job.path(ctx.ws, ".log")),
            "output": ctx.jobs.log_tail(job),
        }
