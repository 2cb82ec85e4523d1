"""OpenEnv environments (openenv-core 0.3, the `envs` extra) run unchanged, in-process, behind our contract.

`rl.environment` may name an OpenEnv server-side environment, a subclass of openenv's `Environment`
(reset(seed, episode_id, **kwargs) -> Observation, step(action) -> Observation, `state`). tools.py
recognises it by its class (nothing imports openenv unless the user's module did) and wraps it in a class
of this module that presents TRL's environment_factory contract:
  reset(seed, **columns)  its reset, given the seed and the columns it takes (Environments.reset's rule);
                          the observation as text after a blank line, None when empty
  tools                   an MCPEnvironment (OpenEnv's standard for tools): its MCP tools, listed by
                          step(ListToolsAction()), a call being step(CallToolAction(...)), an `error` a
                          tool error. Another: one tool, its Action model's fields but metadata, named after
                          the class in snake case without `_action` (GuessAction -> guess), its docstring
                          the description; a call validates the arguments (invalid: a tool error) and steps
  get_reward()            the sum of the rewards of the episode's observations (reset's and each step's), 0
                          when none had one
  done                    set once an observation says done: the episode ends after that reply's results
  env                     the OpenEnv instance (reward functions get the episodes' wrappers)
An observation as text: its fields but done, reward and metadata; a single text field as itself, else JSON.
An MCP step runs FastMCP's client in an asyncio loop of its own, closed when the call returns (openenv's
run_async_safely); no loop or thread outlives the call.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import sys
import typing
import warnings
from collections.abc import Callable

from training.core.errors import RecipeError
from training.rl.code_refs import accepted

INTERFACES = "openenv.core.env_server.interfaces"
MCP = "openenv.core.env_server.mcp_environment"
TAKEN = ("reset", "get_reward", "done", "env")  # the wrapper's own names: no tool may take one


def is_openenv(instance, mcp: bool = False) -> bool:
    """`instance` is an OpenEnv environment (an MCPEnvironment with `mcp`), without importing openenv: the
    user's module imported it where its class comes from it."""
    module, name = (MCP, "MCPEnvironment") if mcp else (INTERFACES, "Environment")
    base = getattr(sys.modules.get(module), name, None)
    return isinstance(base, type) and isinstance(instance, base)


class OpenEnvEpisode:
    """One OpenEnv environment instance behind our contract (see the module doc); `adapt` adds the tools."""

    def __init__(self, env):
        self.env, self.done, self._rewards = env, False, []

    def reset(self, seed: int | None = None, **columns) -> str | None:
        self.done, self._rewards = False, []
        text = self._saw(self.env.reset(**accepted(self.env.reset, {"seed": seed, **columns})))
        return "\n\n" + text if text else None

    def get_reward(self) -> float:
        return float(sum(self._rewards))

    def _saw(self, observation) -> str:
        """Keeps the observation's reward and done; its text."""
        reward = getattr(observation, "reward", None)
        if reward is not None:
            self._rewards.append(float(reward))
        self.done = self.done or getattr(observation, "done", False) is True
        return observation_text(observation)

    def _call(self, tool: str, arguments: dict):
        from openenv.core.env_server.mcp_types import CallToolAction

        observation = self.env.step(CallToolAction(tool_name=tool, arguments=arguments))
        self._saw(observation)
        if (error := getattr(observation, "error", None)) is not None:
            return {"error": getattr(error, "message", str(error))}
        return mcp_result(getattr(observation, "result", observation))

    def _act(self, action_class, arguments: dict):
        from pydantic import ValidationError

        try:
            action = action_class.model_validate(arguments)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, p['loc'])) or 'arguments'}: {p['msg']}" for p in e.errors()
            )
            return {"error": f"invalid arguments for {action_class.__name__}: {problems}"}
        return self._saw(self.env.step(action))


def observation_text(observation) -> str:
    if observation is None or isinstance(observation, str):
        return observation or ""
    dump = getattr(observation, "model_dump", None)
    fields = dump(exclude={"done", "reward", "metadata"}) if callable(dump) else {"observation": observation}
    if len(fields) == 1 and isinstance(only := next(iter(fields.values())), str):
        return only
    return json.dumps(fields, default=str, ensure_ascii=False) if fields else ""


def mcp_result(result):
    """An MCP tool's result (CallToolResult): its text content, else its structured content."""
    texts = [
        c.text for c in getattr(result, "content", None) or () if isinstance(getattr(c, "text", None), str)
    ]
    text = "\n".join(texts) if texts else None
    if getattr(result, "is_error", False):
        return {"error": text or "the tool reported an error"}
    if text is not None:
        return text
    return getattr(result, "structured_content", None) if hasattr(result, "content") else result


