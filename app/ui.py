"""The Gradio Blocks: Configure, Run, Export & evaluate and Chat tabs wired to the workspace, run manager and chat models.

`build_app` lays out the page; each tab is built by its own function (`configure_tab`, `run_tab`, `export_tab`,
`chat_tab` in app/chat_tab.py) from one `AppContext` (app/context.py), which holds what the tabs share. What
an endpoint decides (is the recipe launchable, which command runs it, what the planner says, one chat turn)
lives in module-level functions, so tests call them without a server.

Named API endpoints (see the app's "Use via API" page or `gradio_client.Client.view_api()`):
form_to_yaml, yaml_to_form, load_recipe, save_recipe, launch_command, memory_plan, start_run,
stop_run, run_status (structured), export_merge, export_gguf, export_push, evaluate (these four queue a
background job), job_status (structured), load_model, unload_models, chat.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gradio as gr
import pandas as pd
import torch

from app.chat_models import ChatModels
from app.chat_tab import chat_tab
from app.compare import compare_section, loss_rows
from app.context import REFRESH_S, AppContext, run_names, user_error
from app.export_tab import export_tab
from app.jobs import JobQueue
from app.preview import examples_html, lengths_figure, run_preview, summary_markdown
from app.recipe_form import (
    NONE_CHOICE,
    FormField,
    YamlError,
    applies,
    dict_to_values,
    edit_yaml,
    errors_text,
    field_errors,
    form_fields,
    grouped,
    on_fields,
    parse_yaml,
    to_yaml,
    values_to_dict,
)
from app.runs import (
    LOG,
    PYTHON_BACKEND,
    RECIPE,
    LaunchRefused,
    RunManager,
    backend_label,
    default_processes,
    display_command,
    eval_markdown,
    launch_argv,
    progress_markdown,
    tracker_markdown,
)
from app.samples import episode_messages, samples_markdown
from app.workspace import PathRefused, Workspace, check_name, recipe_refusals
from training.config import parse_recipe
from training.core.errors import UserError
from training.launch.backend import Backend, read_backend
from training.launch.refusals import refusal
from training.planning.memory import estimate
from training.planning.report import format_plan

CSS = """
.field-error .info, .field-error span[data-testid='block-info'] + div { color: #c62828 !important; }
.field-error { outline: 2px solid #e53935; border-radius: 6px; }
.section-errors p { color: #c62828; }
#status-ok p { color: #2e7d32; }
.preview-example { white-space: pre-wrap; font-size: 0.85em; }
.preview-example mark { background: #ffe08a; }
"""
LOG_LINES = 15
STARTER = {  # the form's starting point when the workspace has no recipe: a tiny model from scratch
    "output_dir": "runs/my-run",
    "model": {
        "tokenizer": "bundled:smollm2-135m-instruct",
        "from_scratch": {"hidden_size": 128, "num_hidden_layers": 2},
    },
    "data": {"train": ["data/tiny_stories.txt"], "format": "text", "max_length": 128},
    "train": {"max_steps": 100, "lr": 0.003},
}


SERIES = ("train", "eval")


def _loss_frame(rows: list[dict]) -> pd.DataFrame | None:
    """Loss curve data (None while there is none).

    Gradio's LinePlot fixes its colour domain at the first render that has data, so a series that
    appears later (the first eval row) would never be drawn. Every frame therefore holds both
    series: a missing one gets a single point on top of the other's first point, and a one-point
    line draws nothing."""
    if not rows:
        return None
    for name in SERIES:
        if not any(r["series"] == name for r in rows):
            rows = rows + [{**rows[0], "series": name}]
    return pd.DataFrame(rows).astype({"step": "int64", "loss": "float64", "series": "str"})


PREFERENCE_SERIES = ("chosen", "rejected", "eval chosen", "eval rejected")
RL_SERIES = (
    "reward",
    "eval reward",
)  # online RL: the mean reward of the rollouts, of greedy held-out answers
REWARD_SERIES = PREFERENCE_SERIES + RL_SERIES
REWARD_KEYS = {  # metrics key -> series
    "rewards_chosen": "chosen",
    "rewards_rejected": "rejected",
    "eval_rewards_chosen": "eval chosen",
    "eval_rewards_rejected": "eval rejected",
    "reward": "reward",
    "eval_reward": "eval reward",
}


def reward_rows(rows: list[dict]) -> list[dict]:
    """A preference or RL run's metrics rows -> the reward plot's points (none for supervised runs)."""
    return [
        {"step": r["step"], "reward": r[key], "series": series}
        for key, series in REWARD_KEYS.items()
        for r in rows
        if r.get(key) is not None
    ]


def _reward_frame(rows: list[dict]):
    """Reward curve data, every series of its kind present (see _loss_frame); hidden for runs without rewards."""
    if not rows:
        return gr.update(value=None, visible=False)
    kind = RL_SERIES if any(r["series"] in RL_SERIES for r in rows) else PREFERENCE_SERIES
    for name in kind:
        if not any(r["series"] == name for r in rows):
            rows = rows + [{**rows[0], "series": name}]
    frame = pd.DataFrame(rows).astype({"step": "int64", "reward": "float64", "series": "str"})
    return gr.update(value=frame, visible=True)


def _component(f: FormField, value, visible: bool = True):
    label, info = f.label, f.description or None
    if f.kind == "section":
        return gr.Checkbox(value=value, label=label, info=info, visible=visible)
    if f.kind == "checkbox":
        return gr.Checkbox(value=value, label=label, info=info, visible=visible)
    if f.kind == "dropdown":
        # (none) also for a required choice left unset (the schema then names it)
        choices = [str(c) for c in f.choices] + ([NONE_CHOICE] if f.optional or f.required else [])
        return gr.Dropdown(
            choices=choices, value=value, label=label, info=info, allow_custom_value=False, visible=visible
        )
    if f.kind in ("int", "float") and not f.optional:
        return gr.Number(
            value=value, label=label, info=info, precision=0 if f.kind == "int" else None, visible=visible
        )
    if f.kind in ("int", "float"):  # gr.Number cannot be empty: an optional number is a text box
        return gr.Textbox(
            value=value,
            label=label,
            info=info,
            placeholder="empty = not set",
            lines=1,
            max_lines=1,
            visible=visible,
        )
    placeholder = {
        "list": "comma-separated",
        "pair": "two numbers, comma-separated",
        "mapping": "{key: value}",
        "list_or_mapping": "comma-separated, or named sets {name: path, ...}",
        "str_or_list": "one value, or several comma-separated",
        "records": "YAML list, e.g. [{function: exact_match, weight: 1.0}, {function: my.py:score}]",
    }.get(f.kind)
    lines = 3 if f.kind == "records" else 1
    return gr.Textbox(
        value=value,
        label=label,
        info=info,
        placeholder=placeholder,
        lines=lines,
        max_lines=8,
        visible=visible,
    )


def _field_update(f: FormField, errors: dict[str, list[str]], raw: dict | None, value=None, with_value=False):
    """A field's help (or its errors) and whether it applies to the recipe (recipe_form.applies); a field
    with an error is always shown."""
    msgs = errors.get(f.key)
    info = (
        ("⚠ " + "; ".join(msgs)) if msgs else (f.description or "")
    )  # "" clears it (None would mean "unchanged")
    kw = {"value": value} if with_value else {}
    shown = bool(msgs) or applies(f, raw)
    return gr.update(info=info, elem_classes=["field-error"] if msgs else [], visible=shown, **kw)


def _recipe_error(text: str, ws: Workspace | None = None):
    """(raw dict, {key: [messages]}) of a YAML text: the schema's errors and, given the workspace, what it
    refuses (paths and code outside it), each on its form field; a YAML syntax error comes under the key ''."""
    try:
        raw = parse_yaml(text)
    except YamlError as e:
        return None, {"": [str(e)]}
    return raw, _problems(ws, raw, form_fields())


def _problems(ws: Workspace | None, raw: dict, fields: list[FormField]) -> dict[str, list[str]]:
    errors = field_errors(raw, fields)
    if ws is not None:
        for key, msgs in on_fields(recipe_refusals(ws, raw), fields).items():
            errors.setdefault(key, []).extend(msgs)
    return errors


def status_markdown(errors: dict[str, list[str]]) -> str:
    if not errors:
        return "✔ recipe is valid"
    return f"✘ {sum(map(len, errors.values()))} problem(s):\n{errors_text(errors)}"


def group_errors(groups: dict[str, list[FormField]], errors: dict[str, list[str]]) -> list[str]:
    """Errors that belong to no single field (a cross-field check, an unknown key) go to the form
    tab holding most of that section's fields; top-level ones show in the status only."""
    field_keys = {f.key for fs in groups.values() for f in fs}
    per_group = {g: {} for g in groups}
    for key, msgs in errors.items():
        if not key or key in field_keys:
            continue
        count = {g: sum(f.key.startswith(key + ".") for f in fs) for g, fs in groups.items()}
        best = max(count, key=count.get)
        if count[best]:
            per_group[best][key] = msgs
    return [errors_text(e) for e in per_group.values()]


def checked_recipe(ws: Workspace, text: str) -> tuple[dict, Path]:
    """The YAML as a launchable recipe and its run directory, or gr.Error naming the key / path."""
    raw, errors = _recipe_error(text)
    if errors:
        raise user_error(f"malformed recipe, not started:\n{errors_text(errors)}", duration=None)
    refused = recipe_refusals(ws, raw)
    if refused:
        raise user_error("refused: " + "; ".join(m for msgs in refused.values() for m in msgs), duration=None)
    return raw, ws.inside(raw["output_dir"], "output_dir", under="runs")


def launch_command(ws: Workspace, text: str, backend_name: str, n) -> str:
    """The shell command a start would run, or a comment saying why it cannot launch: the launch itself, or
    the trainer's refusal table (training.launch.refusals) for this recipe, backend and process count on
    this machine."""
    try:
        raw = parse_yaml(text)
        run_dir = ws.inside(str(raw.get("output_dir") or ""), "output_dir", under="runs")
        argv = launch_argv(ws, ws.rel(run_dir / RECIPE), backend_name, int(n or 1))
    except (YamlError, PathRefused, LaunchRefused) as e:
        return f"# cannot launch: {e}"
    if (why := backend_refusal(ws, raw, backend_name, int(n or 1))) is not None:
        return f"# the trainer would refuse this: {why}"
    return display_command(ws, argv)


def backend_refusal(ws: Workspace, raw: dict, backend_name: str, n: int) -> str | None:
    """What training.launch.refusals says of the recipe under the chosen backend and process count (None
    for a recipe the schema refuses: the form shows that)."""
    try:
        recipe = parse_recipe(raw)
    except UserError:
        return None
    if backend_name == PYTHON_BACKEND:
        chosen = Backend(name=PYTHON_BACKEND, file="", kind="single")
    else:  # its file alone (launch_argv, called first, has refused one that does not read)
        chosen = read_backend(ws.accelerate_configs()[backend_name])
    cuda = torch.cuda.is_available() and not chosen.cpu
    error = refusal(recipe, dataclasses.replace(chosen, num_processes=n), cuda)
    return None if error is None else str(error)


def data_preview(ws: Workspace, text: str):
    """(summary, records as HTML, length histogram) of the recipe's training data (app.preview)."""
    checked_recipe(ws, text)
    try:
        out = run_preview(ws, text)
    except RuntimeError as e:
        raise user_error(f"data preview: {e}") from None
    return summary_markdown(out), examples_html(out), lengths_figure(out)


def memory_plan(ws: Workspace, text: str, n, gib) -> str:
    """The planner's table for the recipe on `n` devices of `gib` GiB each (nothing outside the workspace is
    read: a recipe naming such a path is not planned)."""
    raw, errors = _recipe_error(text, ws)
    if errors:
        return f"Fix the recipe first:\n{errors_text(errors)}"
    try:
        configs = ws.accelerate_configs()
        kwargs = {"configs_dir": next(iter(configs.values())).parent} if configs else {}
        plans = estimate(
            parse_recipe(raw, "the form"), num_gpus=int(n or 1), gpu_memory_gib=float(gib or 80), **kwargs
        )
        return format_plan(plans)
    except Exception as e:  # the planner is another module: show its failure, do not crash the app
        return f"memory planner failed: {type(e).__name__}: {e}"


def build_app(ws: Workspace) -> gr.Blocks:
    """The page: a header and the Configure, Run and Chat tabs."""
    runs = RunManager(ws)
    ctx = AppContext(ws, runs, ChatModels(ws), JobQueue(ws, runs.run_dirs), grouped(form_fields()))
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


# ---------------------------------------------------------------------------------------- Configure


def configure_tab(ctx: AppContext) -> None:
    """A recipe file picker, the form (one sub-tab per group) beside the editable YAML, the backend,
    the launch command and the memory plan."""
    ws = ctx.ws
    recipes = ws.recipe_files()
    first_recipe = next(
        (r for r in recipes if r.endswith("pretrain_tiny.yaml")), recipes[0] if recipes else None
    )
    start_yaml = (ws.root / first_recipe).read_text() if first_recipe else to_yaml(STARTER)
    start_raw = parse_yaml(start_yaml)
    with gr.Row():
        recipe_pick = gr.Dropdown(
            recipes, value=first_recipe, label="Recipe file", allow_custom_value=True, scale=3
        )
        load_btn = gr.Button("Load", scale=1)
        save_name = gr.Textbox(label="Save as (recipes/NAME.yaml)", placeholder="my-run", scale=2)
        save_btn = gr.Button("Save", scale=1)
    file_msg = gr.Markdown(label="Recipe file status")
    with gr.Row():
        with gr.Column(scale=3):
            comps, group_md = [], []
            with gr.Tabs():
                for g, fs in ctx.groups.items():
                    with gr.Tab(g):
                        group_md.append(gr.Markdown(label=f"{g} errors", elem_classes=["section-errors"]))
                        with gr.Group():
                            comps += [
                                _component(f, v, applies(f, start_raw))
                                for f, v in zip(fs, dict_to_values(fs, start_raw))
                            ]
        with gr.Column(scale=2):
            ctx.yaml_box = gr.Code(
                start_yaml,
                language="yaml",
                label="Recipe YAML (editable)",
                interactive=True,
                lines=18,
                wrap_lines=True,
            )
            apply_btn = gr.Button("Apply YAML to the form")
            valid_md = gr.Markdown(status_markdown(_recipe_error(start_yaml, ws)[1]), label="Validation")
            with gr.Row():
                read = ws.backends()
                backends = [PYTHON_BACKEND, *((backend_label(n, b), n) for n, b in read.items())]
                ctx.backend = gr.Dropdown(
                    backends, value=PYTHON_BACKEND, label="Backend (accelerate config)", scale=3
                )
                ctx.nprocs = gr.Number(1, label="Processes", precision=0, minimum=1, scale=1)
            command = gr.Code(
                language="shell", label="Launch command", interactive=False, lines=2, wrap_lines=True
            )
    # the plan's table is wide: the page's whole width, below the form and the YAML
    with gr.Accordion("Memory plan", open=False):
        with gr.Row():
            gpu_mem = gr.Number(80, label="GPU memory per device (GiB)", minimum=1, scale=1)
            plan_btn = gr.Button("Estimate memory", scale=1)
        plan_md = gr.Markdown(label="Memory plan", elem_id="memory-plan")

    with gr.Accordion("Data preview", open=False):
        with gr.Row():
            preview_btn = gr.Button("Preview the training data", scale=1)
            preview_md = gr.Markdown(label="Data summary", elem_id="data-summary")
        preview_html = gr.HTML(
            label="First records, the tokens that carry the loss highlighted", elem_id="data-preview"
        )
        lengths_plot = gr.Plot(label="Token lengths of the records")
    preview_btn.click(
        lambda text: data_preview(ws, text),
        ctx.yaml_box,
        [preview_md, preview_html, lengths_plot],
        api_name="data_preview",
    )

    form_outputs = [valid_md, *group_md, *comps]
    yaml_to_form = _wire_form(ctx, comps, form_outputs, apply_btn)
    _wire_recipe_files(ctx, yaml_to_form, form_outputs, recipe_pick, load_btn, save_name, save_btn, file_msg)
    _wire_command_and_plan(ctx, command, gpu_mem, plan_btn, plan_md)


def _wire_command_and_plan(ctx: AppContext, command, gpu_mem, plan_btn, plan_md) -> None:
    """The launch command follows the YAML, backend and process count; the plan button plans the YAML."""
    ws = ctx.ws
    command_io = dict(
        fn=lambda text, backend_name, n: launch_command(ws, text, backend_name, n),
        inputs=[ctx.yaml_box, ctx.backend, ctx.nprocs],
        outputs=command,
        show_progress="hidden",
    )
    ctx.yaml_box.change(**command_io, api_name="launch_command")
    # picking a backend proposes its process count (a mesh file's is fixed by its parallelism_config)
    ctx.backend.change(
        lambda name: default_processes(ws.backends().get(name)),
        ctx.backend,
        ctx.nprocs,
        api_visibility="private",
        show_progress="hidden",
    )
    for trigger in (ctx.backend.change, ctx.nprocs.change, ctx.demo.load):
        trigger(**command_io, api_visibility="private")
    plan_btn.click(
        lambda text, n, gib: memory_plan(ws, text, n, gib),
        [ctx.yaml_box, ctx.nprocs, gpu_mem],
        plan_md,
        api_name="memory_plan",
    )


def _wire_form(ctx: AppContext, comps: list, form_outputs: list, apply_btn: gr.Button):
    """Form -> YAML on every edit, YAML -> form on Apply (and as the YAML is typed); returns yaml_to_form."""
    ordered = ctx.fields

    def form_to_yaml(text, *values):
        """The YAML as the user wrote it, with the changed fields applied in place (recipe_form.edit_yaml)."""
        raw = values_to_dict(ordered, list(values))
        errors = _problems(ctx.ws, raw, ordered)
        return [
            edit_yaml(text, ordered, list(values)),
            status_markdown(errors),
            *group_errors(ctx.groups, errors),
            *[_field_update(f, errors, raw) for f in ordered],
        ]

    def yaml_to_form(text):
        raw, errors = _recipe_error(text, ctx.ws)
        values = dict_to_values(ordered, raw) if raw is not None else [gr.update()] * len(ordered)
        updates = [
            _field_update(f, errors, raw, v, with_value=raw is not None) for f, v in zip(ordered, values)
        ]
        return [status_markdown(errors), *group_errors(ctx.groups, errors), *updates]

    gr.on(
        [c.input for c in comps],
        form_to_yaml,
        inputs=[ctx.yaml_box, *comps],
        outputs=[ctx.yaml_box, *form_outputs],
        api_name="form_to_yaml",
        trigger_mode="always_last",
        show_progress="hidden",
    )
    apply_btn.click(yaml_to_form, ctx.yaml_box, form_outputs, api_name="yaml_to_form")
    ctx.yaml_box.input(
        yaml_to_form,
        ctx.yaml_box,
        form_outputs,
        api_visibility="private",
        trigger_mode="always_last",
        show_progress="hidden",
    )
    return yaml_to_form


def _wire_recipe_files(
    ctx: AppContext, yaml_to_form, form_outputs: list, recipe_pick, load_btn, save_name, save_btn, file_msg
) -> None:
    """Load a recipe file of the workspace into the YAML and the form; save the YAML under recipes/."""
    ws = ctx.ws

    def load_recipe(path):
        try:
            p = ws.inside(path or "", "recipe file")
        except PathRefused as e:
            raise user_error(str(e)) from None
        if p.suffix not in (".yaml", ".yml") or not p.is_file():
            raise user_error(f"recipe file: {path} is not a .yaml file in the workspace")
        text = p.read_text()
        return [text, f"loaded `{ws.rel(p)}`", *yaml_to_form(text)]  # YAML and form in one update

    def save_recipe(name, text):
        try:
            name = check_name((name or "").removesuffix(".yaml"), "save as")
        except PathRefused as e:
            raise user_error(str(e)) from None
        raw, errors = _recipe_error(text, ws)
        if errors:
            raise user_error(f"not saved: the recipe has problems:\n{errors_text(errors)}")
        ws.recipes.mkdir(parents=True, exist_ok=True)
        path = ws.recipes / f"{name}.yaml"
        path.write_text(text)
        return f"saved `{ws.rel(path)}`", gr.update(choices=ws.recipe_files(), value=ws.rel(path))

    load_btn.click(load_recipe, recipe_pick, [ctx.yaml_box, file_msg, *form_outputs], api_name="load_recipe")
    save_btn.click(save_recipe, [save_name, ctx.yaml_box], [file_msg, recipe_pick], api_name="save_recipe")


# ---------------------------------------------------------------------------------------- Run


def run_tab(ctx: AppContext) -> None:
    """Start the Configure tab's recipe, stop a run, and watch the chosen one (progress, loss, log, table)."""
    with gr.Row():
        start_btn = gr.Button("Start run (recipe from Configure)", variant="primary")
        stop_btn = gr.Button("Stop (saves a checkpoint)", variant="stop")
        run_pick = gr.Dropdown([], label="Run", allow_custom_value=True)
    run_msg = gr.Markdown(label="Run message")
    refresh_out = [*run_view(), stop_btn]  # Stop is offered only while the chosen run is going
    timer = gr.Timer(REFRESH_S)
    start_run, stop_run, refresh, reattach = run_handlers(ctx)
    start_btn.click(
        start_run,
        [ctx.yaml_box, ctx.backend, ctx.nprocs],
        [run_msg, run_pick, ctx.tabs],
        api_name="start_run",
    )
    stop_btn.click(stop_run, run_pick, run_msg, api_name="stop_run")
    timer.tick(refresh, run_pick, refresh_out, api_visibility="private", show_progress="hidden")
    run_pick.change(refresh, run_pick, refresh_out, api_visibility="private", show_progress="hidden")
    ctx.demo.load(reattach, None, run_pick, api_visibility="private")
    # a run started since the page loaded (from the command line too) is offered when the picker opens
    run_pick.focus(lambda: gr.update(choices=run_names(ctx.runs)), None, run_pick, api_visibility="private")
    run_status_api(ctx.runs)
    compare_section(ctx)


def run_view() -> list:
    """What the Run tab shows of the chosen run: [progress, trackers and evaluation, loss plot, reward
    plot, log tail, runs table, latest agent episodes] (refreshed together)."""
    progress = gr.Markdown("No run yet.", label="Progress", elem_id="progress")
    outputs_md = gr.Markdown("", label="Trackers and evaluation", elem_id="run-outputs")
    loss_plot = gr.LinePlot(
        None,
        x="step",
        y="loss",
        color="series",
        title="Loss",
        height=300,
        color_map={"train": "#1f77b4", "eval": "#ff7f0e"},
    )
    reward_plot = gr.LinePlot(
        None,
        x="step",
        y="reward",
        color="series",
        title="Rewards (preference tuning: chosen and rejected completions; online RL: mean reward)",
        height=300,
        visible=False,
        color_map=dict(
            zip(REWARD_SERIES, ("#2ca02c", "#d62728", "#98df8a", "#ff9896", "#9467bd", "#c5b0d5"))
        ),
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
    return [progress, outputs_md, loss_plot, reward_plot, log_box, runs_table, episodes]


def run_handlers(ctx: AppContext):
    """(start_run, stop_run, refresh, reattach): what the Run tab's buttons, timer and page load call."""
    runs = ctx.runs

    def start_run(text, backend_name, n):
        raw, run_dir = checked_recipe(ctx.ws, text)
        try:
            rec = runs.start(text, run_dir, backend_name, int(n or 1))
        except (LaunchRefused, PathRefused) as e:
            raise user_error(f"not started: {e}", duration=None) from None
        return (
            f"started **{rec.name}** (pid {rec.pid}): `{' '.join(rec.argv)}`",
            gr.update(choices=run_names(runs), value=rec.name),
            gr.Tabs(selected="run"),
        )

    def stop_run(name):
        try:
            return runs.stop(name)
        except LaunchRefused as e:
            raise user_error(str(e)) from None

    def refresh(name):
        table = runs.table()
        found = runs.find(name) if name else None
        if found is None:
            hidden = gr.update(value=None, visible=False)
            return "No run selected.", "", None, hidden, "", table, hidden, gr.update(interactive=False)
        v = runs.view(name)
        samples = runs.latest_samples(name)
        parts = (tracker_markdown(ctx.ws, found.dir), eval_markdown(found.dir), samples_markdown(samples))
        extra = "\n\n".join(t for t in parts if t)
        log_tail = runs.log_tail(name, LOG_LINES)
        loss = _loss_frame(loss_rows(v.rows))
        stop = gr.update(interactive=v.state == "running")
        shown = episode_messages(samples)
        episodes = gr.update(value=shown, visible=bool(shown))
        return (
            progress_markdown(v),
            extra,
            loss,
            _reward_frame(reward_rows(v.rows)),
            log_tail,
            table,
            episodes,
            stop,
        )

    def reattach():
        """On page load: select the run still going (or the newest one)."""
        active = runs.active()
        names = run_names(runs)
        return gr.update(choices=names, value=active.name if active else (names[0] if names else None))

    return start_run, stop_run, refresh, reattach


def run_status_api(runs) -> None:
    """The `run_status` API endpoint (for scripts and tests)."""

    @gr.api(api_name="run_status")
    def run_status(name: str) -> dict:
        """A run's state, progress and metrics (for scripts and tests)."""
        try:
            v = runs.view(name)
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
            "samples": runs.latest_samples(
                name
            ),  # online RL: the last step's prompt/completion/reward samples
            "message": v.message,
            "metrics_rows": len(v.rows),
            "active": getattr(runs.active(), "name", None),
        }
