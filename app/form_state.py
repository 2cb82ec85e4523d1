"""What the Configure tab's form shows of a recipe, decided without the page: the recipe it starts with, which
fields and "More settings" folds are shown (a field where it applies to the recipe and matches the search, a
field with an error always, its fold opened), what changes from what the page shows already, the validation
status, each form tab's errors and what a search found.
"""

from __future__ import annotations

from typing import NamedTuple

from app.recipe_form import FormField, applies, errors_text, to_yaml
from app.workspace import Workspace

STARTER = {  # the form's starting point when the workspace has no recipe: a tiny model from scratch
    "output_dir": "runs/my-run",
    "model": {
        "tokenizer": "bundled:smollm2-135m-instruct",
        "from_scratch": {"hidden_size": 128, "num_hidden_layers": 2},
    },
    "data": {"train": ["data/tiny_stories.txt"], "format": "text", "max_length": 128},
    "train": {"max_steps": 100, "lr": 0.003},
}


def starting_recipe(ws: Workspace) -> tuple[list[str], str | None, str]:
    """(the workspace's recipe files, the one the form starts with, its YAML): pretrain_tiny.yaml where there
    is one, else the first file, else STARTER."""
    recipes = ws.recipe_files()
    first = next((r for r in recipes if r.endswith("pretrain_tiny.yaml")), recipes[0] if recipes else None)
    return recipes, first, (ws.root / first).read_text() if first else to_yaml(STARTER)


def page_state(groups: dict[str, list[FormField]], raw: dict) -> list:
    """What the page shows as it is built for `raw`: each field's visibility and errors (none yet: the help),
    each fold's visibility (form_changes' `seen`)."""
    fields = [f for fs in groups.values() for f in fs]
    return [[applies(f, raw), None] for f in fields] + [
        [any(applies(f, raw) for f in fs if not f.common), None] for fs in groups.values()
    ]


def shown(f: FormField, errors: dict[str, list[str]], raw: dict | None, query: str = "") -> bool:
    """Whether the form shows `f`: it has an error, or it applies to the recipe and matches the search."""
    return bool(errors.get(f.key)) or (applies(f, raw) and f.matches(query))


def field_help(f: FormField, errors: dict[str, list[str]]) -> dict:
    """A field's line under its label: its errors (and the red frame), else its help from the schema ("" clears
    an error: None would mean "unchanged")."""
    msgs = errors.get(f.key)
    info = ("⚠ " + "; ".join(msgs)) if msgs else (f.description or "")
    return {"info": info, "elem_classes": ["field-error"] if msgs else []}


def folds(groups: dict[str, list[FormField]], visible: dict[str, bool], errors: dict, query: str) -> list:
    """Each tab's "More settings" fold: (shown, opened): shown while one of its fields is (`visible`: each
    field's `shown`), opened for an error or a search hit inside it (never closed here: a fold the user opened
    stays open)."""
    out = []
    for fs in groups.values():
        on = [f for f in fs if not f.common and visible[f.key]]
        out.append((bool(on), any(f.key in errors for f in on) or bool(query.strip() and on)))
    return out


class FormChanges(NamedTuple):
    """What the form is told: the validation status, each tab's errors, then each fold's and each field's
    update (the keywords of gr.update: only what changes), and what the page shows afterwards (the `seen` of
    the next change; None: unknown)."""

    status: str
    group_errors: list[str]
    folds: list[dict]
    fields: list[dict]
    shown: list | None


def form_changes(
    groups: dict[str, list[FormField]],
    raw: dict | None,
    errors: dict[str, list[str]],
    query: str = "",
    values=None,
    seen=None,
    keep_shown: bool = False,
) -> FormChanges:
    """What the form is told for a recipe (`raw`, None for a YAML that does not parse) and its `errors`;
    `values` ({key: widget value}) are set too, for the fields they name.

    `seen` is what the page shows (the last of these lists, kept per page in a gr.State; None: unknown): each
    field's visibility and errors, each fold's visibility. Only what changes is sent: every update of a field
    redraws it, and on a page where a method switch has shown and hidden fields, redrawing them all made each
    keystroke take about a second. `keep_shown` (the errors that follow the background data check): what is
    shown is left as it is (a search typed meanwhile), but for a field with an error, which is shown with its
    fold opened; `raw` and `query` are not read, and what is shown is unknown (None) where `seen` is."""
    fields = [f for fs in groups.values() for f in fs]
    known = seen is not None and len(seen) == len(fields) + len(groups)
    if keep_shown:
        visible = {f.key: f.key in errors or bool(known and seen[i][0]) for i, f in enumerate(fields)}
        opened = [any(not f.common and f.key in errors for f in fs) for fs in groups.values()]
        fold_state = [(o or bool(known and seen[len(fields) + j][0]), o) for j, o in enumerate(opened)]
        tell = [f.key in errors for f in fields] + opened  # which visibilities are sent
    else:
        visible = {f.key: shown(f, errors, raw, query) for f in fields}
        fold_state = folds(groups, visible, errors, query)
        now_shown = [visible[f.key] for f in fields] + [on for on, _ in fold_state]
        tell = [not known or seen[i][0] != on for i, on in enumerate(now_shown)]
    now = [[visible[f.key], errors.get(f.key)] for f in fields] + [[on, None] for on, _ in fold_state]
    fold_out = [
        {**({"visible": on} if tell[len(fields) + j] else {}), **({"open": True} if opened else {})}
        for j, (on, opened) in enumerate(fold_state)
    ]
    fields_out = []
    for i, f in enumerate(fields):
        kw = {"value": values[f.key]} if values and f.key in values else {}
        if tell[i]:
            kw["visible"] = now[i][0]
        if not known or seen[i][1] != now[i][1]:
            kw.update(field_help(f, errors))
        fields_out.append(kw)
    shown_now = now if known or not keep_shown else None
    return FormChanges(status_markdown(errors), group_errors(groups, errors), fold_out, fields_out, shown_now)


def first_match(fields: list[FormField], raw: dict | None, query: str) -> str | None:
    """The form tab of the first field a search shows (the tab it selects), None for no search or no match."""
    return next((f.group for f in fields if query.strip() and shown(f, {}, raw, query)), None)


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