def tool_method(tool: str, run: Callable, *args) -> Callable:
    """A method named `tool` that answers a call with run(self, *args, arguments)."""

    def method(self, **arguments):
        return run(self, *args, arguments)

    method.__name__ = method.__qualname__ = tool
    return method


def adapt(factory: Callable, probe, name: str) -> tuple[Callable, OpenEnvEpisode, list[dict]]:
    """(a factory of wrapped instances, the probe wrapped, the tools' schemas); RecipeError naming
    rl.environment where the tools cannot be had."""
    if is_openenv(probe, mcp=True):
        schemas = mcp_schemas(probe, name)
        runs = {s["function"]["name"]: (OpenEnvEpisode._call, s["function"]["name"]) for s in schemas}
    else:
        action = action_class(probe, name)
        schemas = [action_schema(action, name)]
        runs = {schemas[0]["function"]["name"]: (OpenEnvEpisode._act, action)}
    for tool in runs:
        if tool in TAKEN or tool.startswith("_"):
            raise RecipeError(
                f"rl.environment ({name}): its tool {tool!r} takes a name the episodes use themselves "
                f"({', '.join(TAKEN)}, or a leading _)"
            )
    methods = {tool: tool_method(tool, *run) for tool, run in runs.items()}
    wrapper = type(name, (OpenEnvEpisode,), {"__doc__": f"{name}, an OpenEnv environment", **methods})
    return (lambda: wrapper(factory())), wrapper(probe), schemas


def mcp_schemas(env, name: str) -> list[dict]:
    """The chat-template schemas of an MCP environment's tools (step(ListToolsAction()))."""
    from openenv.core.env_server.mcp_types import ListToolsAction

    # a failing call comes back to the episode as a tool message: FastMCP's own log of it (a traceback per
    # call) would flood the run's log
    logging.getLogger("fastmcp.server.server").setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():  # openenv 0.3 reads FastMCP's deprecated Tool.inputSchema
            warnings.simplefilter("ignore", DeprecationWarning)
            listed = env.step(ListToolsAction())
    except Exception as e:  # noqa: BLE001 (the user's environment may raise anything)
        raise RecipeError(
            f"rl.environment ({name}): listing its MCP tools raised {type(e).__name__}: {e}"
        ) from None
    failed = (getattr(listed, "metadata", None) or {}).get("error")
    if failed or not getattr(listed, "tools", None):
        raise RecipeError(
            f"rl.environment ({name}): its MCP server "
            + (f"failed to list its tools ({failed})" if failed else "lists no tools")
            + "; an episode's policy acts through them"
        )
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema or {"type": "object", "properties": {}},
            },
        }
        for t in listed.tools
    ]


def action_class(env, name: str):
    """The Action model of a plain environment: the annotation of step's `action`, else the class's
    Environment[Action, ...] parameter."""
    from openenv.core.env_server.types import Action

    try:
        hints = [typing.get_type_hints(type(env).step).get("action")]
    except Exception:  # noqa: BLE001 (an annotation that does not resolve: the generic parameters decide)
        hints = []
    for cls in type(env).__mro__:
        hints += [arg for base in getattr(cls, "__orig_bases__", ()) for arg in typing.get_args(base)]
    for hint in hints:
        if isinstance(hint, type) and issubclass(hint, Action) and hint is not Action:
            return hint
    raise RecipeError(
        f"rl.environment ({name}): no Action model of its own was found (annotate step's `action` with "
        "your Action subclass, or subclass Environment[YourAction, YourObservation, YourState]); the "
        "policy's tool is that model"
    )


def action_schema(action, name: str) -> dict:
    """The Action model as one tool: its JSON schema but `metadata`, named and described after the class."""
    try:
        schema = action.model_json_schema()
    except Exception as e:  # noqa: BLE001 (pydantic refuses fields it cannot describe, several ways)
        raise RecipeError(
            f"rl.environment ({name}): its action {action.__name__} has no JSON schema ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}); the policy's tool is that schema, so its fields need types pydantic "
            "can describe"
        ) from None
    properties = {
        k: {a: b for a, b in v.items() if a != "title"}
        for k, v in schema.get("properties", {}).items()
        if k != "metadata"
    }
    parameters = {"type": "object", "properties": properties}
    if required := [r for r in schema.get("required", []) if r != "metadata"]:
        parameters["required"] = required
    if "$defs" in schema:
        parameters["$defs"] = schema["$defs"]
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", action.__name__).lower()
    tool = snake.removesuffix("_action")
    tool = snake if tool in TAKEN else tool  # ResetAction: reset_action
    doc = inspect.cleandoc(action.__doc__) if action.__doc__ else f"Act in the {name} environment."
    return {"type": "function", "function": {"name": tool, "description": doc, "parameters": parameters}}
