"""The Configure tab: a recipe file picker, the form generated from the schema (app/recipe_form.py) beside
the editable YAML, a search over the form's fields, the backend and process count with the launch command
(or the trainer's refusal), the memory plan and the data preview.

Each form tab shows its common fields first and the rest behind a "More settings" fold; a field shows only
where it applies to the recipe (recipe_form.applies) and, while a search is typed, only where it matches.
A field with an error is always shown, and its fold opens.

This module lays the tab out and wires its events; what they show is decided in plain modules: the recipe's
check, made once per text and read by every handler of an edit (app/recipe_check.py), and what the form shows
of it (app/form_state.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import gradio as gr

from app.context import AppContext, Page, RecipeInputs, one_listener, user_error, user_warning
from app.form_state import (
    first_match,
    form_changes,
    page_state,
    search_markdown,
    starting_recipe,
    status_markdown,
)
from app.model_support import model_support
from app.preview import check_data, examples_html, lengths_figure, preview_key, run_preview, summary_markdown
from app.recipe_check import RecipeCheck, RecipeRefused, check, checked_recipe, launch_command, memory_plan
from app.recipe_form import (
    NONE_CHOICE,
    OBJECTIVE_GROUP,
    OBJECTIVES,
    FormField,
    applies,
    dict_to_values,
    edit_yaml,
    errors_plain,
    objective_of,
    parse_yaml,
    switches_others,
    with_objective,
    written_back,
)
from app.runs import PYTHON_BACKEND, backend_label, default_processes
from app.workspace import PathRefused, Workspace, check_name


def form_updates(
    groups: dict[str, list[FormField]],
    raw,
    errors,
    query: str = "",
    values=None,
    seen=None,
    keep_shown: bool = False,
) -> list:
    """[status, each tab's errors, each tab's fold, each field, what is shown]: the form's outputs, as
    form_state.form_changes decides them (the arguments are its own)."""
    out = form_changes(groups, raw, errors, query, values, seen, keep_shown)
    return [
        out.status,
        *out.group_errors,
        *(gr.update(**kw) for kw in out.folds),
        *(gr.update(**kw) for kw in out.fields),
        out.shown,
    ]


def form_news(
    groups: dict[str, list[FormField]], raw, errors, query: str = "", seen=None, keep_shown=False
) -> list:
    """[status, each tab's errors, the news for the rest of the form]: what an edit tells the form at once, and
    what its folds and fields are told after (`FormNews`), only where any of them changes (the page has a
    hundred and more fields: redrawing them all took most of an edit's time, the server building each one's
    update and the browser applying it)."""
    out = form_changes(groups, raw, errors, query, None, seen, keep_shown)
    # the fields' updates are of what differs from `seen` (or of errors shown again after the data check): nothing
    # differs where what is shown is what was seen, but a fold to open
    changed = out.shown is None or out.shown != seen or any(kw.get("open") for kw in out.folds)
    news = {"n": next(_NEWS), "folds": out.folds, "fields": out.fields, "shown": out.shown}
    return [out.status, *out.group_errors, news if changed else gr.skip()]


_NEWS = itertools.count()  # each news differs from the last: the State's change event fires for every one


def told(news: dict) -> list:
    """[each fold, each field, what is shown]: the updates a `form_news` carries."""
    return [
        *(gr.update(**kw) for kw in news["folds"]),
        *(gr.update(**kw) for kw in news["fields"]),
        news["shown"],
    ]


def data_preview(ws: Workspace, text: str):
    """(summary, records as HTML, length histogram) of the recipe's training data (app.preview)."""
    try:
        checked_recipe(ws, text)
    except RecipeRefused as e:
        raise user_error(str(e), duration=None) from None
    try:
        out = run_preview(ws, text)
    except RuntimeError as e:
        raise user_error(f"data preview: {e}") from None
    return summary_markdown(out), examples_html(out), lengths_figure(out)


# ---------------------------------------------------------------------------------------- layout


def configure_tab(ctx: AppContext, page: Page) -> RecipeInputs:
    """A recipe file picker, the form (one sub-tab per group) beside the editable YAML, the backend,
    the launch command and the memory plan; returns the recipe inputs (the Run tab starts them)."""
    recipes, first_recipe, start_yaml = starting_recipe(ctx.ws)
    start_raw = parse_yaml(start_yaml)
    files = _files_row(recipes, first_recipe)
    with gr.Row():
        with gr.Column(scale=3):
            form = _form_column(ctx, start_raw)
        with gr.Column(scale=2):
            recipe, apply_btn, valid_md, command = _yaml_column(ctx, start_yaml)
    # the plan's table is wide: the page's whole width, below the form and the YAML
    with gr.Accordion("Memory plan", open=False):
        with gr.Row():
            gpu_mem = gr.Number(80, label="GPU memory per device (GiB)", minimum=1, scale=1)
            plan_btn = gr.Button("Estimate memory", scale=1)
            support_btn = gr.Button("Will this model work?", scale=1)
        plan_md = gr.Markdown(label="Memory plan", elem_id="memory-plan")
        support_md = gr.Markdown(label="Model support", elem_id="model-support")

    stale = _data_preview_section(ctx, recipe.yaml_box)

    form_outputs = [valid_md, *form.group_md, *form.folds, *form.comps, form.seen]
    # an edit's status first; its news for the folds and fields after, where there is any (form_news)
    status_outputs = [valid_md, *form.group_md, form.news]
    form.news.change(
        told,
        form.news,
        [*form.folds, *form.comps, form.seen],
        api_visibility="private",
        show_progress="hidden",
        queue=False,
    )
    yaml_to_form = _wire_form(ctx, recipe, form, (form_outputs, status_outputs), apply_btn)
    _wire_search(ctx, recipe, form, form_outputs)
    objective = _wire_objective(ctx, recipe, form, form_outputs)
    data_check = _wire_data_check(ctx, recipe, form.seen, status_outputs)
    _wire_recipe_files(ctx, recipe, yaml_to_form, form, [*form_outputs, command], files)
    command_step = _wire_command_and_plan(ctx, page, recipe, command, (gpu_mem, plan_btn, plan_md))
    # what follows a change of the YAML, the quick ones first: the command, the objective, the preview's staleness,
    # then the data check (a process of its own) and the errors it found
    one_listener(recipe.yaml_box.change, command_step, objective, stale, *data_check)
    # the support matrix's row of the recipe's model, built tiny (python -m training.support)
    support_btn.click(
        lambda text: model_support(ctx.ws, text), recipe.yaml_box, support_md, api_name="model_support"
    )
    return recipe


@dataclass(frozen=True)
class RecipeFiles:
    """The recipe file row: the picker and Load, the name to save as and Save, and what they did."""

    pick: gr.Dropdown
    load_btn: gr.Button
    save_name: gr.Textbox
    save_btn: gr.Button
    message: gr.Markdown


def _files_row(recipes: list[str], first_recipe: str | None) -> RecipeFiles:
    with gr.Row():
        recipe_pick = gr.Dropdown(
            recipes, value=first_recipe, label="Recipe file", allow_custom_value=True, scale=3
        )
        load_btn = gr.Button("Load", scale=1)
        save_name = gr.Textbox(label="Save as (recipes/NAME.yaml)", placeholder="my-run", scale=2)
        save_btn = gr.Button("Save", scale=1)
    file_msg = gr.Markdown(label="Recipe file status", elem_id="recipe-file-status")
    return RecipeFiles(recipe_pick, load_btn, save_name, save_btn, file_msg)


def _yaml_column(ctx: AppContext, start_yaml: str):
    """(the recipe inputs, Apply, the validation status, the launch command): the editable YAML and what
    starts it."""
    yaml_box = gr.Code(
        start_yaml,
        language="yaml",
        label="Recipe YAML (editable)",
        interactive=True,
        lines=18,
        wrap_lines=True,
    )
    apply_btn = gr.Button("Apply YAML to the form")
    valid_md = gr.Markdown(
        status_markdown(check(ctx.ws, start_yaml).errors), label="Validation", elem_id="validation"
    )
    with gr.Row():
        read = ctx.ws.backends()
        backends = [PYTHON_BACKEND, *((backend_label(n, b), n) for n, b in read.items())]
        backend = gr.Dropdown(backends, value=PYTHON_BACKEND, label="Backend (accelerate config)", scale=3)
        nprocs = gr.Number(1, label="Processes", precision=0, minimum=1, scale=1)
    command = gr.Code(language="shell", label="Launch command", interactive=False, lines=2, wrap_lines=True)
    return RecipeInputs(yaml_box, backend, nprocs), apply_btn, valid_md, command


@dataclass(frozen=True)
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
    seen: gr.State  # what the page shows of the fields and folds (form_state.form_changes)
    news: gr.State  # what an edit tells the folds and fields, after its status (form_news)

    def widgets(self, fields: list[FormField]) -> dict:
        """key -> the field's widget (`fields`: ctx.fields, in the order the widgets were made)."""
        return {f.key: c for f, c in zip(fields, self.comps)}


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
    shown = page_state(ctx.groups, start_raw)
    return FormView(
        search, search_md, tabs, objective, group_md, folds, comps, gr.State(shown), gr.State(None)
    )


def _fields(fs: list[FormField], raw: dict, common: bool) -> list:
    """The widgets of a tab's common fields (or of the rest), in one group, as the recipe `raw` sets them."""
    mine = [f for f in fs if f.common == common]
    with gr.Group():
        return [_component(f, v, applies(f, raw)) for f, v in zip(mine, dict_to_values(mine, raw))]


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


def _data_preview_section(ctx: AppContext, yaml_box: gr.Code) -> dict:
    """The records as the trainer tokenizes them, the loss tokens highlighted, and their lengths (on demand)."""
    with gr.Accordion("Data preview", open=False):
        with gr.Row():
            preview_btn = gr.Button("Preview the training data", scale=1)
            preview_md = gr.Markdown(label="Data summary", elem_id="data-summary")
        preview_html = gr.HTML(
            label="First records, the tokens that carry the loss highlighted", elem_id="data-preview"
        )
        lengths_plot = gr.Plot(label="Token lengths of the records")
    previewed = gr.State(None)  # the preview_key of the recipe the preview shows
    shown = [preview_md, preview_html, lengths_plot]
    preview_btn.click(
        lambda text: data_preview(ctx.ws, text), yaml_box, shown, api_name="data_preview"
    ).success(
        lambda text: preview_key(check(ctx.ws, text).raw), yaml_box, previewed, api_visibility="private"
    )

    def stale(text, key):
        """A preview of other data or model settings than the YAML's goes (it stayed, of the old data)."""
        if key is None or preview_key(check(ctx.ws, text).raw) == key:
            return [gr.skip()] * 4
        return ["The data or model settings changed: preview them again.", "", None, None]

    return dict(  # a step after each change of the YAML (configure_tab)
        fn=stale,
        inputs=[yaml_box, previewed],
        outputs=[*shown, previewed],
        api_visibility="private",
        show_progress="hidden",
    )


# ---------------------------------------------------------------------------------------- events


def _wire_search(ctx: AppContext, recipe: RecipeInputs, form: FormView, form_outputs: list) -> None:
    """Typing in "Find a setting" shows the matching fields only (with their folds opened) and selects the
    first tab that has one; an empty search shows the form as before."""
    fields = ctx.fields

    def find(text, query, seen):
        c = check(ctx.ws, text)
        first = first_match(fields, c.raw, query)
        return [
            search_markdown(fields, c.raw, query),
            gr.Tabs(selected=first) if first else gr.update(),
            *form_updates(ctx.groups, c.raw, c.errors, query, seen=seen),
        ]

    form.search.change(  # not .input: gradio sends no input event when the box is emptied
        find,
        [recipe.yaml_box, form.search, form.seen],
        [form.search_md, form.tabs, *form_outputs],
        api_name="find_setting",
        trigger_mode="always_last",
        show_progress="hidden",
    )


def _wire_data_check(
    ctx: AppContext, recipe: RecipeInputs, seen_state: gr.State, status_outputs: list
) -> list[dict]:
    """The last two steps after each change of the YAML (configure_tab), in the background: the data check
    (app/preview.py) on a recipe that takes it (RecipeCheck.takes_data_check), once per data_key; then the form
    shows the errors of the YAML as it is by then. Read after the check, not with it: a slow check of an older
    text (a value typed since) must not leave that text's errors behind, and the check that follows the last
    change reads the last text."""

    def data_check(text):
        c = check(ctx.ws, text)
        if c.takes_data_check:
            check_data(ctx.ws, text, c.raw)

    def show(text, seen):
        return form_news(ctx.groups, None, check(ctx.ws, text).errors, seen=seen, keep_shown=True)

    return [
        dict(
            fn=data_check,
            inputs=recipe.yaml_box,
            outputs=None,
            api_visibility="private",
            show_progress="hidden",
        ),
        dict(
            fn=show,
            inputs=[recipe.yaml_box, seen_state],
            outputs=status_outputs,
            api_visibility="private",
            show_progress="hidden",
        ),
    ]


def _wire_command_and_plan(ctx: AppContext, page: Page, recipe: RecipeInputs, command, plan: tuple) -> dict:
    """The launch command follows the backend and process count, and the YAML (the step this returns); the plan
    button plans the YAML (`plan`: the GPU memory, the button, the plan's table)."""
    ws = ctx.ws
    gpu_mem, plan_btn, plan_md = plan
    command_io = dict(
        fn=lambda text, backend_name, n: launch_command(ws, text, backend_name, n),
        inputs=[recipe.yaml_box, recipe.backend, recipe.nprocs],
        outputs=command,
        show_progress="hidden",
    )
    # picking a backend proposes its process count (a mesh file's is fixed by its parallelism_config)
    propose = dict(
        fn=lambda name: default_processes(ws.backends().get(name)),
        inputs=recipe.backend,
        outputs=recipe.nprocs,
        api_visibility="private",
        show_progress="hidden",
    )
    one_listener(recipe.backend.change, propose, dict(**command_io, api_visibility="private"))
    for trigger in (recipe.nprocs.change, page.demo.load):
        trigger(**command_io, api_visibility="private")
    plan_btn.click(
        lambda text, n, gib: memory_plan(ws, text, n, gib),
        [recipe.yaml_box, recipe.nprocs, gpu_mem],
        plan_md,
        api_name="memory_plan",
    )
    return dict(**command_io, api_name="launch_command")


def _wire_objective(ctx: AppContext, recipe: RecipeInputs, form: FormView, form_outputs: list) -> dict:
    """The Method tab's "Objective" switches the preference / rl / distill sections (one on, the others off),
    and follows the YAML (the step this returns)."""
    widget, field = form.widgets(ctx.fields), {f.key: f for f in ctx.fields}
    # the objective sections' switches and fields (recipe_form.written_back): what a choice writes back
    fields = [g for key in OBJECTIVES.values() if key for g in written_back(ctx.fields, field[key])]

    def choose(text, chosen, *values_query_seen):
        """[the YAML with the chosen objective's section on, the others off (their fields' values written back
        where they apply), the form's updates for it, the hidden switches set]. The new YAML's check is the one
        the YAML box's change listeners read next."""
        *values, query, seen = values_query_seen
        values = with_objective(fields, values, chosen)
        new = edit_yaml(text, fields, values, whole_form=False)
        c = check(ctx.ws, new)
        switches = {f.key: v for f, v in zip(fields, values) if f.key in OBJECTIVES.values()}
        return [new, *form_updates(ctx.groups, c.raw, c.errors, query or "", switches, seen)]

    def follow(text):
        c = check(ctx.ws, text)
        return gr.update() if c.raw is None else objective_of(c.raw)

    form.objective.input(
        choose,
        [recipe.yaml_box, form.objective, *(widget[f.key] for f in fields), form.search, form.seen],
        [recipe.yaml_box, *form_outputs],
        api_visibility="private",
        show_progress="hidden",
    )
    return dict(
        fn=follow,
        inputs=recipe.yaml_box,
        outputs=form.objective,
        api_visibility="private",
        show_progress="hidden",
    )


def fields_to_yaml(fields: list[FormField]):
    """An edit of `fields` alone (one field, or a switch and what it writes back): (YAML text, their values) ->
    the YAML with those values applied in place (left as it is where it is no mapping of keys)."""

    def fields_to_yaml(text, *values):
        return edit_yaml(text, fields, list(values), whole_form=False)

    return fields_to_yaml


def _wire_form(ctx: AppContext, recipe: RecipeInputs, form: FormView, outputs: tuple, apply_btn: gr.Button):
    """Form -> YAML on every edit, YAML -> form on Apply (and as the YAML is typed); returns yaml_to_form.
    `outputs`: the whole form's, and an edit's status with its news (form_news)."""
    form_outputs, status_outputs = outputs

    def form_to_yaml(text, *values):
        """The YAML as the user wrote it, with the changed fields of the whole form applied in place
        (recipe_form.edit_yaml): the API's. The page sends an edit's own fields (fields_to_yaml), the YAML
        alone, first; what the form shows of it follows (`follow`)."""
        return edit_yaml(text, ctx.fields, list(values))

    def follow(text, query, seen):
        c = check(ctx.ws, text)
        return form_news(ctx.groups, c.raw, c.errors, query or "", seen)

    # the YAML at once: no queue, and an edit sends its own field's value alone (each value sent, and each update
    # received, is found in the page's tree of components: with every field it took a good part of a second)
    at_once = dict(trigger_mode="always_last", show_progress="hidden", queue=False)
    then = dict(
        fn=follow,
        inputs=[recipe.yaml_box, form.search, form.seen],
        outputs=status_outputs,
        api_visibility="private",
        show_progress="hidden",  # queued: an answer without the queue fires no change event of the news State
    )
    # the API's: every field at once, on no trigger of the page
    gr.on(
        [],
        form_to_yaml,
        [recipe.yaml_box, *form.comps],
        recipe.yaml_box,
        api_name="form_to_yaml",
        queue=False,
    )
    comp = form.widgets(ctx.fields)
    for f in ctx.fields:
        # a switch writes back the values of the fields it shows (recipe_form.written_back)
        sent = written_back(ctx.fields, f) if switches_others(f) else [f]
        comp[f.key].input(
            fields_to_yaml(sent),
            [recipe.yaml_box, *(comp[g.key] for g in sent)],
            recipe.yaml_box,
            api_visibility="private",
            **at_once,
        ).then(**then)

    def yaml_to_form(text, query="", seen=None):
        c = check(ctx.ws, text)
        keys = [f.key for f in ctx.fields]
        values = dict(zip(keys, dict_to_values(ctx.fields, c.raw))) if c.raw is not None else None
        return form_updates(ctx.groups, c.raw, c.errors, query or "", values, seen)

    inputs = [recipe.yaml_box, form.search, form.seen]
    # the progress on the status, not on each of the form's fields (app/ui.py progress_on_leaves)
    apply_btn.click(
        yaml_to_form, inputs, form_outputs, api_name="yaml_to_form", show_progress_on=form_outputs[0]
    )
    # typed in the YAML: its status first, then the form refilled (every field's value: the longer update)
    recipe.yaml_box.input(**then, trigger_mode="always_last").then(
        yaml_to_form, inputs, form_outputs, api_visibility="private", show_progress="hidden"
    )
    return yaml_to_form


def _wire_recipe_files(
    ctx: AppContext,
    recipe: RecipeInputs,
    yaml_to_form,
    form: FormView,
    outputs: list,
    files: RecipeFiles,
) -> None:
    """Load a recipe file of the workspace into the YAML, the form and the launch command (`outputs`: the form's,
    then the command); save the YAML under recipes/."""
    ws = ctx.ws

    def load_recipe(path, backend_name=PYTHON_BACKEND, n=1, seen=None):
        try:
            p = ws.inside(path or "", "recipe file")
        except PathRefused as e:
            raise user_error(str(e)) from None
        if p.suffix not in (".yaml", ".yml") or not p.is_file():
            raise user_error(f"recipe file: {path} is not a .yaml file in the workspace")
        text = p.read_text()
        # the YAML, the form and the command in one update (the command followed the YAML's change a round trip
        # or more later, showing the previous recipe's meanwhile)
        form = yaml_to_form(text, "", seen)
        return [text, f"loaded `{ws.rel(p)}`", *form, launch_command(ws, text, backend_name, n)]

    def save_recipe(name, text):
        """(the file status, the picker's update); a refusal is said in both the status and a toast, plain."""
        try:
            name = check_name((name or "").removesuffix(".yaml"), "save as")
        except PathRefused as e:
            return f"✘ {user_warning(f'not saved: {e}')}", gr.update()
        errors = RecipeCheck.of(ws, text).errors
        if errors:
            return (
                f"✘ {user_warning(f'not saved: the recipe has problems: {errors_plain(errors)}')}",
                gr.update(),
            )
        ws.recipes.mkdir(parents=True, exist_ok=True)
        path = ws.recipes / f"{name}.yaml"
        path.write_text(text)
        return f"saved `{ws.rel(path)}`", gr.update(choices=ws.recipe_files(), value=ws.rel(path))

    files.load_btn.click(
        load_recipe,
        [files.pick, recipe.backend, recipe.nprocs, form.seen],
        [recipe.yaml_box, files.message, *outputs],
        api_name="load_recipe",
        show_progress_on=[recipe.yaml_box, files.message],
    )
    files.save_btn.click(
        save_recipe, [files.save_name, recipe.yaml_box], [files.message, files.pick], api_name="save_recipe"
    )
