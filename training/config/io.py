"""Recipes in and out: YAML files, dotted.key=value overrides, validation messages that name the key, the
schema walked for the fields that name files and code (the app confines each one to its workspace)."""

from __future__ import annotations

import contextlib
import copy
import logging
import typing
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union

import yaml
from pydantic import (
    ValidationError,
)

from training.config.schema import EXCLUSIVE, CodeReference, FilePath, Recipe, Section, _is_set
from training.core.errors import RecipeError

log = logging.getLogger("training.config")  # the package's logger: what users filter on
M = TypeVar("M", FilePath, CodeReference)


def _section_type(annotation: Any) -> type[Section] | None:
    """The section a field holds (`TokenizerTraining` for `TokenizerTraining | None`), else None."""
    alternatives = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, UnionType) else ()
    for t in (annotation, *alternatives):
        if isinstance(t, type) and issubclass(t, Section):
            return t
    return None


def _list_section(annotation: Any) -> type[Section] | None:
    """The section of a list-of-sections field (`RewardSpec` for `list[RewardSpec]`, `DataSource` for
    `list[PathStr] | list[DataSource]`), else None."""
    for t in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(t) is list:
            inner = typing.get_args(t)[0]
            if isinstance(inner, type) and issubclass(inner, Section):
                return inner
    return None


def _marker(annotation: Any, kind: type[M]) -> M | None:
    """The marker of `kind` anywhere in a type (`PathStr`, `list[PathStr] | None`, ...), else None."""
    if typing.get_origin(annotation) is Annotated:
        marks = [m for m in annotation.__metadata__ if isinstance(m, kind)]
        return marks[0] if marks else _marker(typing.get_args(annotation)[0], kind)
    return next(filter(None, (_marker(a, kind) for a in typing.get_args(annotation))), None)


def marked_fields(
    kind: type[M], model: type[Section] | None = None, prefix: str = ""
) -> Iterator[tuple[str, M]]:
    """(dotted key, marker) of every field of the schema typed with a marker of `kind` (FilePath,
    CodeReference); a list of sections shows as `key[]` (`rl.rewards[].function`)."""
    for name, info in (model or Recipe).model_fields.items():
        section = _section_type(info.annotation)
        if section is not None:
            yield from marked_fields(kind, section, f"{prefix}{name}.")
            continue
        if (items := _list_section(info.annotation)) is not None:
            yield from marked_fields(kind, items, f"{prefix}{name}[].")
        marker = next((m for m in info.metadata if isinstance(m, kind)), None) or _marker(
            info.annotation, kind
        )
        if marker is not None:
            yield prefix + name, marker


def path_fields() -> Iterator[tuple[str, FilePath]]:
    """(dotted key, marker) of every field of the schema that names files or directories."""
    return marked_fields(FilePath)


def code_fields() -> Iterator[tuple[str, CodeReference]]:
    """(dotted key, marker) of every field of the schema that names Python code to import."""
    return marked_fields(CodeReference)


def _values_at(node: Any, parts: list[str], key: str = "") -> Iterator[tuple[str, Any]]:
    """(concrete key, value) at a `marked_fields` key in a raw recipe: `rl.rewards[].function` gives
    `rl.rewards[0].function`, `rl.rewards[1].function`, ...; absent sections give nothing."""
    if not parts:
        yield key, node
        return
    head, rest = parts[0], parts[1:]
    name = head.removesuffix("[]")
    value = node.get(name) if isinstance(node, dict) else None
    sub = f"{key}.{name}" if key else name
    if head.endswith("[]"):
        for i, item in enumerate(value if isinstance(value, list) else []):
            yield from _values_at(item, rest, f"{sub}[{i}]")
    elif value is not None:
        yield from _values_at(value, rest, sub)


def _marked_values(
    recipe: Recipe | dict, fields: Iterator[tuple[str, Any]], names
) -> Iterator[tuple[str, str]]:
    raw = recipe.model_dump(mode="json") if isinstance(recipe, Recipe) else recipe
    for field, marker in fields:
        for key, value in _values_at(raw, field.split(".")):
            for one in value if isinstance(value, list) else [value]:
                if isinstance(one, str) and names(marker, one):
                    yield key, one


def recipe_paths(recipe: Recipe | dict) -> Iterator[tuple[str, str]]:
    """(dotted key, value) for every value of a recipe (or its raw dict) that names a file or directory:
    each value, or each item of a list, of a field `path_fields` finds."""
    return _marked_values(recipe, path_fields(), FilePath.names_path)


