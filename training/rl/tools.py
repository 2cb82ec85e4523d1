"""Tools and environments of agent episodes (rl.tools, rl.environment).

Tools are plain Python functions, named like reward functions (`path/to/file.py:name`, `package.module:name`)
or the built-in `python` (training.rl.sandbox). Their JSON schema, which the chat template puts in the
prompt, comes from their signature and docstring (transformers' `get_json_schema`), as in TRL and transformers'
tool use. A call is executed with the arguments the model wrote; whatever happens (an unknown tool, bad
arguments, an exception) the episode gets a `tool` message back, as TRL does, and the run goes on. A call
counts as a tool error (the `tool_errors` metric) when it raised, or its result is text whose last line starts
with `error:`, or a dict with an `error` key.

An environment is TRL's `environment_factory` contract, so an environment written for TRL runs unchanged: a
class (or a function returning an instance) with
  reset(**columns) -> str | None   called before each episode with the prompt record's columns (and `seed`
                                   where reset takes one); a string is appended to the last user message
  public methods                   the episode's tools, bound to its own instance (state across turns)
  get_reward() -> float            optional: the environment's own reward of the finished episode, added as
                                   one more reward (weight 1, named after the class)
  done                             optional attribute, read after each reply's tool calls: True ends the
                                   episode after those results (no more replies)
Instances are made once and reset for each episode (one per episode of a micro-batch), as TRL pools them.
An OpenEnv environment (a subclass of openenv's Environment, MCP or plain; the `envs` extra) runs unchanged
too: it is recognised by its class and wrapped in one that presents this contract (training.rl.openenv).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers.utils import get_json_schema

from training.config import RLSection
from training.core.errors import RecipeError, UserError
from training.rl import openenv
from training.rl.code_refs import accepted, import_code
from training.rl.sandbox import Sandbox, make_python_tool

log = logging.getLogger(__name__)

BUILTIN_TOOLS = ("python",)
NOT_TOOLS = ("reset", "get_reward")


class EnvironmentFailed(UserError):
    """An environment's reset or reward failed (exit code 2, named)."""


def schema_of(fn: Callable, key: str) -> dict:
    """The tool's JSON schema from its signature and docstring; RecipeError naming `key` where it has none."""
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 (transformers raises several kinds for a docstring it cannot read)
        raise RecipeError(
            f"{key}: tool {getattr(fn, '__name__', fn)!r} has no usable JSON schema ({e}); give it type hints and "
            "a Google-style docstring with an Args: section, as transformers' get_json_schema reads them"
        ) from None


def load_tools(cfg: RLSection) -> tuple[dict[str, Callable], list[dict]]:
    """(rl.tools by name: the built-in `python` and the user's functions, their JSON schemas)."""
    out, schemas = {}, []
    for i, ref in enumerate(cfg.tools):
        key = f"rl.tools[{i}]"
        if ref == "python":
            fn = make_python_tool(Sandbox(cfg.tool_timeout_s, cfg.tool_output_chars))
        else:
            fn = import_code(ref, key, "tool")
        name = getattr(fn, "__name__", ref)
        if name in out:
            raise RecipeError(f"{key}: two tools are named {name!r}; the model calls tools by name")
        schemas.append(schema_of(fn, key))
        out[name] = fn
    return out, schemas


def environment_methods(instance) -> dict[str, Callable]:
    """An environment instance's tools: its class's public functions other than reset and get_reward (listed on
    the class, as TRL does, so properties are not evaluated)."""
    return {
        name: getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    }


@dataclass
class Environments:
    """rl.environment: the factory, its pool of instances, and what the probe instance showed."""

    factory: Callable
    name: str
    owns_reward: bool
    takes_seed: bool
    schemas: list[dict]  # of its tool methods
    pool: list = field(default_factory=list)

    def instance(self, k: int):
        """The k-th instance of this micro-batch's episodes (made on first use, reused afterwards)."""
        while len(self.pool) <= k:
            self.pool.append(make_instance(self.factory, self.name))
        return self.pool[k]

    def reset(self, env, columns: dict, seed: int) -> str | None:
        kwargs = dict(columns)
        if self.takes_seed:
            kwargs["seed"] = seed
        try:
            observation = env.reset(**accepted(env.reset, kwargs))
        except Exception as e:  # noqa: BLE001 (the user's environment may raise anything)
            raise EnvironmentFailed(
                f"rl.environment ({self.name}): reset raised {type(e).__name__}: {e}"
            ) from None
        if observation is not None and not isinstance(observation, str):
            raise EnvironmentFailed(
                f"rl.environment ({self.name}): reset returned {type(observation).__name__}, not a string or None"
            )
        return observation


