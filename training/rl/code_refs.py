"""Code a recipe names (reward functions, tools, environments): `path/to/file.py:name` or
`package.module:name`, imported once. Under the app's rule (training.launch.confine, checked by training.train
before set-up), a file is loaded from the path it resolves to, the one that was checked."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from training.config.fields import split_code_ref
from training.core.errors import RecipeError

log = logging.getLogger(__name__)


def import_code(value: str, key: str, kind: str, what: str = "function"):
    """The object `value` names; RecipeError naming `key` (`kind`: reward, tool, environment, and `what`:
    function, class, for messages)."""
    where, name, by_path = split_code_ref(value)
    if by_path and not Path(where).is_file():
        raise RecipeError(f"{key}: {kind} file {where} does not exist")
    try:
        if by_path:
            file = Path(where).resolve()
            log.info("%s: importing your code: the file %s (%s %s)", key, file, what, name)
            module_name = f"llm_forge_code_{abs(hash(str(file)))}"
            loader = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
        else:
            log.info("%s: importing your code: the module %s (%s %s)", key, where, what, name)
            module = importlib.import_module(where)
            log.info("%s: %s is %s", key, where, getattr(module, "__file__", None) or "built in")
    except ModuleNotFoundError as e:
        if not by_path and e.name and where.startswith(e.name):  # the module named, not one it imports
            raise RecipeError(f"{key}: cannot import {where!r} ({e})") from None
        raise RecipeError(f"{key}: importing {where} raised {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 (the user's module may raise anything on import)
        raise RecipeError(f"{key}: importing {where} raised {type(e).__name__}: {e}") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise RecipeError(f"{key}: {where} has no {what} {name!r}")
    return found


def accepted(fn: Callable, kwargs: dict) -> dict:
    """The keyword arguments `fn` takes: all of them where it has **kwargs, else those it names."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}
