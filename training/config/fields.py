"""The recipe's building blocks: the base of every section, and the types that say a value names something
outside the recipe: a file or directory (`PathStr`, `ModelSource`) or Python code to import (`CodeRef`).

Fields are typed by what they name, not found by their names: `training.config.io` walks the schema for
these markers (`recipe_paths`, `recipe_code`), so the app confines every path and every piece of code a
recipe names to its workspace without a hand-kept list (training.launch.confine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class FilePath:
    """Type marker: this str (or each str of this list) names a file or directory.

    `keywords` are whole values, and `prefixes` beginnings of values, that name something else
    (`resume: auto`, `bundled:NAME`); a hub name such as "org/model" is treated as a path.
    """

    keywords: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()

    def names_path(self, value: str) -> bool:
        return bool(value.strip()) and value not in self.keywords and not value.startswith(self.prefixes)


@dataclass(frozen=True)
class CodeReference:
    """Type marker: this str names Python code that the trainer imports and calls:
    `path/to/file.py:name` (a file, loaded by its path) or `package.module:name` (imported by name).

    `builtins` are whole values that name the project's own code instead (`exact_match`).
    """

    builtins: tuple[str, ...] = ()

    def names_code(self, value: str) -> bool:
        return bool(value.strip()) and value not in self.builtins


PathStr = Annotated[str, FilePath()]
ModelSource = Annotated[str, FilePath(prefixes=("bundled:",))]
CodeRef = Annotated[str, CodeReference()]


VERIFIERS = "verifiers:"  # rl.environment: verifiers:ID or verifiers:path/to/env.py, a verifiers environment


def verifiers_target(value: str | None) -> str | None:
    """ID or path/to/env.py where `value` names a verifiers environment (verifiers:...), else None."""
    return value[len(VERIFIERS) :] if isinstance(value, str) and value.startswith(VERIFIERS) else None


def split_code_ref(value: str) -> tuple[str, str, bool]:
    """(where, name, by_path) of `where:name`: by_path for a file (`x.py`, or any value with a slash),
    else a dotted module name."""
    where, _, name = value.rpartition(":")
    return where, name, where.endswith(".py") or "/" in where or "\\" in where


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _is_set(value: Any) -> bool:
    return value is not None and value != 0