def make_instance(factory: Callable, name: str):
    try:
        return factory()
    except Exception as e:  # noqa: BLE001
        raise RecipeError(f"rl.environment: making {name} raised {type(e).__name__}: {e}") from None


def load_environment(cfg: RLSection) -> Environments | None:
    """rl.environment, probed: it has a callable reset, and every tool method has a schema."""
    if cfg.environment is None:
        return None
    factory = import_code(cfg.environment, "rl.environment", "environment", "class or function")
    name = getattr(factory, "__name__", cfg.environment)
    probe = make_instance(factory, name)
    if openenv.is_openenv(probe):  # an OpenEnv environment, run unchanged behind the wrapper
        factory, probe, schemas = openenv.adapt(factory, probe, name)
        return Environments(factory, name, True, True, schemas, pool=[probe])
    if not callable(getattr(probe, "reset", None)):
        raise RecipeError(
            f"rl.environment: {name} has no reset method (an environment defines reset(**columns) -> str | None, "
            "TRL's environment_factory contract)"
        )
    schemas = [schema_of(method, "rl.environment") for method in environment_methods(probe).values()]
    takes_seed = "seed" in inspect.signature(probe.reset).parameters
    owns = callable(getattr(probe, "get_reward", None))
    return Environments(factory, name, owns, takes_seed, schemas, pool=[probe])


def check_deterministic(envs: Environments, columns: dict, seed: int) -> str | None:
    """A warning where two resets with one seed and one record give different observations (the episodes a
    resumed or multi-process run draws would then differ); None where they agree."""
    first, second = envs.instance(0), envs.instance(1)
    a, b = envs.reset(first, columns, seed), envs.reset(second, columns, seed)
    if a == b:
        return None
    return (
        f"rl.environment ({envs.name}) is not deterministic under its seed: two resets of the first prompt with seed "
        f"{seed} gave different observations ({a!r:.60} and {b!r:.60}); {'' if envs.takes_seed else 'its reset takes no seed, so '}"
        "a resumed run, or one on more processes, will not draw the same episodes"
    )


def tool_message(name: str, result, output_chars: int) -> dict:
    content = result if isinstance(result, str) else json.dumps(result, default=str, ensure_ascii=False)
    if len(content) > output_chars:
        content = content[:output_chars] + f"\n[output cut at {output_chars} characters]"
    return {"role": "tool", "name": name, "content": content}


def call_tool(tools: dict[str, Callable], call: dict, output_chars: int) -> tuple[dict, bool]:
    """(the tool message answering `call`, whether it failed); never raises."""
    fn_call = call.get("function") or {}
    name = str(fn_call.get("name", "unknown"))
    arguments = fn_call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return tool_message(
                name, {"error": f"arguments are not JSON: {arguments!r:.80}"}, output_chars
            ), True
    if name not in tools:
        return tool_message(
            name, {"error": f"unknown tool {name!r}; the tools are {sorted(tools)}"}, output_chars
        ), True
    if not isinstance(arguments, dict):
        return tool_message(name, {"error": "arguments must be a JSON object"}, output_chars), True
    try:
        result = tools[name](**arguments)
    except Exception as e:  # noqa: BLE001 (the user's tool may raise anything; the episode sees it)
        return tool_message(name, {"error": f"{type(e).__name__}: {e}"}, output_chars), True
    return tool_message(name, result, output_chars), reports_error(result)


def reports_error(result) -> bool:
    """A tool's result that says it failed: text whose last line starts with `error:` (as the python tool and
    data/agent/task.py:calculate answer), or a dict with an `error` key."""
    if isinstance(result, dict):
        return "error" in result
    lines = str(result).strip().splitlines()
    return bool(lines) and lines[-1].startswith("error:")
