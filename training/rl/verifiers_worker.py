"""The worker that runs a verifiers environment for the trainer, in the interpreter that has verifiers (0.3, its
classic `import verifiers as vf` API: SingleTurnEnv, MultiTurnEnv, ToolEnv and their rubrics). verifiers 0.3.1
asks for mcp < 2, which the project's environment (openenv-core's mcp 2.x) does not have, so the trainer starts this file with
another Python (training/rl/verifiers_env.py) and talks to it in JSON lines over stdin/stdout; nothing here
imports the project.

Requests, one JSON object a line, each answered by one line {"ok": true, ...} or {"ok": false, "error": ...,
"kind": ...}:
  {"op": "load", "env": ID_OR_FILE, "args": {...}}   vf.load_environment(ID, **args) for an installed
      environment, or the file's load_environment(**args); answers the rubric's reward functions and weights
  {"op": "rows", "split": "train" | "eval", "n": N}   the environment's dataset rows (prompt messages, answer,
      info, task, example_id), N of them (-1: all)
  {"op": "run", "base_url": URL, "model": NAME, "sampling": {...}, "groups": [{"input": ROW, "keys": [K...]}]}
      each group's episodes (one per key) by the environment's own rollout loop, calling the model at URL, then
      scored by its rubric as a group; answers per episode its reward, each reward function's value, the
      completion messages, the token ids of each model call (prompt, completion) and any error
Each model call of an episode carries the seed (key, turn) (`KeyedClient`): the same key draws the same
episode, whatever else runs beside it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

PROTOCOL = sys.stdout  # the trainer reads this; anything the environment prints goes to stderr
sys.stdout = sys.stderr


def turn_seed(key: int, turn: int) -> int:
    """The seed of an episode's model call number `turn`: a hash of both, below 2**63."""
    digest = hashlib.blake2b(f"{key}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def keyed_client(config, key: int):
    """A verifiers chat-completions client whose every request carries the seed of (key, its turn) and asks for
    the token ids, which it keeps in `calls` (every model call's, a reply verifiers then refuses included)."""
    from verifiers.clients import OpenAIChatCompletionsClient

    class KeyedClient(OpenAIChatCompletionsClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls: list[dict] = []

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            extra = {**(sampling_args.get("extra_body") or {}), "return_token_ids": True}
            seeded = {**sampling_args, "seed": turn_seed(key, len(self.calls)), "extra_body": extra}
            self.calls.append({})  # the turn is taken even where the call fails
            response = await super().get_native_response(prompt, model, seeded, tools=tools, **kwargs)
            extra_of = lambda o: getattr(o, "model_extra", None) or {}  # noqa: E731
            self.calls[-1] = {
                "prompt_ids": extra_of(response).get("prompt_token_ids"),
                "completion_ids": extra_of(response.choices[0]).get("token_ids"),
            }
            return response

    return KeyedClient(config)


def load(env: str, args: dict):
    import verifiers as vf

    if env.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(env).stem, env)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        if not callable(getattr(module, "load_environment", None)):
            raise LookupError(f"{env} defines no load_environment(**args)")
        loaded = module.load_environment(**args)
    else:
        loaded = vf.load_environment(env, **args)
    if not isinstance(loaded, vf.Environment):
        raise TypeError(f"load_environment returned {type(loaded).__name__}, not a verifiers Environment")
    return loaded


def jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return json.loads(json.dumps(value, default=lambda o: getattr(o, "model_dump", lambda: str(o))()))


def rows(env, split: str, n: int) -> list[dict]:
    ds = env.get_dataset(n=n) if split == "train" else env.get_eval_dataset(n=n)
    keep = ("prompt", "answer", "info", "task", "example_id")
    return [{k: jsonable(r[k]) for k in keep if k in r} for r in ds]


def blames_the_policy(error) -> bool:
    """An error of the policy's making (an empty or unparsable reply, a bad tool call, a prompt grown too long):
    the episode ends there and trains as it ended; any other (a sandbox, a tunnel, a service) is the environment's."""
    import verifiers as vf

    return isinstance(error, (vf.InvalidModelResponseError, vf.ToolError, vf.OverlongPromptError))


def episode(state, calls: list[dict]) -> dict:
    error = state.get("error")
    return {
        "policy_error": error is not None and blames_the_policy(error),
        "reward": float(state.get("reward") or 0.0),
        "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items()},
        "completion": jsonable(state.get("completion") or []),
        "steps": [
            c if c.get("prompt_ids") is not None and c.get("completion_ids") is not None else None
            for c in calls
        ],
        "truncated": bool(state.get("is_truncated")),
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }


async def run(env, request: dict) -> list[list[dict]]:
    from verifiers.types import ClientConfig

    os.environ["LLM_FORGE_API_KEY"] = request.get("api_key") or "none"
    config = ClientConfig(api_base_url=request["base_url"], api_key_var="LLM_FORGE_API_KEY", max_retries=0)
    sampling = request["sampling"]

    async def group(g: dict) -> list[dict]:
        clients = [keyed_client(config, k) for k in g["keys"]]
        states = await asyncio.gather(
            *(env.rollout(dict(g["input"]), c, request["model"], sampling) for c in clients)
        )
        if env.score_rollouts:
            await env.rubric.score_group(list(states))
        else:
            await env.rubric.dummy_score_group(list(states))
        for s in states:
            await env.rubric.cleanup(s)
        return [episode(s, c.calls) for s, c in zip(states, clients)]

    return list(await asyncio.gather(*(group(g) for g in request["groups"])))


def answer(request: dict, state: dict) -> dict:
    op = request.get("op")
    if op == "load":
        env = state["env"] = load(request["env"], request.get("args") or {})
        rubric = env.rubric
        names = list(rubric._get_reward_func_names())
        weights = [float(w) for w in rubric._get_reward_weights()]
        return {"rewards": list(zip(names, weights)), "class": type(env).__name__}
    if op == "rows":
        return {"rows": rows(state["env"], request["split"], int(request.get("n", -1)))}
    if op == "run":
        return {"groups": asyncio.run(run(state["env"], request))}
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    state: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": True, **answer(request, state)}
        except ModuleNotFoundError as e:
            reply = {"ok": False, "kind": "missing", "error": str(e), "module": e.name}
        except Exception as e:
            traceback.print_exc()
            reply = {"ok": False, "kind": type(e).__name__, "error": f"{type(e).__name__}: {e}"}
        PROTOCOL.write(json.dumps(reply) + "\n")
        PROTOCOL.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
