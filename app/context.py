"""What the app's tabs share, none of them owning it: the services they are built on (`AppContext`), the page's
components every tab may hook onto (`Page`) and the recipe inputs the Configure tab makes and the Run tab starts
(`RecipeInputs`), all three frozen and handed to each tab by app/ui.py; the error a user's input earns, and the
Run and Export tabs' polling helpers."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import gradio as gr

from app.chat_models import ChatModels
from app.jobs import JobQueue
from app.recipe_form import FormField
from app.run_views import RunViews
from app.runs import RunRegistry
from app.workspace import Workspace


def user_error(message: str, **kwargs) -> gr.Error:
    """The error a user's input earns: shown in the page, and one line in the app's log, not a traceback
    (gr.Error prints its traceback by default)."""
    _log_refusal(message)
    return gr.Error(message, print_exception=False, **kwargs)


def user_warning(message: str) -> str:
    """A refusal the page answers in its own status (a Save of a recipe with problems): `message`, plain text, in
    a toast and one line in the app's log; returned for the status. A gr.Error would also mark every output of
    the event (the recipe picker, the status) with a red "Error" pill until dismissed."""
    _log_refusal(message)
    gr.Warning(message)
    return message


def _log_refusal(message: str) -> None:
    print(f"refused: {message.splitlines()[0] if message else ''}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class AppContext:
    """What the tabs are built on: the workspace, its runs (the registry and its views), jobs and chat models,
    and the form's fields by form tab (in the order the form shows them)."""

    ws: Workspace
    runs: RunRegistry
    views: RunViews
    chats: ChatModels
    jobs: JobQueue
    groups: dict[str, list[FormField]]

    @property
    def fields(self) -> list[FormField]:
        return [f for fs in self.groups.values() for f in fs]


@dataclass(frozen=True)
class Page:
    """The page's own components: its Blocks (the page load event) and its tabs (a tab switch)."""

    demo: gr.Blocks
    tabs: gr.Tabs


@dataclass(frozen=True)
class RecipeInputs:
    """The recipe as the Configure tab holds it and the Run tab starts it: its YAML, the backend, the processes."""

    yaml_box: gr.Code
    backend: gr.Dropdown
    nprocs: gr.Number


REFRESH_S = 2.0  # how often the Run and Export tabs poll what they show


def changed_only(outputs: dict[str, tuple[str, object]], shown: dict | None) -> tuple[list, dict]:
    """(each output's value, or gr.skip() where the page already shows it; what the page shows now).
    `outputs`: name -> (a key that changes when the value does, the value or a function making it); `shown`:
    the keys last sent, kept per page in a gr.State. A poll that re-sends unchanged tables, logs and text
    makes the browser lay them out again every tick: headless Chromium then kept a core busy."""
    shown, values = dict(shown or {}), []
    for name, (key, value) in outputs.items():
        if shown.get(name) == key:
            values.append(gr.skip())
            continue
        shown[name] = key
        values.append(value() if callable(value) else value)
    return values, shown


def one_listener(trigger, *steps: dict):
    """Several handlers of one event as one listener of it and the steps that follow it (`.then`), each step
    asked again when it ends if the event came again meanwhile (trigger_mode "always_last": it reads the last
    value). Gradio's page, when a listener asked again while busy ends, sends the event again to every listener
    of it, not only to that one: two such listeners of one event asked each other again for as long as the page
    was open. The YAML box's four did (about 15 events a second, with the page at rest), and Chromium's renderer
    stayed busy on a whole core, each edit waiting behind them. A step that follows is asked by its own id."""
    listener = trigger(**steps[0], trigger_mode="always_last")
    for step in steps[1:]:
        listener = listener.then(**step, trigger_mode="always_last")
    return listener
