"""The recipe checks: one `RecipeCheck` of a YAML text holds everything the Configure tab shows of it and the
Run tab needs to start it: the parsed recipe or the YAML's error, the schema's errors on the form's fields,
what the workspace refuses (paths and code outside it), the data check's last answer, the launch command or
the trainer's refusal for a backend, and whether Start may take it.

One edit of the form or the YAML sets several handlers going (the edit's own, then the YAML box's change
listeners: the data check and the errors after it, the launch command, the Objective that follows the YAML;
a search typed meanwhile): `check` makes the check of a text once and every one of them reads it, so an edit
parses and validates the YAML once. The data check's answer is read at each use (`RecipeCheck.errors`), as
the check runs in the background and answers between two reads of one text. Start, Save, the memory plan
and the data preview check the text afresh (`RecipeCheck.of`): they act on the workspace as it is then.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from app.preview import known_data_problems
from app.recipe_form import (
    YamlError,
    errors_plain,
    errors_text,
    form_fields,
    on_fields,
    parse_yaml,
    validated,
)
from app.runs import PYTHON_BACKEND, RECIPE, LaunchRefused, display_command, launch_argv
from app.workspace import PathRefused, Workspace, recipe_refusals
from training.config import Recipe, parse_recipe
from training.launch.backend import Backend, read_backend
from training.launch.refusals import refusal
from training.planning.memory import estimate
from training.planning.report import format_plan

FIELDS = form_fields()  # the schema's fields: the keys errors are put on
_KEEP = 16  # checks kept (the texts of the last edits)
_CHECKS: OrderedDict[tuple[Workspace, str], RecipeCheck] = OrderedDict()
_LOCK = threading.Lock()


class RecipeRefused(ValueError):
    """A recipe Start (or the data preview) does not take: malformed, or naming what the workspace refuses
    or the data check found; the message names the key or path."""


@dataclass(frozen=True)
class RecipeCheck:
    """One check of a recipe's YAML text in a workspace (read-only: shared by the handlers of one edit)."""

    ws: Workspace
    text: str
    raw: dict | None  # the parsed YAML; None where it does not parse (yaml_error says why)
    yaml_error: str | None
    recipe: Recipe | None  # the validated recipe; None where the schema refuses it
    schema_errors: dict[str, list[str]]  # {form key: [messages]}; the YAML's error under ""
    refusals: dict[str, list[str]]  # what the workspace's rule refuses, {dotted recipe key: [why]}

    @classmethod
    def of(cls, ws: Workspace, text: str) -> RecipeCheck:
        """The text parsed and validated, and its paths and code held to the workspace's rule, now."""
        try:
            raw = parse_yaml(text)
        except YamlError as e:
            return cls(ws, text, None, str(e), None, {"": [str(e)]}, {})
        recipe, schema_errors = validated(raw, FIELDS)
        return cls(ws, text, raw, None, recipe, schema_errors, recipe_refusals(ws, raw))

    @property
    def errors(self) -> dict[str, list[str]]:
        """Every problem the form shows, on its field: the YAML's error (under ""), the schema's errors, what
        the workspace refuses and, for data and model sections the schema takes, the data check's answer as
        it is now ({} when the check has not run for this data)."""
        errors = {key: list(msgs) for key, msgs in self.schema_errors.items()}
        if self.raw is None:
            return errors
        for key, msgs in on_fields(self.refusals, FIELDS).items():
            errors.setdefault(key, []).extend(msgs)
        if not any(k.split(".")[0] in ("data", "model") for k in errors):  # the check read these sections
            for key, msgs in on_fields(known_data_problems(self.ws, self.raw), FIELDS).items():
                errors.setdefault(key, []).extend(msgs)
        return errors

    @property
    def takes_data_check(self) -> bool:
        """Whether the data check may run on it: the schema and the workspace take it (training.preview refuses
        any other recipe, data aside, and that refusal, kept per data_key under data.train, stayed there after
        the recipe was put right)."""
        return self.recipe is not None and not self.refusals

    def launch_command(self, backend_name: str, n) -> str:
        """The shell command a start would run, or a comment saying why it cannot launch: the launch itself,
        or the trainer's refusal table (training.launch.refusals) for this recipe, backend and process count
        on this machine."""
        if self.raw is None:
            return f"# cannot launch: {self.yaml_error}"
        ws = self.ws
        try:
            run_dir = ws.inside(str(self.raw.get("output_dir") or ""), "output_dir", under="runs")
            argv = launch_argv(ws, ws.rel(run_dir / RECIPE), backend_name, int(n or 1))
        except (PathRefused, LaunchRefused) as e:
            return f"# cannot launch: {e}"
        if (why := backend_refusal(ws, self.recipe, backend_name, int(n or 1))) is not None:
            return f"# the trainer would refuse this: {why}"
        return display_command(ws, argv)


def check(ws: Workspace, text: str) -> RecipeCheck:
    """The check of `text`, made once for every handler that reads it (the last few texts are kept)."""
    text = text or ""
    key = (ws, text)
    with _LOCK:  # a handler asking while another makes the check waits for it
        found = _CHECKS.pop(key, None) or RecipeCheck.of(ws, text)
        _CHECKS[key] = found
        while len(_CHECKS) > _KEEP:
            _CHECKS.popitem(last=False)
    return found


def checked_recipe(ws: Workspace, text: str) -> tuple[dict, Path]:
    """The YAML as a launchable recipe and its run directory, or RecipeRefused naming the key / path."""
    c = RecipeCheck.of(ws, text)
    if c.schema_errors:
        raise RecipeRefused(f"malformed recipe, not started: {errors_plain(c.schema_errors)}")
    refused = c.refusals or known_data_problems(ws, c.raw)
    if refused:
        raise RecipeRefused("refused: " + "; ".join(m for msgs in refused.values() for m in msgs))
    return c.raw, ws.inside(c.raw["output_dir"], "output_dir", under="runs")


def launch_command(ws: Workspace, text: str, backend_name: str, n) -> str:
    """RecipeCheck.launch_command of `text`."""
    return check(ws, text).launch_command(backend_name, n)


def backend_refusal(ws: Workspace, recipe: Recipe | None, backend_name: str, n: int) -> str | None:
    """What training.launch.refusals says of the recipe under the chosen backend and process count (None
    for a recipe the schema refuses: the form shows that)."""
    if recipe is None:
        return None
    if backend_name == PYTHON_BACKEND:
        chosen = Backend(name=PYTHON_BACKEND, file="", kind="single")
    else:  # its file alone (launch_argv, called first, has refused one that does not read)
        chosen = read_backend(ws.accelerate_configs()[backend_name])
    cuda = torch.cuda.is_available() and not chosen.cpu
    error = refusal(recipe, dataclasses.replace(chosen, num_processes=n), cuda)
    return None if error is None else str(error)


def memory_plan(ws: Workspace, text: str, n, gib) -> str:
    """The planner's table for the recipe on `n` devices of `gib` GiB each (nothing outside the workspace is
    read: a recipe naming such a path is not planned)."""
    c = RecipeCheck.of(ws, text)
    if errors := c.errors:
        return f"Fix the recipe first:\n{errors_text(errors)}"
    try:
        configs = ws.accelerate_configs()
        kwargs = {"configs_dir": next(iter(configs.values())).parent} if configs else {}
        plans = estimate(
            parse_recipe(c.raw, "the form"), num_gpus=int(n or 1), gpu_memory_gib=float(gib or 80), **kwargs
        )
        return format_plan(plans)
    except Exception as e:  # the planner is another module: show its failure, do not crash the app
        return f"memory planner failed: {type(e).__name__}: {e}"
