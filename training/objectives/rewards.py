"""Reward functions of online RL: the built-ins, the user's own (loaded by file path or module), and the
checked call that turns their answers into a [completions, functions] tensor.

Every function is called as TRL calls its reward functions:
    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> [number, ...]
with one entry per completion; `prompts` repeats each prompt for each completion of its group, and every
extra column of the prompt records comes as a keyword argument holding a list of the same length.
A conversational prompt (a list of messages) gets completions as [{"role": "assistant", "content": ...}].
A function that raises, returns the wrong number of values, or a value that is not a finite number
stops the run with the function's name and the offending value (RewardError, exit code 2): the last
good checkpoint was written before the step began, so it stays intact.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from math_verify import parse, verify

from training.config import RewardSpec, RLSection
from training.core.errors import RecipeError, UserError


class RewardError(UserError):
    """A reward function failed or answered wrongly (exit code 2, no traceback)."""


# ----------------------------------------------------------------------------- built-ins


def completion_text(completion) -> str:
    """The text of a completion: a string, or the content of its assistant messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion)


def normalise(text: str) -> str:
    """Lower case, inner whitespace collapsed, surrounding spaces and final punctuation dropped."""
    return re.sub(r"\s+", " ", str(text)).strip().strip(".!").strip().lower()


def answer_of(text: str, tag: str | None) -> str | None:
    """The text inside the last <tag>...</tag>, or the whole text without a tag (None: tag missing)."""
    if not tag:
        return text
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return found[-1] if found else None


def exact_match(completions, column: str = "answer", answer_tag: str | None = None, **kw) -> list[float]:
    """1.0 where the completion (or its <answer_tag> part) equals the record's `column` after
    normalisation (case, spaces, final punctuation), else 0.0."""
    out = []
    for c, want in zip(completions, kw[column]):
        got = answer_of(completion_text(c), answer_tag)
        out.append(float(got is not None and normalise(got) == normalise(want)))
    return out


def math_equal(completions, column: str = "answer", answer_tag: str | None = None, **kw) -> list[float]:
    """1.0 where the completion's final answer is mathematically equal to `column` (math-verify: numbers,
    fractions, LaTeX, sets), else 0.0."""
    out = []
    for c, want in zip(completions, kw[column]):
        got = answer_of(completion_text(c), answer_tag)
        gold = parse(str(want) if "$" in str(want) else f"${want}$")
        out.append(float(got is not None and bool(verify(gold, parse(got)))))
    return out


def regex(completions, pattern: str, **kw) -> list[float]:
    """1.0 where the whole completion (surrounding spaces aside) matches `pattern`, else 0.0: a format check."""
    rx = re.compile(pattern, flags=re.DOTALL)
    return [float(rx.fullmatch(completion_text(c).strip()) is not None) for c in completions]


def length_penalty(completions, max_chars: int = 200, **kw) -> list[float]:
    """0 up to `max_chars` characters, then falling linearly to -1 at twice that length (and staying there)."""
    return [-min(1.0, max(0, len(completion_text(c)) - max_chars) / max_chars) for c in completions]


BUILTINS: dict[str, Callable] = {
    "exact_match": exact_match,
    "math_equal": math_equal,
    "regex": regex,
    "length_penalty": length_penalty,
}


# ----------------------------------------------------------------------------- the user's own


def load_function(spec: RewardSpec, key: str) -> Callable:
    """The function a reward names: a built-in, `path/to/file.py:name`, or `package.module:name`."""
    if spec.function in BUILTINS:
        fn = BUILTINS[spec.function]
        return lambda **kw: fn(**kw, **spec.args)
    where, _, name = spec.function.rpartition(":")
    by_path = where.endswith(".py") or "/" in where
    if by_path and not Path(where).is_file():
        raise RecipeError(f"{key}: reward file {where} does not exist")
    try:
        if by_path:
            module_name = f"llm_forge_reward_{abs(hash(str(Path(where).resolve())))}"
            loader = importlib.util.spec_from_file_location(module_name, where)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ModuleNotFoundError as e:
        if not by_path and e.name and where.startswith(e.name):  # the module named, not one it imports
            raise RecipeError(f"{key}: cannot import {where!r} ({e})") from None
        raise RecipeError(f"{key}: importing {where} raised {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 (the user's module may raise anything on import)
        raise RecipeError(f"{key}: importing {where} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RecipeError(f"{key}: {where} has no function {name!r}")
    return fn


@dataclass
class Reward:
    name: str
    weight: float
    fn: Callable
    key: str  # rl.rewards[i], for messages


def load_rewards(cfg: RLSection) -> list[Reward]:
    return [
        Reward(s.name, s.weight, load_function(s, f"rl.rewards[{i}].function"), f"rl.rewards[{i}] ({s.name})")
        for i, s in enumerate(cfg.rewards)
    ]


def score(
    rewards: list[Reward], prompts: list, completions: list, completion_ids: list, columns: dict
) -> torch.Tensor:
    """[completions, functions] float64 rewards, each function's answers checked (RewardError)."""
    n = len(completions)
    out = torch.zeros(n, len(rewards), dtype=torch.float64)
    for j, r in enumerate(rewards):
        try:
            values = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # noqa: BLE001 (the user's function may raise anything)
            raise RewardError(f"{r.key} raised {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"{r.key} returned {type(values).__name__} ({values!r:.60}), not a list of numbers"
            ) from None
        if len(values) != n:
            raise RewardError(
                f"{r.key} returned {len(values)} values for {n} completions (one per completion)"
            )
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise RewardError(
                    f"{r.key} returned {v!r:.60} ({type(v).__name__}) for completion {i}, not a finite number"
                )
            out[i, j] = float(v)
    return out


def weights(rewards: list[Reward]) -> torch.Tensor:
    return torch.tensor([r.weight for r in rewards], dtype=torch.float64)
