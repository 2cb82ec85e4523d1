"""OpenEnv environments run unchanged (training/objectives/openenv.py): two environments written here as an
OpenEnv author writes them (an MCPEnvironment with a FastMCP server, and a plain Environment with its own
Action and Observation) give the tools' schemas, the calls' results and errors, the summed reward, `done`
ending the episode, and the seed's determinism; broken ones are refused (exit 2, naming rl.environment)."""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import threading
from pathlib import Path

import pytest
from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Action, Observation, State
from test_episodes import PROMPT, Scripted, runner, tok  # noqa: F401 (tok: the tokenizer fixture)

from training.config import RLSection
from training.core.errors import UserError, cli
from training.rl.build import environment_reward
from training.rl.episode import env_seed
from training.rl.openenv import observation_text
from training.rl.tools import call_tool, check_deterministic, environment_methods, load_environment

# ------------------------------------------------------------------ the environments, as OpenEnv authors write them


def _bundled(name: str):
    """A module of data/environments/ loaded by its path (the file the docs' OpenEnv walk-through trains)."""
    path = Path(__file__).resolve().parents[3] / "data/environments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_guess = _bundled("guess_openenv")  # a number-guessing game whose secret comes from the seed
GuessAction, GuessObservation, GuessNumber = _guess.GuessAction, _guess.GuessObservation, _guess.GuessNumber


class Calculator(MCPEnvironment):
    """Arithmetic through MCP tools; submitting the record's target ends the episode with reward 1."""

    def __init__(self):
        mcp = FastMCP("calculator")
        self.target, self.submitted = 0, None

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first.
                b: The second.
            """
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer.

            Args:
                answer: The answer.
            """
            self.submitted = answer
            return "submitted"

        super().__init__(mcp)
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, target=5, **kwargs) -> Observation:
        self.target, self.submitted = int(target), None
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(metadata={"status": "ready"})

    def step(self, action, timeout_s=None, **kwargs) -> Observation:
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and observation.error is None:
            observation.reward, observation.done = float(self.submitted == self.target), True
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


# ------------------------------------------------------------------ broken ones


class Unlucky(GuessNumber):
    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        raise RuntimeError("no dice")


class Toolless(Calculator):
    def __init__(self):
        MCPEnvironment.__init__(self, FastMCP("empty"))


class Unreachable(Calculator):
    async def _async_list_tools(self):
        raise ConnectionError("server down")


class Board:
    pass


class MoveAction(Action):
    board: Board


class Chess(GuessNumber):
    def step(self, action: MoveAction, timeout_s=None, **kwargs) -> GuessObservation:
        return GuessObservation()


def load(name: str):
    return load_environment(RLSection(environment=f"{__file__}:{name}", rewards=[]))


def call(tools, name: str, **arguments):
    return call_tool(tools, {"function": {"name": name, "arguments": arguments}}, 2000)


# ------------------------------------------------------------------ the tests


def test_a_plain_environment_is_one_tool_its_action_model():
    envs = load("GuessNumber")
    assert (envs.name, envs.owns_reward, envs.takes_seed) == ("GuessNumber", True, True)
    assert envs.schemas == [
        {
            "type": "function",
            "function": {
                "name": "guess",  # GuessAction, in snake case without `_action`
                "description": "Guess the secret number.",
                "parameters": {
                    "type": "object",
                    "properties": {"guess": {"type": "integer", "description": "Your guess, from 1 to 10"}},
                    "required": ["guess"],
                },
            },
        }
    ]
    env = envs.instance(0)
    assert envs.reset(env, {"prompt": PROMPT}, 11) == "\n\nI picked a number from 1 to 10."
    secret = random.Random(11).randint(1, 10)
    tools = environment_methods(env)
    assert sorted(tools) == ["guess"]
    wrong = secret % 10 + 1
    assert call(tools, "guess", guess=wrong) == (
        {"role": "tool", "name": "guess", "content": "Higher." if wrong < secret else "Lower."},
        False,
    )
    # arguments the Action refuses are a tool error, and the episode goes on
    message, failed = call(tools, "guess", guess="ten")
    assert failed and json.loads(message["content"])["error"].startswith(
        "invalid arguments for GuessAction: guess: Input should be a valid integer"
    )
    message, failed = call(tools, "guess", number=3)
    assert failed and "number: Extra inputs are not permitted" in message["content"]
    assert not env.done
    assert call(tools, "guess", guess=secret) == (
        {"role": "tool", "name": "guess", "content": "Right!"},
        False,
    )
    assert env.done and env.get_reward() == pytest.approx(0.0 - 0.1 + 1.0)  # reset's, the wrong and the right
    assert env.env.state.step_count == 2  # the refused arguments never reached step
    envs.reset(env, {}, 11)
    assert (env.done, env.get_reward()) == (False, 0.0)
    # two instances reset with one seed hold one secret; the start-up check agrees
    assert check_deterministic(envs, {}, 3) is None
    assert envs.instance(0).env._secret == envs.instance(1).env._secret == random.Random(3).randint(1, 10)


