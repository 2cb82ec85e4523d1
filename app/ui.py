"""The Gradio Blocks: Configure, Run and Chat tabs wired to the workspace, run manager and chat models.

Named API endpoints (see the app's "Use via API" page or `gradio_client.Client.view_api()`):
form_to_yaml, yaml_to_form, load_recipe, save_recipe, launch_command, memory_plan, start_run,
stop_run, run_status (structured), load_model, unload_models, chat.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import pandas as pd

from app.chat_models import ChatModels
from app.recipe_form import (
    NONE_CHOICE, FormField, YamlError, dict_to_values, errors_text, field_errors, form_fields, grouped, parse_yaml,
    to_yaml, values_to_dict,
)
from app.runs import PYTHON_BACKEND, LaunchRefused, RunManager, display_command, launch_argv, progress_markdown
from app.workspace import PathRefused, Workspace, check_name, recipe_paths_outside

CSS = """
.field-error .info, .field-error span[data-testid='block-info'] + div { color: #c62828 !important; }
.field-error { outline: 2px solid #e53935; border-radius: 6px; }
.section-errors p { color: #c62828; }
#status-ok p { color: #2e7d32; }
"""
REFRESH_S = 2.0
LOG_LINES = 15
STARTER = {  # the form's starting point when the workspace has no recipe: a tiny model from scratch
    "output_dir": "runs/my-run",
    "model": {"tokenizer": "bundled:smollm2-135m-instruct", "from_scratch": {"hidden_size": 128, "num_hidden_layers": 2}},
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


def _component(f: FormField, value):
    label, info = f.key, f.description or None
    if f.kind == "section":
        return gr.Checkbox(value=value, label=f"{f.key} (enabled)", info=info)
    if f.kind == "checkbox":
        return gr.Checkbox(value=value, label=label, info=info)
    if f.kind == "dropdown":
        choices = [str(c) for c in f.choices] + ([NONE_CHOICE] if f.optional else [])
        return gr.Dropdown(choices=choices, value=value, label=label, info=info, allow_custom_value=False)
    if f.kind in ("int", "float") and not f.optional:
        return gr.Number(value=value, label=label, info=info, precision=0 if f.kind == "int" else None)
    if f.kind in ("int", "float"):  # gr.Number cannot be empty: an optional number is a text box
        return gr.Textbox(value=value, label=label, info=info, placeholder="empty = not set", lines=1, max_lines=1)
    placeholder = {"list": "comma-separated", "pair": "two numbers, comma-separated", "mapping": "{key: value}",
                   "str_or_list": "one value, or several comma-separated"}.get(f.kind)
    return gr.Textbox(value=value, label=label, info=info, placeholder=placeholder, lines=1, max_lines=3)


def _field_update(f: FormField, errors: dict[str, list[str]], value=None, with_value=False):
    msgs = errors.get(f.key)
    info = ("⚠ " + "; ".join(msgs)) if msgs else (f.description or "")  # "" clears it (None would mean "unchanged")
    kw = {"value": value} if with_value else {}
    return gr.update(info=info, elem_classes=["field-error"] if msgs else [], **kw)


def _recipe_error(text: str):
    """(raw dict, {key: [messages]}) of a YAML text; a YAML syntax error comes back under the key ''."""
    fields = form_fields()
    try:
        raw = parse_yaml(text)
    except YamlError as e:
        return None, {"": [str(e)]}
    return raw, field_errors(raw, fields)


def _text(content) -> str:
    """A Chatbot message's content as plain text (gradio 6 sends a list of typed parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(_text(c) for c in content)
    return str(content)


def build_app(ws: Workspace) -> gr.Blocks:
    runs = RunManager(ws)
    chats = ChatModels(ws)
    fields = form_fields()
    groups = grouped(fields)
    backends = [PYTHON_BACKEND, *ws.accelerate_configs()]
    recipes = ws.recipe_files()
    first_recipe = next((r for r in recipes if r.endswith("pretrain_tiny.yaml")), recipes[0] if recipes else None)
    start_raw = parse_yaml((ws.root / first_recipe).read_text()) if first_recipe else STARTER
    start_yaml = to_yaml(start_raw)

    def status_markdown(errors: dict[str, list[str]]) -> str:
        if not errors:
            return "✔ recipe is valid"
        return f"✘ {sum(map(len, errors.values()))} problem(s):\n{errors_text(errors)}"

    field_keys = {f.key for f in fields}

    def group_errors(errors: dict[str, list[str]]) -> list[str]:
        """Errors that belong to no single field (a cross-field check, an unknown key) go to the form
        tab holding most of that section's fields; top-level ones show in the status only."""
        per_group = {g: {} for g in groups}
        for key, msgs in errors.items():
            if not key or key in field_keys:
                continue
            count = {g: sum(f.key.startswith(key + ".") for f in fs) for g, fs in groups.items()}
            best = max(count, key=count.get)
            if count[best]:
                per_group[best][key] = msgs
        return [errors_text(e) for e in per_group.values()]

    with gr.Blocks(title="llm-forge", analytics_enabled=False) as demo:
        gr.Markdown(f"# llm-forge\nWorkspace: `{ws.root}` — runs in `runs/`, recipes in `recipes/`, data in `data/`.")
        with gr.Tabs() as tabs:
            # ------------------------------------------------------------------ Configure
            with gr.Tab("Configure", id="configure"):
                with gr.Row():
                    recipe_pick = gr.Dropdown(recipes, value=first_recipe, label="Recipe file", allow_custom_value=True, scale=3)
                    load_btn = gr.Button("Load", scale=1)
                    save_name = gr.Textbox(label="Save as (recipes/NAME.yaml)", placeholder="my-run", scale=2)
                    save_btn = gr.Button("Save", scale=1)
                file_msg = gr.Markdown(label="Recipe file status")
                with gr.Row():
                    with gr.Column(scale=3):
                        comps, group_md = [], []
                        with gr.Tabs():
                            for g, fs in groups.items():
                                with gr.Tab(g):
                                    group_md.append(gr.Markdown(label=f"{g} errors", elem_classes=["section-errors"]))
                                    values = dict_to_values(fs, start_raw)
                                    with gr.Group():
                                        for f, v in zip(fs, values):
                                            comps.append(_component(f, v))
                        ordered = [f for fs in groups.values() for f in fs]
                    with gr.Column(scale=2):
                        yaml_box = gr.Code(start_yaml, language="yaml", label="Recipe YAML (editable)", interactive=True, lines=18,
                                           wrap_lines=True)
                        apply_btn = gr.Button("Apply YAML to the form")
                        valid_md = gr.Markdown(status_markdown(_recipe_error(start_yaml)[1]), label="Validation")
                        with gr.Row():
                            backend = gr.Dropdown(backends, value=PYTHON_BACKEND, label="Backend (accelerate config)", scale=3)
                            nprocs = gr.Number(1, label="Processes", precision=0, minimum=1, scale=1)
                        command = gr.Code(language="shell", label="Launch command", interactive=False, lines=2, wrap_lines=True)
                        with gr.Accordion("Memory plan", open=False):
                            gpu_mem = gr.Number(80, label="GPU memory per device (GiB)", minimum=1)
                            plan_btn = gr.Button("Estimate memory")
                            plan_md = gr.Markdown(label="Memory plan")

            # ------------------------------------------------------------------ Run
            with gr.Tab("Run", id="run"):
                with gr.Row():
                    start_btn = gr.Button("Start run (recipe from Configure)", variant="primary")
                    stop_btn = gr.Button("Stop (saves a checkpoint)", variant="stop")
                    run_pick = gr.Dropdown([], label="Run", allow_custom_value=True)
                run_msg = gr.Markdown(label="Run message")
                progress = gr.Markdown("No run yet.", label="Progress", elem_id="progress")
                loss_plot = gr.LinePlot(None, x="step", y="loss", color="series", title="Loss", height=300,
                                        color_map={"train": "#1f77b4", "eval": "#ff7f0e"})
                log_box = gr.Textbox(label="Log (train.log, last lines)", lines=LOG_LINES, max_lines=LOG_LINES, autoscroll=True,
                                     interactive=False)
                runs_table = gr.Dataframe(headers=["run", "state", "step", "loss", "backend", "started"], label="Runs", interactive=False)
                timer = gr.Timer(REFRESH_S)

            # ------------------------------------------------------------------ Chat
            with gr.Tab("Chat", id="chat"):
                sources = ws.chat_sources()
                with gr.Row():
                    src_a = gr.Dropdown(sources, value=sources[0] if sources else None, label="Model A", allow_custom_value=True, scale=3)
                    load_a = gr.Button("Load A", scale=1)
                    src_b = gr.Dropdown(sources, value=None, label="Model B (optional: compare side by side)", allow_custom_value=True, scale=3)
                    load_b = gr.Button("Load B", scale=1)
                    unload_btn = gr.Button("Unload all", scale=1)
                chat_status = gr.Markdown(chats.describe(), label="Chat status")
                with gr.Row():
                    bot_a = gr.Chatbot(label="A", height=360)
                    bot_b = gr.Chatbot(label="B", height=360)
                with gr.Row():
                    system = gr.Textbox(label="System prompt", placeholder="You are a helpful assistant.", scale=3)
                    temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                    top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p")
                    max_new = gr.Slider(1, 1024, value=64, step=1, label="Max new tokens")
                with gr.Row():
                    message = gr.Textbox(label="Message", placeholder="Type and press Enter", scale=5)
                    send = gr.Button("Send", variant="primary", scale=1)
                    clear = gr.Button("Clear", scale=1)

        # ====================================================================== Configure logic

        def form_to_yaml(*values):
            raw = values_to_dict(ordered, list(values))
            errors = field_errors(raw, fields)
            return [to_yaml(raw), status_markdown(errors), *group_errors(errors), *[_field_update(f, errors) for f in ordered]]

        def yaml_to_form(text):
            raw, errors = _recipe_error(text)
            values = dict_to_values(ordered, raw) if raw is not None else [gr.update()] * len(ordered)
            updates = [_field_update(f, errors, v, with_value=raw is not None) for f, v in zip(ordered, values)]
            return [status_markdown(errors), *group_errors(errors), *updates]

        form_outputs = [valid_md, *group_md, *comps]
        gr.on([c.input for c in comps], form_to_yaml, inputs=comps, outputs=[yaml_box, *form_outputs],
              api_name="form_to_yaml", trigger_mode="always_last", show_progress="hidden")
        apply_btn.click(yaml_to_form, yaml_box, form_outputs, api_name="yaml_to_form")
        yaml_box.input(yaml_to_form, yaml_box, form_outputs, api_visibility="private", trigger_mode="always_last",
                       show_progress="hidden")

        def load_recipe(path):
            try:
                p = ws.inside(path or "", "recipe file")
            except PathRefused as e:
                raise gr.Error(str(e)) from None
            if p.suffix not in (".yaml", ".yml") or not p.is_file():
                raise gr.Error(f"recipe file: {path} is not a .yaml file in the workspace")
            text = p.read_text()
            return [text, f"loaded `{ws.rel(p)}`", *yaml_to_form(text)]  # YAML and form in one update

        def save_recipe(name, text):
            try:
                name = check_name((name or "").removesuffix(".yaml"), "save as")
            except PathRefused as e:
                raise gr.Error(str(e)) from None
            raw, errors = _recipe_error(text)
            if errors:
                raise gr.Error(f"not saved: the recipe has problems:\n{errors_text(errors)}")
            ws.recipes.mkdir(parents=True, exist_ok=True)
            path = ws.recipes / f"{name}.yaml"
            path.write_text(text)
            return f"saved `{ws.rel(path)}`", gr.update(choices=ws.recipe_files(), value=ws.rel(path))

        load_btn.click(load_recipe, recipe_pick, [yaml_box, file_msg, *form_outputs], api_name="load_recipe")
        save_btn.click(save_recipe, [save_name, yaml_box], [file_msg, recipe_pick], api_name="save_recipe")

        def checked_recipe(text) -> tuple[dict, Path]:
            """The YAML as a launchable recipe, or gr.Error naming the key / path."""
            raw, errors = _recipe_error(text)
            if errors:
                raise gr.Error(f"malformed recipe, not started:\n{errors_text(errors)}", duration=None)
            outside = recipe_paths_outside(ws, raw)
            if outside:
                raise gr.Error("refused: " + "; ".join(outside), duration=None)
            return raw, ws.inside(raw["output_dir"], "output_dir", under="runs")

        def launch_command(text, backend_name, n):
            try:
                raw = parse_yaml(text)
                run_dir = ws.inside(str(raw.get("output_dir") or ""), "output_dir", under="runs")
                argv = launch_argv(ws, ws.rel(run_dir / "recipe.yaml"), backend_name, int(n or 1))
            except (YamlError, PathRefused, LaunchRefused) as e:
                return f"# cannot launch: {e}"
            return display_command(ws, argv)

        command_io = dict(fn=launch_command, inputs=[yaml_box, backend, nprocs], outputs=command, show_progress="hidden")
        yaml_box.change(**command_io, api_name="launch_command")
        for trigger in (backend.change, nprocs.change, demo.load):
            trigger(**command_io, api_visibility="private")

        def memory_plan(text, n, gib):
            raw, errors = _recipe_error(text)
            if errors:
                return f"Fix the recipe first:\n{errors_text(errors)}"
            try:
                from training import plan
            except ImportError:
                return "_The memory planner (`training/plan.py`) is not available in this version._"
            from training.config import parse_recipe

            try:
                configs = ws.accelerate_configs()
                kwargs = {"configs_dir": next(iter(configs.values())).parent} if configs else {}
                plans = plan.estimate(parse_recipe(raw, "the form"), num_gpus=int(n or 1), gpu_memory_gib=float(gib or 80), **kwargs)
                return plan.format_plan(plans)
            except Exception as e:  # the planner is another module: show its failure, do not crash the app
                return f"memory planner failed: {type(e).__name__}: {e}"

        plan_btn.click(memory_plan, [yaml_box, nprocs, gpu_mem], plan_md, api_name="memory_plan")

        # ====================================================================== Run logic

        def run_names():
            return [r.name for r in sorted(runs.records(), key=lambda r: r.started, reverse=True)]

        def start_run(text, backend_name, n):
            raw, run_dir = checked_recipe(text)
            try:
                rec = runs.start(text, run_dir, backend_name, int(n or 1))
            except (LaunchRefused, PathRefused) as e:
                raise gr.Error(f"not started: {e}", duration=None) from None
            return (f"started **{rec.name}** (pid {rec.pid}): `{' '.join(rec.argv)}`",
                    gr.update(choices=run_names(), value=rec.name), gr.Tabs(selected="run"))

        start_btn.click(start_run, [yaml_box, backend, nprocs], [run_msg, run_pick, tabs], api_name="start_run")

        def stop_run(name):
            try:
                return runs.stop(name)
            except LaunchRefused as e:
                raise gr.Error(str(e)) from None

        stop_btn.click(stop_run, run_pick, run_msg, api_name="stop_run")

        def refresh(name):
            table = runs.table()
            if not name or runs.get(name) is None:
                return "No run selected.", None, "", table
            v = runs.view(name)
            rows = [{"step": r["step"], "loss": r["loss"], "series": "train"} for r in v.rows if r.get("loss") is not None]
            rows += [{"step": r["step"], "loss": r["eval_loss"], "series": "eval"} for r in v.rows if r.get("eval_loss") is not None]
            return progress_markdown(v), _loss_frame(rows), runs.log_tail(name, LOG_LINES), table

        refresh_out = [progress, loss_plot, log_box, runs_table]
        timer.tick(refresh, run_pick, refresh_out, api_visibility="private", show_progress="hidden")
        run_pick.change(refresh, run_pick, refresh_out, api_visibility="private", show_progress="hidden")

        def reattach():
            """On page load: select the run still going (or the newest one)."""
            active = runs.active()
            names = run_names()
            return gr.update(choices=names, value=active.name if active else (names[0] if names else None))

        demo.load(reattach, None, run_pick, api_visibility="private")

        @gr.api(api_name="run_status")
        def run_status(name: str) -> dict:
            """A run's state, progress and metrics (for scripts and tests)."""
            try:
                v = runs.view(name)
            except LaunchRefused as e:
                raise gr.Error(str(e)) from None
            return {"name": v.name, "state": v.state, "step": v.step, "total_steps": v.total_steps, "elapsed_s": v.elapsed_s,
                    "remaining_s": v.remaining_s, "loss": v.loss, "eval_loss": v.eval_loss, "message": v.message,
                    "metrics_rows": len(v.rows), "active": getattr(runs.active(), "name", None)}

        # ====================================================================== Chat logic

        def load_model(slot, source):
            try:
                msg = chats.load(slot, source)
            except PathRefused as e:
                raise gr.Error(f"refused: {e}") from None
            except Exception as e:  # UserError from training.chat and load failures: show the message
                raise gr.Error(f"could not load {source}: {e}") from None
            return msg + "  \n" + chats.describe()

        slot_a, slot_b = gr.State("A"), gr.State("B")
        load_a.click(load_model, [slot_a, src_a], chat_status, api_name="load_model")
        load_b.click(load_model, [slot_b, src_b], chat_status, api_visibility="private")
        unload_btn.click(lambda: chats.unload() + "  \n" + chats.describe(), None, chat_status, api_name="unload_models")

        def refresh_sources():
            s = ws.chat_sources()
            return gr.update(choices=s), gr.update(choices=s)

        demo.load(refresh_sources, None, [src_a, src_b], api_visibility="private")
        tabs.change(refresh_sources, None, [src_a, src_b], api_visibility="private")

        def chat(msg, hist_a, hist_b, system_prompt, temp, p, n):
            msg = (msg or "").strip()
            if not msg:
                raise gr.Error("message: type something first")
            if chats.slots["A"] is None and chats.slots["B"] is None:
                raise gr.Error("no model loaded: pick one and press Load A")
            hist_a, hist_b = list(hist_a or []), list(hist_b or [])
            prefix = [{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []
            for slot, hist in (("A", hist_a), ("B", hist_b)):
                if chats.slots[slot] is None:
                    continue
                history = prefix + [{"role": m["role"], "content": _text(m["content"])} for m in hist] + [{"role": "user", "content": msg}]
                hist += [{"role": "user", "content": msg}, {"role": "assistant", "content": ""}]
                yield "", hist_a, hist_b  # the message shows at once; the reply streams in below it
                for text in chats.stream(slot, history, n, temp, p):
                    if text != hist[-1]["content"]:
                        hist[-1] = {"role": "assistant", "content": text}
                        yield "", hist_a, hist_b
            yield "", hist_a, hist_b

        chat_in = [message, bot_a, bot_b, system, temperature, top_p, max_new]
        send.click(chat, chat_in, [message, bot_a, bot_b], api_name="chat")
        message.submit(chat, chat_in, [message, bot_a, bot_b], api_visibility="private")
        clear.click(lambda: ([], []), None, [bot_a, bot_b], api_visibility="private")
    demo.runs, demo.chats = runs, chats  # for the entry point and tests
    return demo
