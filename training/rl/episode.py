"""Agent episodes: rollouts of several turns, where the policy calls tools or acts in an environment.

An episode starts from the prompt (rendered with the chat template, the tools' schemas in it, and the
environment's first observation appended to the last user message). Each turn the policy generates an
assistant reply; its tool calls are read in the chat template's own format (training.data.turns.parse_reply:
the tokenizer's response template where it has one, else the Hermes/Qwen <tool_call> tags), each call is
executed (training.rl.tools) and the results appended as `tool` messages, whose tokens are the chat
template's rendering of them after the reply's end-of-turn token (TRL's `_get_tool_suffix_ids`). The episode
ends on a reply without a call, after rl.max_turns replies, when the next tokens would pass rl.max_new_tokens,
the budget of everything after the prompt (policy and tool tokens, as TRL's max_completion_length), or after the
tool results of a reply that left the environment's `done` attribute True.

Only the policy's tokens carry loss: `policy` marks them (1) against the tool results and the template's
turn headers (0), and the objective's mask is that. Sampling is keyed: turn 0 of generation g of a prompt
is the single-turn key (seed, step, row, g), so an episode that makes no call is exactly today's completion;
turn t > 0 is keyed (seed, step, row, g, t); an environment's reset gets the seed of (seed, step, row), the same
for the group's episodes, which start from one state.

Each turn is one batch: every episode still going has its next reply drawn in one engine call (the prompts'
first replies, then each later turn's), each request with its own key and its own budget, so an episode
draws what it would alone. The tools of a turn run between its batches. The engine keeps each turn's keys
and values for the next (a `PrefixStore` per run), so a later turn feeds only the reply's last token and the
tool results, not the whole context again (training/generation/prefix_cache.py). Under ZeRO-3/FSDP every rank runs
as many engine calls as the others (an `idle` one where it has no episode still going).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

from training.core.errors import UserError
from training.data.turns import parse_reply
from training.generation import Engine, PrefixStore, Request, sample_seed
from training.rl.tools import Environments, call_tool, environment_methods

TOOL_WORKERS = 32  # episodes whose tools run at once
ANSWER_POLL_S = 0.005  # how often continuous batching's results are looked at while tools run


@dataclass
class Episode:
    """One rollout of several turns: the prompt's ids, then every token after it (`policy` 1 where the policy
    wrote it), the completion as messages (assistant replies and tool results) and its counts."""

    prompt_ids: list[int]
    messages: list[dict]  # the prompt's messages (with the observation): the context of the tool suffixes
    tools: dict[str, Callable]
    env: object | None = None
    tokens: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)
    completion: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    ended: bool = False  # the last reply closed with an end-of-sequence token
    done: bool = False

    @property
    def policy_tokens(self) -> int:
        return sum(self.policy)


@dataclass
class EpisodeRunner:
    """Runs the episodes of a micro-batch of prompts turn by turn (see the module doc)."""

    engine: Engine
    tokenizer: object
    tools: dict[str, Callable]  # rl.tools
    environments: Environments | None
    max_turns: int
    budget: int  # rl.max_new_tokens
    output_chars: int
    template_kwargs: dict
    schemas: list[dict]
    calls_of: Callable[[int], int]  # this rank's generate calls -> every rank's (the max, when synced)
    seconds: float = 0.0

    def render(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=self.schemas or None,
            add_generation_prompt=True,
            tokenize=False,
            **self.template_kwargs,
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def start(self, messages: list[dict], columns: dict, key_seed: int, k: int) -> Episode:
        """Episode k of the micro-batch: its environment instance reset, its prompt rendered."""
        tools, env = dict(self.tools), None
        if self.environments is not None:
            env = self.environments.instance(k)
            observation = self.environments.reset(env, columns, key_seed)
            tools |= environment_methods(env)
            if observation is not None:
                last = messages[-1]
                messages = [*messages[:-1], {**last, "content": (last.get("content") or "") + observation}]
        return Episode(self.render(messages), messages, tools, env)

    def run(
        self, model, groups: list[tuple[list[dict], dict, int | str]], step: int, n: int, device, greedy=False
    ):
        """The episodes of each (prompt messages, columns, row key) group: n each (1 when greedy), in order."""
        g = 1 if greedy else n
        seed = self.engine.seed
        episodes = [
            [self.start(msgs, cols, env_seed(seed, step, row), i * g + j) for j in range(g)]
            for i, (msgs, cols, row) in enumerate(groups)
        ]
        keys = [row for *_, row in groups]
        every = [(keys[i], j, e) for i, grp in enumerate(episodes) for j, e in enumerate(grp)]
        start = time.perf_counter()
        # each episode's tools run on a worker of their own, so no episode's tools wait for another's
        with ThreadPoolExecutor(min(TOOL_WORKERS, len(every)), thread_name_prefix="episode-tools") as tools:
            if hasattr(self.engine, "stream"):  # continuous batching: no episode waits for the others' turns
                self.run_continuous(model, every, step, greedy, tools)
            else:
                self.run_turns(model, every, step, device, greedy, tools)
        self.seconds = time.perf_counter() - start
        return [e for grp in episodes for e in grp]

    def run_turns(self, model, every: list, step: int, device, greedy: bool, tools: Executor) -> None:
        """Every (row key, generation, episode) to its end, turn by turn: each turn one engine call."""
        prefixes = PrefixStore()  # each turn's keys and values, for the next
        for _ in range(self.max_turns):
            going = [(row, j, e) for row, j, e in every if not e.done]
            if not self.turn(model, going, step, device, greedy, tools, prefixes):
                break

    def request(self, row, j: int, e: Episode, step: int, greedy: bool) -> Request:
        """The request for episode (row, generation j)'s next reply: keyed (seed, step, row, j, turn)."""
        seed = None if greedy else sample_seed(self.engine.seed, step, row, j, e.turns)
        return Request(e.prompt_ids + e.tokens, seed, self.budget - len(e.tokens))

    def run_continuous(self, model, going: list, step: int, greedy: bool, tools: Executor) -> None:
        """Every (row key, generation, episode) to its end through the engine's stream (continuous batching): an
        episode's next reply is handed in as soon as its tools have answered, while the others are drawn."""
        lengths = [len(e.prompt_ids) + self.budget for *_, e in going]
        with self.engine.stream(model, lengths, self.budget, greedy) as stream:
            live = {stream.submit(self.request(row, j, e, step, greedy)): (row, j, e) for row, j, e in going}
            answering = {}  # tool calls running: future -> episode
            while live or answering:
                for f in [f for f in answering if f.done()]:
                    row, j, e = answering.pop(f)
                    f.result()
                    if not e.done:
                        live[stream.submit(self.request(row, j, e, step, greedy))] = (row, j, e)
                got = stream.finished(timeout=ANSWER_POLL_S if answering else None)
                if got is None:
                    continue
                row, j, e = live.pop(got[0])
                calls = self._reply(e, cut_at_end(got[1], self.engine.eos_token_ids))
                if calls:
                    answering[tools.submit(self._answer, e, calls)] = (row, j, e)

    def turn(
        self, model, going: list, step: int, device, greedy: bool, tools: Executor, prefixes=None
    ) -> bool:
        """The next reply of each (row key, generation, episode) still going, drawn in one engine call (an idle
        one where a synced rank has none), then every episode's tool calls at once; False when no rank has an
        episode going."""
        mine = 1 if going else 0
        calls = self.calls_of(mine)  # before generating: every rank must know the count first
        if calls == 0:
            return False
        if going:
            requests = [self.request(row, j, e, step, greedy) for row, j, e in going]
            c = self.engine.batch(model, requests, device, version=step, prefixes=prefixes)
            replies = [
                (e, self._reply(e, c.ids[k, : int(c.mask[k].sum())].tolist()))
                for k, (*_, e) in enumerate(going)
            ]
            for f in [tools.submit(self._answer, e, asked) for e, asked in replies if asked]:
                f.result()
        for _ in range(calls - mine):
            self.engine.idle(model, device)
        return True

    def _reply(self, e: Episode, ids: list[int]) -> list[dict]:
        """`ids` (up to its end token) as the episode's next reply; the tool calls to answer ([]: it has ended)."""
        n = len(ids)
        e.tokens += ids
        e.policy += [1] * n
        e.turns += 1
        e.ended = n > 0 and ids[-1] in self.engine.eos_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        reply = parse_reply(text, self.tokenizer)
        e.completion.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls or not e.ended or e.turns >= self.max_turns:
            e.done = True
            return []
        return calls

    def _answer(self, e: Episode, calls: list[dict]) -> None:
        """The episode's tool calls run in order and their results appended, or the episode ended (no room left for
        them and a reply, or the environment says it is over)."""
        results = []
        for call in calls:
            message, failed = call_tool(e.tools, call, self.output_chars)
            results.append(message)
            e.tool_calls += 1
            e.tool_errors += int(failed)
        suffix = self.tool_suffix(e, results)
        if (
            len(e.tokens) + len(suffix) >= self.budget
        ):  # no room for the results and a reply: the episode ends
            e.done = True
            return
        e.tokens += suffix
        e.policy += [0] * len(suffix)
        e.completion += results
        # the environment says the episode is over (a tool method named done does not)
        done = getattr(e.env, "done", False)
        e.done = not callable(done) and bool(done)

    def tool_suffix(self, e: Episode, results: list[dict]) -> list[int]:
        """The tokens of the tool results and the next assistant header, after the reply's end-of-turn token:
        the template's rendering of a conversation with and without them, cut at that token (TRL's way)."""
        call = [{"type": "function", "function": {"name": results[0]["name"], "arguments": {}}}]
        base = [*e.messages, {"role": "assistant", "content": "", "tool_calls": call}]
        kwargs = dict(tools=self.schemas or None, tokenize=False, **self.template_kwargs)
        before = self.tokenizer.apply_chat_template(base, add_generation_prompt=False, **kwargs)
        after = self.tokenizer.apply_chat_template(base + results, add_generation_prompt=True, **kwargs)
        eos = self.tokenizer.decode(self.engine.eos_token_ids[:1])
        cut = before.rfind(eos)
        cut = len(before) if cut < 0 else cut + len(eos)
        if not after.startswith(before[:cut]):
            raise UnexpectedTemplate(
                "the chat template renders a conversation with tool results so that the one without them is not "
                "its beginning; episodes need a template that appends them (data.chat_template)"
            )
        return self.tokenizer(after[cut:], add_special_tokens=False)["input_ids"]


def cut_at_end(ids: list[int], eos_token_ids: list[int]) -> list[int]:
    """`ids` up to and including the first end token (all of them where none ends them)."""
    end = next((i for i, t in enumerate(ids) if t in eos_token_ids), None)
    return ids if end is None else ids[: end + 1]


class UnexpectedTemplate(UserError):
    """A chat template that does not append tool results to the conversation (exit code 2)."""


def env_seed(seed: int, step: int, row: int | str) -> int:
    """The seed an environment's reset gets: of (seed, step, row), shared by the group's episodes."""
    return sample_seed(seed, step, f"{row}/environment", 0)