def test_an_observation_is_its_text_field_or_json_of_its_fields():
    class Two(Observation):
        board: str
        moves: int

    assert observation_text(GuessObservation(hint="Lower.", reward=2.0, metadata={"x": 1})) == "Lower."
    assert observation_text(Two(board="..x", moves=3, done=True)) == '{"board": "..x", "moves": 3}'
    assert observation_text(Observation(metadata={"status": "ready"})) == ""


def test_an_mcp_environment_s_tools_are_its_mcp_tools_called_through_step():
    envs = load("Calculator")
    assert [s["function"]["name"] for s in envs.schemas] == ["add", "submit"]
    add = envs.schemas[0]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "The first."},
        "b": {"type": "integer", "description": "The second."},
    }
    assert add["parameters"]["required"] == ["a", "b"]
    env = envs.instance(0)
    assert envs.reset(env, {"target": 7}, 0) is None  # an observation of metadata only adds nothing
    tools = environment_methods(env)
    threads = threading.active_count()
    for _ in range(5):
        assert call(tools, "add", a=2, b=5) == ({"role": "tool", "name": "add", "content": "7"}, False)
    # each step runs in its own asyncio loop, closed with the call; the one worker thread FastMCP ran the sync
    # tool in ends with it (it may still be exiting when step returns)
    for t in threading.enumerate():
        if t.name == "AnyIO worker thread":
            t.join(timeout=5)
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]
    message, failed = call(tools, "add", a="two", b=5)  # the MCP server refuses the arguments: a tool error
    assert failed and "validation error" in json.loads(message["content"])["error"]
    assert not env.done and env.get_reward() == 0.0
    assert call(tools, "submit", answer=7) == (
        {"role": "tool", "name": "submit", "content": "submitted"},
        False,
    )
    assert env.done and env.get_reward() == 1.0
    assert check_deterministic(envs, {"target": 7}, 0) is None


@pytest.mark.parametrize(
    "name, says",
    [
        ("Unlucky", "rl.environment (Unlucky): reset raised RuntimeError: no dice"),
        ("Toolless", "rl.environment (Toolless): its MCP server lists no tools"),
        (
            "Unreachable",
            "rl.environment (Unreachable): its MCP server failed to list its tools (server down)",
        ),
        (
            "Chess",
            "rl.environment (Chess): its action MoveAction has no JSON schema (PydanticInvalidForJsonSchema",
        ),
    ],
)
def test_a_broken_environment_is_refused_with_exit_2_naming_rl_environment(name, says, capsys, monkeypatch):
    # no root handler left by an earlier test's logging.basicConfig: bound to that test's captured stderr,
    # since closed, it would print a logging error (with a traceback) into this one's
    monkeypatch.setattr(logging.root, "handlers", [])

    @cli
    def start():
        envs = load(name)
        check_deterministic(envs, {}, 0)  # the start-up check resets

    with pytest.raises(SystemExit) as exit_:
        start()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {says}") and "Traceback" not in err


def test_a_plain_environment_without_an_action_model_is_refused(tmp_path):
    (tmp_path / "env.py").write_text(
        "from openenv.core.env_server.interfaces import Environment\n"
        "class Vague(Environment):\n"
        "    def reset(self, seed=None, episode_id=None, **kw): return None\n"
        "    def step(self, action, timeout_s=None, **kw): return None\n"
        "    state = None\n"
    )
    with pytest.raises(UserError, match=r"rl.environment \(Vague\): no Action model of its own was found"):
        load_environment(RLSection(environment=f"{tmp_path}/env.py:Vague", rewards=[]))


def test_an_episode_in_an_openenv_environment_ends_when_it_says_done(tok):  # noqa: F811
    """A wrong guess, the right one (done): the episode ends after its tool result, the policy's third reply is
    never asked for; the reward is the sum of the observations' rewards, named after the class."""
    envs = load("GuessNumber")
    secret = random.Random(env_seed(7, 1, 0)).randint(1, 10)  # the seed the episode's reset gets
    guess = '<tool_call>\n{{"name": "guess", "arguments": {{"guess": {}}}}}\n</tool_call>'
    sampler = Scripted(tok, [guess.format(secret % 10 + 1), guess.format(secret), "I won."])
    r = runner(tok, sampler, tools={}, envs=envs)
    r.schemas = envs.schemas
    (e,) = r.run(None, [(PROMPT, {}, 0)], step=1, n=1, device="cpu")
    prompt = tok.decode(e.prompt_ids)
    assert "What is 2 + 3?\n\nI picked a number from 1 to 10." in prompt and '"name": "guess"' in prompt
    assert [m["role"] for m in e.completion] == ["assistant", "tool", "assistant", "tool"]
    assert e.completion[2]["tool_calls"][0]["function"] == {"name": "guess", "arguments": {"guess": secret}}
    assert e.completion[3] == {"role": "tool", "name": "guess", "content": "Right!"}
    assert (e.turns, e.tool_calls, e.tool_errors, e.done) == (2, 2, 0, True)
    assert sampler.script == ["I won."] and e.policy[-1] == 0  # it ended on the tool result's tokens
    reward = environment_reward(envs)
    assert reward.name == "GuessNumber" and reward.fn(environments=[e.env]) == [pytest.approx(0.9)]
