"""What a recipe may name when the app runs it: paths inside the app's workspace, and code inside it too or
on the operator's allow-list.

One rule, applied twice: by the app before it saves, plans or launches a recipe (its form shows each refusal
next to the field), and by the trainer the app launched, which finds the rule in its environment
(`Confinement.env`) and checks the recipe before it reads a file or imports a module (RecipeError: exit 2).
The command line sets no such variable: it imports what its own user names.

Code a recipe names is typed in the schema (`CodeRef`, found by `training.config.recipe_code`):
- `path/to/file.py:name` is allowed where the file resolves (symlinks and `..` included) inside the
  workspace;
- `package.module:name` where every file importing it would run (each package's `__init__` and the
  module) lies inside the workspace, found as the import system finds them without importing anything;
  or where the module is on the operator's allow-list (`python -m app --allow-module PREFIX`: PREFIX and
  its submodules);
- the built-in names (`exact_match`, ...) are the project's own code and always allowed.
`model.trust_remote_code` runs the Python files of the model's directory: under the app, only a directory
inside the workspace (a hub model's code would come from outside it).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib.machinery import BuiltinImporter, FrozenImporter, PathFinder
from pathlib import Path

from training.config import Recipe, recipe_code, recipe_paths, verifiers_target
from training.config.fields import split_code_ref
from training.core.errors import RecipeError

WORKSPACE_ENV = "LLM_FORGE_WORKSPACE"  # set by the app on the runs it starts: confine to this directory
ALLOW_MODULES_ENV = "LLM_FORGE_ALLOW_MODULES"  # and these module prefixes, comma-separated
RUNS = "runs"  # output_dir lies under the workspace's runs/


class Outside(ValueError):
    """A path or a piece of code a recipe (or the app's UI) names that the rule refuses."""


def is_module_name(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def module_files(name: str, search: list[str]) -> list[Path]:
    """The files that `import name` would run: each package's `__init__` and the module itself, found as
    the import system finds them (already imported, built in, frozen, then on `search`), without importing
    anything. Outside if a part is built into Python (no file: never the workspace's) or cannot be found."""
    files: list[Path] = []
    path: list[str] | None = search
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        dotted = ".".join(parts[:i])
        loaded = sys.modules.get(dotted)
        if loaded is not None:  # importing it runs nothing more: the module it is now is what counts
            origin, path = getattr(loaded, "__file__", None), getattr(loaded, "__path__", None)
            if origin is None and path is None:
                raise Outside(f"module {dotted} is built into Python, not a file of the workspace")
        else:
            if i == 1 and (BuiltinImporter.find_spec(dotted) or FrozenImporter.find_spec(dotted)):
                raise Outside(f"module {dotted} is built into Python, not a file of the workspace")
            spec = PathFinder.find_spec(dotted, path)
            if spec is None:
                raise Outside(
                    f"no module {dotted} is found (looked in the workspace and the installed packages)"
                )
            origin = spec.origin if spec.has_location else None
            path = spec.submodule_search_locations
        if origin is not None:
            files.append(Path(origin))
        if path is None and i < len(parts):
            raise Outside(f"{dotted} is a module, not a package: it has no {parts[i]}")
    return files


@dataclass(frozen=True)
class Confinement:
    """The app's rule: everything inside `root`; modules of `allow_modules` (prefixes) too."""

    root: Path
    allow_modules: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).resolve())
        bad = [m for m in self.allow_modules if not is_module_name(m)]
        if bad:
            raise ValueError(f"--allow-module {bad[0]!r}: expected a module name such as mylab.rewards")

    # ------------------------------------------------------------------ the environment of launched runs

    def env(self) -> dict[str, str]:
        return {WORKSPACE_ENV: str(self.root), ALLOW_MODULES_ENV: ",".join(self.allow_modules)}

    @classmethod
    def from_env(cls, environ=os.environ) -> Confinement | None:
        """The rule the app gave the process it started, or None (the command line: no rule)."""
        root = environ.get(WORKSPACE_ENV)
        if not root:
            return None
        allow = tuple(m for m in environ.get(ALLOW_MODULES_ENV, "").split(",") if m)
        return cls(Path(root), allow)

    # ------------------------------------------------------------------ one value

    def inside(self, path: str | Path, what: str, under: str | None = None) -> Path:
        """`path` (relative to the workspace root) resolved, symlinks and `..` included; Outside unless it
        stays inside the workspace (or inside `under`, a sub-directory of it)."""
        text = str(path).strip()
        if not text:
            raise Outside(f"{what}: empty path")
        p = Path(text).expanduser()
        resolved = (p if p.is_absolute() else self.root / p).resolve()
        base = self.root / under if under else self.root
        if not resolved.is_relative_to(base.resolve()):
            raise Outside(
                f"{what}: {text} is outside the workspace {base} (only paths inside it are accepted)"
            )
        return resolved

    def allows_module(self, name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in self.allow_modules)

    def search_path(self) -> list[str]:
        """Where a launched run finds modules: the workspace first (its working directory, where this
        process's own working directory would be), then the rest of this process's path."""
        here = ("", os.getcwd())
        return [str(self.root), *(p for p in sys.path if p not in here)]

    def code(self, value: str, what: str) -> Path | None:
        """The file a code reference loads by its path (resolved), None for an allowed module; Outside
        with the reason for anything else."""
        where, _, by_path = split_code_ref(value)
        if (target := verifiers_target(value)) is not None:  # an environment id, or its file
            where, by_path = target, target.endswith(".py") or "/" in target
            if not by_path and self.allows_module(target.replace("-", "_")):
                return None
            if not by_path:
                raise Outside(
                    f"{what}: {value}: an installed verifiers environment runs code from outside the workspace; "
                    f"under the app, put its module on the allow-list (python -m app --allow-module "
                    f"{target.replace('-', '_')})"
                )
        if by_path:
            try:
                return self.inside(where, what)
            except Outside:
                raise Outside(
                    f"{what}: {value}: the file {where} is outside the workspace {self.root} (the app imports "
                    "code only from files inside it)"
                ) from None
        if self.allows_module(where):
            return None
        allow = ", ".join(self.allow_modules) or "none given"
        try:
            files = module_files(where, self.search_path())
        except Outside as e:
            raise Outside(
                f"{what}: {value}: {e}; the app imports only modules inside the workspace or on "
                f"its allow-list (python -m app --allow-module PREFIX; now: {allow})"
            ) from None
        for f in files:
            if not f.resolve().is_relative_to(self.root):
                raise Outside(
                    f"{what}: {value}: importing {where} runs {f}, outside the workspace {self.root}, and "
                    f"{where} is not on the app's allow-list (python -m app --allow-module PREFIX; now: {allow})"
                )
        return None

    # ------------------------------------------------------------------ a whole recipe

    def problems(self, recipe: Recipe | dict) -> dict[str, list[str]]:
        """{dotted key: [why]} for every path, piece of code and remote-code switch of a recipe (or its raw,
        validated dict) that the rule refuses; {} when it may run."""
        raw = recipe.model_dump(mode="json") if isinstance(recipe, Recipe) else recipe
        out: dict[str, list[str]] = {}

        def refuse(key: str, check, *args) -> None:
            try:
                check(*args)
            except Outside as e:
                out.setdefault(key, []).append(str(e))

        for key, value in recipe_paths(raw):
            refuse(key, self.inside, value, key, RUNS if key == "output_dir" else None)
        for key, value in recipe_code(raw):
            refuse(key, self.code, value, key)
        if (why := self.remote_code_problem(raw)) is not None:
            out.setdefault("model.trust_remote_code", []).append(why)
        return out

    def remote_code_problem(self, raw: dict) -> str | None:
        model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        if not model.get("trust_remote_code"):
            return None
        for key in ("name_or_path", "tokenizer"):
            source = model.get(key)
            if isinstance(source, str) and not source.startswith("bundled:"):
                try:
                    local = self.inside(source, f"model.{key}")
                except Outside:
                    continue  # refused under its own key
                if not local.is_dir():
                    return (
                        f"model.trust_remote_code: true runs the Python files of model.{key} ({source}), which "
                        "is not a directory of the workspace (a hub model's code would come from outside it); "
                        "under the app, put the model's directory in the workspace"
                    )
        return None

    def check(self, recipe: Recipe | dict, source: str) -> None:
        """RecipeError (exit 2) naming every refused key, before anything is read or imported."""
        problems = self.problems(recipe)
        if problems:
            lines = "\n  ".join(m for msgs in problems.values() for m in msgs)
            raise RecipeError(
                f"recipe {source} names what the app that launched this run does not allow:\n  {lines}"
            )