def recipe_code(recipe: Recipe | dict) -> Iterator[tuple[str, str]]:
    """(dotted key, value) for every value of a recipe (or its raw dict) that names Python code to import
    (`path/to/file.py:name`, `package.module:name`); built-in names are not code of the user's."""
    return _marked_values(recipe, code_fields(), CodeReference.names_code)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see training/recipes/*.yaml for the accepted keys)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"{loc or '(top level)'}: {msg}")
    return f"invalid recipe {source}:\n  " + "\n  ".join(lines)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict.

    An overridden key replaces the key of `raw` it excludes (`EXCLUSIVE`) when `raw` chose that one:
    `train.max_steps=2` on a recipe with `epochs: 3` drops the epochs, as the transformers Trainer
    does, and logs it. Both keys of a pair set in `raw`, or both in `overrides`, stay a conflict.
    """
    original, raw = raw, copy.deepcopy(raw)
    given = {}
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not of the form dotted.key=value")
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise RecipeError(f"override {item!r}: empty key")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, str):  # YAML 1.1 reads "1e-4" as a string
            with contextlib.suppress(ValueError):
                parsed = (
                    float(parsed)
                    if parsed.strip().lower() not in ("nan", "inf", "-inf", "infinity")
                    else parsed
                )
        node = raw
        for p in parts[:-1]:
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise RecipeError(f"override {item!r}: {p} is not a section")
            node = node[p]
        node[parts[-1]] = parsed
        given[".".join(parts)] = parsed
    _replace_excluded(original, raw, given)
    return raw


def _replace_excluded(original: dict, raw: dict, given: dict[str, Any]) -> None:
    """Drop from `raw` each key the recipe file chose over the key an override sets (`EXCLUSIVE`)."""
    for section, pairs in EXCLUSIVE.items():
        in_file, out = original.get(section), raw.get(section)
        if not isinstance(in_file, dict) or not isinstance(out, dict):
            continue
        for a, b in pairs:
            for new, old in ((a, b), (b, a)):
                new_key, old_key = f"{section}.{new}", f"{section}.{old}"
                file_chose_old = _is_set(in_file.get(old)) and not _is_set(in_file.get(new))
                if _is_set(given.get(new_key)) and old_key not in given and file_chose_old:
                    out.pop(old, None)
                    log.warning(
                        f"{new_key}={given[new_key]} from the command line replaces "
                        f"{old_key}={in_file[old]} from the recipe file"
                    )


def parse_recipe(raw: Any, source: str = "<recipe>") -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError(f"invalid recipe {source}: expected a mapping of keys at the top level")
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(_format_validation_error(e, source)) from None
    recipe._source = source  # named again if resolving precision: auto breaks one of its rules
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"recipe {path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"invalid recipe {path}: expected a mapping of keys at the top level")
    return parse_recipe(apply_overrides(raw, overrides or []), str(path))


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def resolve_precision(recipe: Recipe, value: str, why: str) -> Recipe:
    """The recipe with `precision: auto` replaced by `value` ("no" or "bf16", decided by whoever knows the
    machine: training.core.machine.auto_precision for this one), re-validated; `why` goes into the
    start-up line. A recipe with an explicit precision is returned as it is."""
    if recipe.precision != "auto":
        return recipe
    resolved = recipe.model_copy(deep=True)
    try:
        resolved.precision = value  # validate_assignment: the recipe's rules run again with the value
    except ValidationError as e:
        where = f"{recipe._source} (precision: auto -> {value}: {why})"
        raise RecipeError(_format_validation_error(e, where)) from None
    resolved._precision_auto = f"precision: auto -> {value} ({why})"
    return resolved


def with_facts(recipe: Recipe, why: str, **facts) -> Recipe:
    """A copy of the recipe with private facts set that only the machine or the model's files tell (e.g.
    _image_text_checkpoint), its rules run again with them; `why` says where they came from in a refusal."""
    resolved = recipe.model_copy(deep=True)
    for name, value in facts.items():
        setattr(resolved, name, value)
    try:
        resolved.seed = resolved.seed  # validate_assignment: the recipe's rules run again
    except ValidationError as e:
        raise RecipeError(_format_validation_error(e, f"{recipe._source} ({why})")) from None
    return resolved
