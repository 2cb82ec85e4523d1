"""verifiers environments run unchanged: rl.environment: verifiers:ID (an installed environment package, what
`vf.load_environment(ID, **rl.environment_args)` loads) or verifiers:path/to/env.py (its load_environment).

verifiers 0.3.1 asks for mcp < 2, which the project's environment does not have (openenv-core's mcp 2.x), so the
environment runs in a Python of its own (`make verifiers` makes .venv-verifiers; LLM_FORGE_VERIFIERS_PYTHON names
another), as prime-rl runs environments in worker processes: training/rl/verifiers_worker.py, spoken to in JSON
lines. The trainer serves the policy it trains on 127.0.0.1 (training.generation.http_app: the OpenAI
chat-completions API, behind a fresh key, the live weights, LoRA included; started on the first round and kept)
and each round hands the worker the round's prompt rows; the environment's own loop runs each episode (its env_response, tools, stop conditions),
calling the policy through verifiers' OpenAI client, and its rubric scores the group. Each reward function of
the rubric is one of the run's rewards, logged by its name, weighted as the rubric weighs it.

The tokens that train are the tokens the policy produced: the server returns each call's prompt and completion
token ids (vLLM's return_token_ids), which the worker's client keeps (a reply verifiers then refuses, an empty
one, included); an episode is the first call's prompt, then each completion (policy: 1)
and what the environment added before the next call (0). Where the next call's prompt does not begin with the
previous call's tokens (the chat template re-tokenized a reply differently), the environment's part is taken
after the reply's end token in the re-rendered prompt, and the turn is counted (`retokenized_turns`; a warning
says how many). Keyed: every model call of an episode carries the seed of (the episode's key, its turn), the
episode's key being the single-turn key (seed, step, row, generation), so a group draws the same episodes
whatever runs beside it, on 1 or N processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from training.config import RLSection, verifiers_target
from training.core.errors import RecipeError
from training.generation import sample_seed
from training.generation.served import Served, context_length
from training.rl.episode import Episode
from training.rl.rewards import Reward

log = logging.getLogger(__name__)

PYTHON_ENV = "LLM_FORGE_VERIFIERS_PYTHON"
DEFAULT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-verifiers" / "bin" / "python"
WORKER = Path(__file__).with_name("verifiers_worker.py")
INSTALL = (
    "run `make verifiers` (a Python environment of its own, .venv-verifiers, with verifiers 0.3), or set "
    f"{PYTHON_ENV} to a Python that has verifiers"
)


def interpreter(key: str = "rl.environment") -> str:
    """The Python that runs verifiers environments: LLM_FORGE_VERIFIERS_PYTHON, else .venv-verifiers'."""
    python = os.environ.get(PYTHON_ENV) or str(DEFAULT_PYTHON)
    if not Path(python).exists():
        raise RecipeError(f"{key}: a verifiers environment needs verifiers in a Python of its own: {INSTALL}")
    return python


