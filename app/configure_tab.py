"""The Configure tab: a recipe file picker, the form generated from the schema (app/recipe_form.py) beside
the editable YAML, a search over the form's fields, the backend and process count with the launch command
(or the trainer's refusal), the memory plan and the data preview.

Each form tab shows its common fields first and the rest behind a "More settings" fold; a field shows only
where it applies to the recipe (recipe_form.applies) and, while a search is typed, only where it matches.
A field with an error is always shown, and its fold opens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gradio as gr
import torch

from app.context import AppContext, user_error
from app.preview import (
    check_data,
    examples_html,
    known_data_problems,
    lengths_figure,
    run_preview,
    summary_markdown,
)
from app.recipe_form import (
    NONE_CHOICE,
    OBJECTIVE_GROUP,
    OBJECTIVES,
    FormField,
    YamlError,
    applies,
    dict_to_values,
    edit_yaml,
    errors_text,
    field_errors,
    form_fields,
    objective_of,
    on_fields,
    parse_yaml,
    to_yaml,
    values_to_dict,
    with_objective,
)
from app.runs import (
    PYTHON_BACKEND,
    RECIPE,
    LaunchRefused,
    backend_label,
    default_processes,
    display_command,
    launch_argv,
)
from app.workspace import PathRefused, Workspace, check_name, recipe_refusals
from training.config import parse_recipe
from training.core.errors import UserError
from training.launch.backend import Backend, read_backend
from training.launch.refusals import refusal
from training.planning.memory import estimate
from training.planning.report import format_plan

STARTER = {  # the form's starting point when the workspace has no recipe: a tiny model from scratch
    "output_dir": "runs/my-run",
    "model": {
        "tokenizer": "bundled:smollm2-135m-instruct",
        "from_scratch": {"hidden_size": 128, "num_hidden_layers": 2},
    },
    "data": {"train": ["data/tiny_stories.txt"], "format": "text", "max_length": 128},
    "train": {"max_steps": 100, "lr": 0.003},
}


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


def _shown(f: FormField, errors: dict[str, list[str]], raw: dict | None, query: str = "") -> bool:
    """Whether the form shows `f`: it has an error, or it applies to the recipe and matches the search."""
    return bool(errors.get(f.key)) or (applies(f, raw) and f.matches(query))


def _help(f: FormField, errors: dict[str, list[str]]) -> dict:
    """A field's line under its label: its errors (and the red frame), else its help from the schema ("" clears
    an error: None would mean "unchanged")."""
    msgs = errors.get(f.key)
    info = ("⚠ " + "; ".join(msgs)) if msgs else (f.description or "")
    return {"info": info, "elem_classes": ["field-error"] if msgs else []}


def _folds(groups: dict[str, list[FormField]], visible: dict[str, bool], errors: dict, query: str) -> list:
    """Each tab's "More settings" fold: (shown, opened): shown while one of its fields is (`visible`: each
    field's _shown), opened for an error or a search hit inside it (never closed here: a fold the user opened
    stays open)."""
    out = []
    for fs in groups.values():
        shown = [f for f in fs if not f.common and visible[f.key]]
        out.append((bool(shown), any(f.key in errors for f in shown) or bool(query.strip() and shown)))
    return out


def _form_updates(
    groups: dict[str, list[FormField]], raw, errors, query: str = "", values=None, seen=None
) -> list:
    """[status, each tab's errors, each tab's fold, each field, what is shown] for a recipe (`raw`, None for a
    YAML that does not parse) and its `errors`; `values` (in the form's field order) are set too when given.

    `seen` is what the page shows (the last of these lists, kept per page in a gr.State; None: unknown): each
    field's visibility and errors, each fold's visibility. Only what changes is sent: every update of a field
    redraws it, and on a page where a method switch has shown and hidden fields, redrawing them all made each
    keystroke take about a second."""
    fields = [f for fs in groups.values() for f in fs]
    visible = {f.key: _shown(f, errors, raw, query) for f in fields}
    folds = _folds(groups, visible, errors, query)
    now = [[visible[f.key], errors.get(f.key)] for f in fields] + [[v, None] for v, _ in folds]
    known = seen is not None and len(seen) == len(now)
    fold_out = [
        gr.update(
            **({} if known and seen[len(fields) + j] == now[len(fields) + j] else {"visible": shown}),
            **({"open": True} if opened else {}),
        )
        for j, (shown, opened) in enumerate(folds)
    ]
    fields_out = []
    for i, f in enumerate(fields):
        kw = {} if values is None else {"value": values[i]}
        if not known or seen[i][0] != now[i][0]:
            kw["visible"] = now[i][0]
        if not known or seen[i][1] != now[i][1]:
            kw.update(_help(f, errors))
        fields_out.append(gr.update(**kw))
    return [status_markdown(errors), *group_errors(groups, errors), *fold_out, *fields_out, now]


def _error_updates(groups: dict[str, list[FormField]], errors: dict[str, list[str]], seen) -> list:
    """The same outputs as _form_updates, but only the errors: what is shown is left as it is (a search typed
    meanwhile), but for a field with an error, which is shown with its fold opened."""
    fields = [f for fs in groups.values() for f in fs]
    known = seen is not None and len(seen) == len(fields) + len(groups)
    now = [list(x) for x in seen] if known else None
    folds = [any(not f.common and f.key in errors for f in fs) for fs in groups.values()]
    fields_out = []
    for i, f in enumerate(fields):
        kw = {"visible": True} if f.key in errors else {}
        if not known or now[i][1] != errors.get(f.key):
            kw.update(_help(f, errors))
        if known:
            now[i] = [now[i][0] or f.key in errors, errors.get(f.key)]
        fields_out.append(gr.update(**kw))
    if known:
        for j, opened in enumerate(folds):
            now[len(fields) + j][0] = now[len(fields) + j][0] or opened
    return [
        status_markdown(errors),
        *group_errors(groups, errors),
        *[gr.update(open=True, visible=True) if opened else gr.update() for opened in folds],
        *fields_out,
        now,
    ]


def search_markdown(fields: list[FormField], raw: dict | None, query: str) -> str:
    """What a search of the form's fields found: the ones this recipe uses (and their tab), then a count of
    the ones it would use with another method or section switched on."""
    if not query.strip():
        return ""
    hits = [f for f in fields if f.matches(query)]
    if not hits:
        return f"No setting matches “{query.strip()}”."
    used = [f for f in hits if applies(f, raw)]
    text = f"{len(used)} setting(s) match: " + ", ".join(f"`{f.key}` ({f.group})" for f in used[:12])
    if len(used) > 12:
        text += ", …"
    if not used:
        text = f"No setting this recipe uses matches “{query.strip()}”."
    if unused := [f for f in hits if not applies(f, raw)]:
        names = ", ".join(f"`{f.key}`" for f in unused[:8]) + (", …" if len(unused) > 8 else "")
        text += f"\n\n{len(unused)} more that this recipe does not use (another method, or a section off): {names}"
    return text


def _recipe_error(text: str, ws: Workspace | None = None):
    """(raw dict, {key: [messages]}) of a YAML text: the schema's errors and, given the workspace, what it
    refuses (paths and code outside it), each on its form field; a YAML syntax error comes under the key ''."""
    try:
        raw = parse_yaml(text)
    except YamlError as e:
        return None, {"": [str(e)]}
    return raw, _problems(ws, raw, form_fields())


def _problems(ws: Workspace | None, raw: dict, fields: list[FormField]) -> dict[str, list[str]]:
    """The schema's errors and, given the workspace, what it refuses and what the data check found."""
    errors = field_errors(raw, fields)
    if ws is not None:
        for key, msgs in on_fields(recipe_refusals(ws, raw), fields).items():
            errors.setdefault(key, []).extend(msgs)
        if not any(k.split(".")[0] in ("data", "model") for k in errors):  # the check read these sections
            for key, msgs in on_fields(known_data_problems(ws, raw), fields).items():
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
    refused = recipe_refusals(ws, raw) or known_data_problems(ws, raw)
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
    file_msg = gr.Markdown(label="Recipe file status", elem_id="recipe-file-status")
    with gr.Row():
        with gr.Column(scale=3):
            form = _form_column(ctx, start_raw)
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
            valid_md = gr.Markdown(
                status_markdown(_recipe_error(start_yaml, ws)[1]), label="Validation", elem_id="validation"
            )
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

    _data_preview_section(ctx)

    form_outputs = [valid_md, *form.group_md, *form.folds, *form.comps, form.seen]
    yaml_to_form = _wire_form(ctx, form, form_outputs, apply_btn)
    _wire_search(ctx, form, form_outputs)
    _wire_objective(ctx, form, form_outputs)
    _wire_data_check(ctx, form.seen, form_outputs)
    _wire_recipe_files(
        ctx, yaml_to_form, form, form_outputs, recipe_pick, load_btn, save_name, save_btn, file_msg
    )
    _wire_command_and_plan(ctx, command, gpu_mem, plan_btn, plan_md)


@dataclasses.dataclass
class FormView:
    """The form's components: the search and its answer, the tabs, the objective choice, each tab's errors
    and "More settings" fold, and the fields' widgets (in ctx.fields' order)."""

    search: gr.Textbox
    search_md: gr.Markdown
    tabs: gr.Tabs
    objective: gr.Radio
    group_md: list
    folds: list
    comps: list
    seen: gr.State  # what the page shows of the fields and folds (_form_updates)


def _form_column(ctx: AppContext, start_raw: dict) -> FormView:
    """Find a setting, then one tab per group: the common fields, then the rest in a "More settings" fold."""
    search = gr.Textbox(
        "",
        label="Find a setting",
        placeholder="words or key, e.g. learning rate, lora, max_length",
        elem_id="find-setting",
    )
    search_md = gr.Markdown(elem_id="find-result")
    comps, group_md, folds, objective = [], [], [], None
    with gr.Tabs() as tabs:
        for g, fs in ctx.groups.items():
            with gr.Tab(g, id=g):
                group_md.append(gr.Markdown(label=f"{g} errors", elem_classes=["section-errors"]))
                if g == OBJECTIVE_GROUP:
                    objective = gr.Radio(
                        list(OBJECTIVES),
                        value=objective_of(start_raw),
                        label="Objective",
                        info="what the run trains for: its settings show below (the recipe's preference, rl "
                        "or distill section)",
                    )
                comps += _fields(fs, start_raw, common=True)
                more = [f for f in fs if not f.common]
                with gr.Accordion(
                    "More settings", open=False, visible=any(applies(f, start_raw) for f in more)
                ) as fold:
                    comps += _fields(more, start_raw, common=False)
                folds.append(fold)
    # what the page shows: each field's visibility and errors (none yet: the help), each fold's visibility
    shown = [[applies(f, start_raw), None] for f in ctx.fields] + [
        [any(applies(f, start_raw) for f in fs if not f.common), None] for fs in ctx.groups.values()
    ]
    return FormView(search, search_md, tabs, objective, group_md, folds, comps, gr.State(shown))


def _data_preview_section(ctx: AppContext) -> None:
    """The records as the trainer tokenizes them, the loss tokens highlighted, and their lengths (on demand)."""
    with gr.Accordion("Data preview", open=False):
        with gr.Row():
            preview_btn = gr.Button("Preview the training data", scale=1)
            preview_md = gr.Markdown(label="Data summary", elem_id="data-summary")
        preview_html = gr.HTML(
            label="First records, the tokens that carry the loss highlighted", elem_id="data-preview"
        )
        lengths_plot = gr.Plot(label="Token lengths of the records")
    preview_btn.click(
        lambda text: data_preview(ctx.ws, text),
        ctx.yaml_box,
        [preview_md, preview_html, lengths_plot],
        api_name="data_preview",
    )


def _fields(fs: list[FormField], raw: dict, common: bool) -> list:
    """The widgets of a tab's common fields (or of the rest), in one group, as the recipe `raw` sets them."""
    mine = [f for f in fs if f.common == common]
    with gr.Group():
        return [_component(f, v, applies(f, raw)) for f, v in zip(mine, dict_to_values(mine, raw))]


def _wire_search(ctx: AppContext, form: FormView, form_outputs: list) -> None:
    """Typing in "Find a setting" shows the matching fields only (with their folds opened) and selects the
    first tab that has one; an empty search shows the form as before."""
    fields = ctx.fields

    def find(text, query, seen):
        raw, errors = _recipe_error(text, ctx.ws)
        first = next((f.group for f in fields if query.strip() and _shown(f, {}, raw, query)), None)
        return [
            search_markdown(fields, raw, query),
            gr.Tabs(selected=first) if first else gr.update(),
            *_form_updates(ctx.groups, raw, errors, query, seen=seen),
        ]

    form.search.change(  # not .input: gradio sends no input event when the box is emptied
        find,
        [ctx.yaml_box, form.search, form.seen],
        [form.search_md, form.tabs, *form_outputs],
        api_name="find_setting",
        trigger_mode="always_last",
        show_progress="hidden",
    )


def _wire_data_check(ctx: AppContext, seen_state: gr.State, form_outputs: list) -> None:
    """After each change of the YAML, in the background: the data check (app/preview.py) on a recipe whose
    data and model sections are otherwise valid, once per data_key; then the form shows the errors of the YAML
    as it is by then. Read after the check, not with it: a slow check of an older text (a value typed since)
    must not leave that text's errors behind, and the check that follows the last change reads the last text."""

    def check(text):
        raw, errors = _recipe_error(text, ctx.ws)
        if raw is not None and not any(k.split(".")[0] in ("", "data", "model") for k in errors):
            check_data(ctx.ws, text, raw)

    def show(text, seen):
        return _error_updates(ctx.groups, _recipe_error(text, ctx.ws)[1], seen)

    ctx.yaml_box.change(
        check,
        ctx.yaml_box,
        None,
        api_visibility="private",
        trigger_mode="always_last",
        show_progress="hidden",
    ).then(show, [ctx.yaml_box, seen_state], form_outputs, api_visibility="private", show_progress="hidden")


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


def _edited(ctx: AppContext, text: str, values: list, query: str, seen, refill: bool = False) -> list:
    """[the YAML with the form's `values` applied in place (recipe_form.edit_yaml), then the form's updates];
    `refill`: the widgets are set to `values` too (a choice that changed other fields)."""
    raw = values_to_dict(ctx.fields, values)
    errors = _problems(ctx.ws, raw, ctx.fields)
    updates = _form_updates(ctx.groups, raw, errors, query or "", values if refill else None, seen)
    return [edit_yaml(text, ctx.fields, values), *updates]


def _wire_objective(ctx: AppContext, form: FormView, form_outputs: list) -> None:
    """The Method tab's "Objective" switches the preference / rl / distill sections (one on, the others off),
    and follows the YAML."""

    def choose(text, chosen, *values_query_seen):
        *values, query, seen = values_query_seen
        return _edited(ctx, text, with_objective(ctx.fields, values, chosen), query, seen, refill=True)

    def follow(text):
        try:
            return objective_of(parse_yaml(text))
        except YamlError:
            return gr.update()

    form.objective.input(
        choose,
        [ctx.yaml_box, form.objective, *form.comps, form.search, form.seen],
        [ctx.yaml_box, *form_outputs],
        api_visibility="private",
        show_progress="hidden",
    )
    ctx.yaml_box.change(
        follow, ctx.yaml_box, form.objective, api_visibility="private", show_progress="hidden"
    )


def _wire_form(ctx: AppContext, form: FormView, form_outputs: list, apply_btn: gr.Button):
    """Form -> YAML on every edit, YAML -> form on Apply (and as the YAML is typed); returns yaml_to_form."""

    def form_to_yaml(text, *values_query_seen):
        """The YAML as the user wrote it, with the changed fields applied in place (recipe_form.edit_yaml)."""
        *values, query, seen = values_query_seen
        return _edited(ctx, text, values, query, seen)

    def yaml_to_form(text, query="", seen=None):
        raw, errors = _recipe_error(text, ctx.ws)
        values = dict_to_values(ctx.fields, raw) if raw is not None else None
        return _form_updates(ctx.groups, raw, errors, query or "", values, seen)

    gr.on(
        [c.input for c in form.comps],
        form_to_yaml,
        inputs=[ctx.yaml_box, *form.comps, form.search, form.seen],
        outputs=[ctx.yaml_box, *form_outputs],
        api_name="form_to_yaml",
        trigger_mode="always_last",
        show_progress="hidden",
    )
    inputs = [ctx.yaml_box, form.search, form.seen]
    apply_btn.click(yaml_to_form, inputs, form_outputs, api_name="yaml_to_form")
    ctx.yaml_box.input(
        yaml_to_form,
        inputs,
        form_outputs,
        api_visibility="private",
        trigger_mode="always_last",
        show_progress="hidden",
    )
    return yaml_to_form


def _wire_recipe_files(
    ctx: AppContext,
    yaml_to_form,
    form,
    form_outputs: list,
    recipe_pick,
    load_btn,
    save_name,
    save_btn,
    file_msg,
) -> None:
    """Load a recipe file of the workspace into the YAML and the form; save the YAML under recipes/."""
    ws = ctx.ws

    def load_recipe(path, seen=None):
        try:
            p = ws.inside(path or "", "recipe file")
        except PathRefused as e:
            raise user_error(str(e)) from None
        if p.suffix not in (".yaml", ".yml") or not p.is_file():
            raise user_error(f"recipe file: {path} is not a .yaml file in the workspace")
        text = p.read_text()
        return [text, f"loaded `{ws.rel(p)}`", *yaml_to_form(text, "", seen)]  # YAML and form in one update

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

    load_btn.click(
        load_recipe, [recipe_pick, form.seen], [ctx.yaml_box, file_msg, *form_outputs], api_name="load_recipe"
    )
    save_btn.click(save_recipe, [save_name, ctx.yaml_box], [file_msg, recipe_pick], api_name="save_recipe")