class Worker:
    """The worker process of one environment (see training/rl/verifiers_worker.py), loaded on start; `rewards`:
    the rubric's (name, weight) pairs."""

    def __init__(self, target: str, args: dict, key: str = "rl.environment"):
        self.key, self.target = key, target
        self.proc = subprocess.Popen(
            [interpreter(key), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lock = threading.Lock()
        loaded = self.ask({"op": "load", "env": target, "args": args})
        self.rewards: list[tuple[str, float]] = [(n, float(w)) for n, w in loaded["rewards"]]
        self.kind = loaded["class"]

    def ask(self, request: dict) -> dict:
        """The worker's answer to `request`; RecipeError naming rl.environment when it failed or died."""
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
        if not line:
            raise RecipeError(
                f"{self.key}: the verifiers worker of {self.target} stopped (exit code {self.proc.poll()}; its "
                "messages are above)"
            )
        reply = json.loads(line)
        if reply["ok"]:
            return reply
        if reply["kind"] == "missing":
            raise RecipeError(
                f"{self.key}: verifiers:{self.target} needs the module {reply['module']!r}, which the verifiers "
                f"Python ({interpreter(self.key)}) does not have: install the environment there "
                f"({interpreter(self.key)} -m pip install PACKAGE), or {INSTALL}"
            )
        raise RecipeError(f"{self.key}: verifiers:{self.target}: {reply['error']}")

    def rows(self, split: str = "train", n: int = -1) -> list[dict]:
        return self.ask({"op": "rows", "split": split, "n": n})["rows"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_worker(cfg: RLSection) -> Worker:
    return Worker(verifiers_target(cfg.environment), dict(cfg.environment_args))


@dataclass
class Outcome:
    """What the environment said of one episode: each rubric function's value (what the rewards read)."""

    metrics: dict


def rubric_rewards(worker: Worker) -> list[Reward]:
    """One reward per rubric function, its weight the rubric's (0: logged, not counted)."""

    def reads(name: str):
        return lambda environments, **kw: [e.metrics.get(name, 0.0) for e in environments]

    return [
        Reward(name, weight, reads(name), f"rl.environment ({worker.target}) rubric function {name}")
        for name, weight in worker.rewards
    ]


def episode_of(out: dict, eos: set[int]) -> tuple[Episode, int]:
    """The episode one worker answer describes (see the module doc), and how many turns were re-tokenized."""
    steps = list(out["steps"])
    while steps and steps[-1] is None:  # a last call that failed (its error ended the episode)
        steps.pop()
    if not steps or None in steps:
        raise RecipeError(
            "rl.environment: the verifiers environment made a model call whose token ids did not come back "
            "(it must call the policy through the client it is given)"
        )
    e = Episode(list(steps[0]["prompt_ids"]), [], {}, Outcome(out["metrics"]))
    retokenized = 0
    for i, s in enumerate(steps):
        if i > 0:
            added, changed = environment_part(
                e.prompt_ids + e.tokens, s["prompt_ids"], len(steps[i - 1]["prompt_ids"]), eos
            )
            retokenized += changed
            e.tokens += added
            e.policy += [0] * len(added)
        e.tokens += s["completion_ids"]
        e.policy += [1] * len(s["completion_ids"])
    e.turns = len(steps)
    e.ended = bool(steps[-1]["completion_ids"]) and steps[-1]["completion_ids"][-1] in eos
    e.completion = out["completion"]
    e.done = True
    return e, retokenized


def environment_part(
    before: list[int], prompt: list[int], start: int, eos: set[int]
) -> tuple[list[int], int]:
    """(the tokens the environment added after `before` in the next call's `prompt`, 1 if the reply in it was
    re-tokenized else 0): the part after `before` where the prompt begins with it, else the part after the
    reply's end token: the first end token from `start`, where the reply begins (the previous call's prompt
    length; the template adds an end token after a reply cut at max_tokens)."""
    if prompt[: len(before)] == before:
        return prompt[len(before) :], 0
    ended = before[-1] in eos
    cut = next((i for i in range(start, len(prompt)) if prompt[i] in eos), len(prompt))
    return prompt[cut + int(ended) :], 1


@dataclass
class VerifiersRunner:
    """Runs a micro-batch's episodes in the verifiers environment, drawing from the policy served on loopback
    (see the module doc). The same `run` as EpisodeRunner's."""

    worker: Worker
    tokenizer: object
    cfg: RLSection
    seed: int
    eos_ids: list[int]
    template_kwargs: dict
    seconds: float = 0.0
    retokenized: int = 0
    environments: object = None  # EpisodeRunner's: no environment instances of ours
    server: contextlib.ExitStack = field(
        default_factory=contextlib.ExitStack
    )  # the loopback server, once started
    served: tuple | None = None  # (the model it serves, base URL, key)
    calls_of: object = field(default=lambda n: n)

    def run(self, model, groups: list, step: int, n: int, device, greedy: bool = False) -> list[Episode]:
        """The episodes of each (prompt messages, columns, row key) group: n each (1 when greedy), in order."""
        g = 1 if greedy else n
        request = {
            "op": "run",
            "model": "policy",
            "sampling": self.sampling(greedy),
            "groups": [
                {
                    "input": rollout_input(msgs, cols, row),
                    "keys": [sample_seed(self.seed, step, row, j) for j in range(g)],
                }
                for msgs, cols, row in groups
            ],
        }
        start = time.perf_counter()
        url, key = self.endpoint(model)
        training = model.training
        model.eval()
        try:
            answer = self.worker.ask({**request, "base_url": url, "api_key": key})
        finally:
            model.train(training)
        self.seconds = time.perf_counter() - start
        outs = [out for grp in answer["groups"] for out in grp]
        check_errors(outs, self.worker.target)
        episodes, changed = [], 0
        for out in outs:
            e, c = episode_of(out, set(self.eos_ids))
            episodes.append(e)
            changed += c
        if changed:
            (log.warning if not self.retokenized else log.info)(
                "rl.environment: %d turn(s) of this round's episodes came back re-tokenized by the chat template "
                "(a reply's tokens in the next prompt differ from those the policy drew); the tokens drawn train",
                changed,
            )
        self.retokenized += changed
        return episodes

    def probe(self, model, start: tuple) -> None:
        """One sampled episode of `start` (the first prompt's (messages, columns, key "check", which no training
        rollout has)) before training, so what cannot run here (a service out of reach, a call without token ids)
        is refused before step 1 where that episode meets it."""
        self.run(model, [start], 0, 1, None)
        log.info(
            "rl.environment: one episode of the first prompt ran in %.1f s (the check before training)",
            self.seconds,
        )

    def endpoint(self, model) -> tuple[str, str]:
        """(base URL, key) of `model` served on 127.0.0.1: started on the first round and kept for the next ones
        (the same live weights; one server, and its draw thread, per policy, not per round)."""
        if self.served is None or self.served[0] is not model:
            self.server.close()
            served = Served(
                "policy",
                "the policy in training",
                model,
                self.tokenizer,
                threading.Lock(),
                adapter=policy_adapter(model),
                template_kwargs=dict(self.template_kwargs),
                context=context_length(model, self.tokenizer),
            )
            # the HTTP stack (FastAPI, uvicorn) is imported only by a run whose environment calls the model over it
            from training.generation.http_app import serving

            self.served = (model, *self.server.enter_context(serving({"policy": served})))
        return self.served[1], self.served[2]

    def sampling(self, greedy: bool) -> dict:
        return {
            "temperature": 0.0 if greedy else self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "max_tokens": self.cfg.max_new_tokens,
        }


def policy_adapter(model) -> str | None:
    """The adapter a LoRA policy generates with (its active one): served without a name, a peft model's adapters
    are disabled and the base would draw every episode."""
    return model.active_adapter if hasattr(model, "peft_config") else None


def check_errors(outs: list[dict], target: str) -> None:
    """Episodes that ended in an error of the environment's (not the policy's: an empty reply, a bad tool call,
    which train as they ended): all of a round's raise RecipeError (it cannot run here, e.g. a service it needs
    is out of reach); some, a warning with the count and the first."""
    errors = [o["error"] for o in outs if o.get("error") and not o.get("policy_error")]
    if errors and len(errors) == len(outs):
        raise RecipeError(
            f"rl.environment: every episode of verifiers:{target} ended in an error: {errors[0]}"
        )
    if errors:
        log.warning(
            "rl.environment: %d of %d episodes ended in an error of the environment's, e.g. %s",
            len(errors),
            len(outs),
            errors[0],
        )


def rollout_input(messages: list[dict], columns: dict, row) -> dict:
    """A verifiers RolloutInput of one prompt record: its messages, answer, info and task."""
    out = {"prompt": messages, "example_id": row if isinstance(row, int) else str(row)}
    for k in ("answer", "info", "task"):
        if columns.get(k) is not None:
            out[k] = columns[k]
    return out
