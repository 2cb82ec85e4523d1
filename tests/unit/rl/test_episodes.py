"""Agent episodes (training/objectives/episode.py): a scripted policy's two-turn episode gives the tokens, the
policy mask and the messages a hand computation gives; the loss counts the policy's tokens only; with no tool
call an episode is exactly today's single-turn completion; budget, max_turns and failing tools end or answer
as documented; an environment is TRL's environment_factory contract."""

from __future__ import annotations

import contextlib
import inspect
import threading
import time

import pytest
import torch

from conftest import ROOT, TINY_ARCH, TOKENIZER
from training.config import RLSection
from training.data.tokenizer import load_tokenizer
from training.generation import Completions, TransformersEngine, sample_seed
from training.rl.drawn import Drawn
from training.rl.episode import EpisodeRunner
from training.rl.loss import summed_loss, token_logps, token_losses
from training.rl.tools import (
    Environments,
    call_tool,
    check_deterministic,
    load_environment,
    schema_of,
)

TEMPLATE = (ROOT / "data/tools/chatml_tools.jinja").read_text()
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError("no luck")


@pytest.fixture(scope="module")
def tok():
    from training.config import ModelSection

    t = load_tokenizer(ModelSection(tokenizer=TOKENIZER, from_scratch=dict(TINY_ARCH)))
    t.chat_template = TEMPLATE
    return t


class Scripted(TransformersEngine):
    """A policy that writes the replies of `script` in order (each closed by the end-of-sequence token), and
    records the contexts it was given and the keys of its draws."""

    def __init__(self, tok, script: list[str], budget=200):
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        super().__init__(7, budget, 1.0, 1.0, [eos], tok.pad_token_id)
        self.tok, self.script, self.contexts, self.keys = tok, list(script), [], []

    def _reply(self, limit):
        ids = self.tok(self.script.pop(0), add_special_tokens=False)["input_ids"] + self.eos_token_ids
        ids = ids[:limit]
        return torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)

    def batch(self, model, requests, device, version=None, prefixes=None):
        rows = []
        for r in requests:
            self.contexts.append(list(r.ids))
            self.keys.append(r.seed)
            rows.append(self._reply(r.max_new_tokens))
        width = max(r[0].shape[1] for r in rows)
        ids = torch.cat([torch.nn.functional.pad(r[0], (0, width - r[0].shape[1])) for r in rows])
        mask = torch.cat([torch.nn.functional.pad(r[1], (0, width - r[1].shape[1])) for r in rows])
        return Completions(ids, mask, 0.0)


def runner(tok, sampler, tools=None, envs=None, max_turns=4, budget=200):
    tools = {"add": add, "broken": broken} if tools is None else tools
    schemas = [schema_of(f, "rl.tools") for f in tools.values()]
    return EpisodeRunner(
        sampler, tok, tools, envs, max_turns, budget, 2000, {}, schemas, calls_of=lambda n: n
    )


def test_a_two_turn_episode_is_the_tokens_mask_and_messages_of_a_hand_computation(tok):
    sampler = Scripted(tok, [CALL, "The answer is 5."])
    r = runner(tok, sampler)
    (e,) = r.run(None, [(PROMPT, {}, 3)], step=2, n=1, device="cpu")
    reply1 = tok(CALL, add_special_tokens=False)["input_ids"] + sampler.eos_token_ids
    reply2 = tok("The answer is 5.", add_special_tokens=False)["input_ids"] + sampler.eos_token_ids
    suffix = tok(
        "\n<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    assert e.prompt_ids == r.render(PROMPT)
    assert "You can call these tools" in tok.decode(e.prompt_ids)  # the schemas are in the prompt
    assert e.tokens == reply1 + suffix + reply2
    assert e.policy == [1] * len(reply1) + [0] * len(suffix) + [1] * len(reply2)
    assert (e.turns, e.tool_calls, e.tool_errors, e.ended) == (2, 1, 0, True)
    assert e.completion == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ]
    # the second turn's context is the prompt and everything so far; its key is (seed, step, row, g, turn)
    assert sampler.contexts[1] == e.prompt_ids + reply1 + suffix
    assert sampler.keys == [sample_seed(7, 2, 3, 0), sample_seed(7, 2, 3, 0, 1)]
    assert sample_seed(7, 2, 3, 0, 1) != sample_seed(7, 2, 3, 0)
    # the objective's tensors: the mask of predicted tokens is the policy mask shifted by one, from the first
    # policy token on (the prompt's positions before it are not scored: their logits are never made)
    ids, attention, mask = Drawn.of_episodes([e], [0]).tensors(tok.pad_token_id)
    assert ids[0].tolist() == e.prompt_ids + e.tokens and attention.sum() == len(e.prompt_ids) + len(e.tokens)
    assert mask[0].tolist() == e.policy and e.policy[0] == 1


def test_the_loss_of_an_episode_counts_the_policy_tokens_only(tok):
    """Per-token loss of a two-turn episode against a hand computation over the policy's tokens; the tool
    result's tokens change nothing but the context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **TINY_ARCH))
    sampler = Scripted(tok, [CALL, "5"])
    (e,) = runner(tok, sampler).run(None, [(PROMPT, {}, 0)], step=1, n=1, device="cpu")
    ids, attention, mask = Drawn.of_episodes([e], [0]).tensors(tok.pad_token_id)
    cfg = RLSection(rewards=[{"function": "exact_match"}], tools=["python"], loss_type="grpo")
    logps, _ = token_logps(model, ids, attention, 1.0, mask)
    adv = torch.tensor([0.7])
    losses, *_ = token_losses(logps, logps.detach(), None, adv, cfg)
    got = summed_loss(losses, mask, "grpo")
    # by hand: -A x the mean, over the policy's tokens, of ratio (= 1) ... with its gradient A grad log p
    policy = [i for i, m in enumerate(mask[0].tolist()) if m == 1]
    assert len(policy) == sum(e.policy)  # every policy token is predicted (none is the first token)
    hand = -(0.7 * torch.ones(len(policy))).sum() / len(policy)
    assert torch.allclose(got, hand)
    got.backward(retain_graph=True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    hand_loss = -(0.7 * logps[0, policy]).sum() / len(policy)  # the policy gradient of those tokens alone
    hand_loss.backward()
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.allclose(grads[n], p.grad, atol=1e-7), n


def test_an_episode_without_a_call_is_todays_single_turn_completion(tok):
    """The same keys, the same prompt tokens and the same completion: tensors equal bit for bit, so its loss
    equals single-turn GRPO's exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **TINY_ARCH)).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sampler = TransformersEngine(3, 12, 1.0, 1.0, [eos], tok.pad_token_id)
    r = runner(tok, sampler, tools={}, budget=12)  # rl.max_new_tokens: the engine's and the episodes' budget
    prompt_ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt_ids, add_special_tokens=False)["input_ids"]
    old = sampler.group(model, prompt_ids, 5, 11, 3, "cpu")
    episodes = r.run(model, [(PROMPT, {}, 11)], step=5, n=3, device="cpu")
    assert all(e.prompt_ids == prompt_ids for e in episodes)
    shown = [PROMPT] * 3
    single = Drawn.of_completions([old], [prompt_ids] * 3, [11] * 3, tok, sampler, shown)
    multi = Drawn.of_episodes(episodes, [11] * 3)
    assert multi.seqs == single.seqs and multi.marks == single.marks and multi.lengths == single.lengths
    assert [e.turns for e in episodes] == [1, 1, 1]


def test_a_synced_rank_makes_one_call_per_turn_and_idles_while_another_rank_goes_on(tok):
    """Under ZeRO-3/FSDP every rank makes as many engine calls as the most: each turn of this rank's episodes
    is one call, and while another rank still has episodes going (it asks for 1 call where this rank has
    none), this rank runs idle calls until every rank is done."""

    class Counting(Scripted):
        idles = 0

        def idle(self, model, device):
            self.idles += 1

    engine = Counting(tok, [CALL, "The answer is 5.", "5"])
    other_rank_turns = 4  # the other rank's episodes go on for four turns
    asked = []

    def calls_of(mine: int) -> int:  # the max over ranks of this turn's call counts
        asked.append(mine)
        return max(mine, 1 if len(asked) <= other_rank_turns else 0)

    r = runner(tok, engine, max_turns=6)
    r.calls_of = calls_of
    groups = [(PROMPT, {}, 0), (PROMPT, {}, 1)]
    episodes = r.run(None, groups, step=1, n=1, device="cpu")
    assert [e.turns for e in episodes] == [2, 1]  # row 0 called a tool and answered; row 1 answered at once
    assert len(engine.contexts) == 3  # turn 0: both rows in one call; turn 1: row 0 alone
    assert asked == [1, 1, 0, 0, 0] and engine.idles == 2  # turns 2 and 3: this rank idles; then all stop


class Keyed(TransformersEngine):
    """A policy whose reply depends on the request's key alone ((generation, turn) -> reply), as a keyed engine's
    does, drawn in batches."""

    def __init__(self, tok, replies: dict, step: int, row: int):
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        super().__init__(7, 200, 1.0, 1.0, [eos], tok.pad_token_id)
        self.tok, self.replies, self.log = tok, replies, []
        self.who = {sample_seed(7, step, row, j, turn): (j, turn) for j, turn in replies}

    def reply(self, r) -> list[int]:
        ids = (
            self.tok(self.replies[self.who[r.seed]], add_special_tokens=False)["input_ids"]
            + self.eos_token_ids
        )
        return ids[: r.max_new_tokens]

    def batch(self, model, requests, device, version=None, prefixes=None):
        rows = [torch.tensor(self.reply(r)) for r in requests]
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=self.pad_token_id)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in rows], batch_first=True)
        return Completions(ids, mask, 0.0)


class Streaming(Keyed):
    """The same policy drawn as continuous batching draws, in time: a request ends 10 ms a token after it was
    handed in. Every request handed in and every reply ended is logged, as (what, generation, turn)."""

    @contextlib.contextmanager
    def stream(self, model, lengths, budget, greedy):
        engine, pending = self, {}

        class Stream:
            def submit(self, r):
                pending[len(engine.log)] = (r, time.monotonic() + 0.01 * len(engine.reply(r)))
                engine.log.append(("in", *engine.who[r.seed]))
                return len(engine.log) - 1

            def finished(self, timeout=None):
                k = min(pending, key=lambda k: pending[k][1])
                now = time.monotonic()
                wait = pending[k][1] - now
                if timeout is not None and wait > timeout:
                    time.sleep(timeout)
                    return None
                time.sleep(max(0.0, wait))
                r, _ = pending.pop(k)
                engine.log.append(("out", *engine.who[r.seed]))
                return k, engine.reply(r) + [0, 0]  # what continuous batching draws past the end is cut off

        yield Stream()


def test_continuous_episodes_hand_in_a_turn_while_the_others_are_still_drawn(tok):
    """With an engine that streams (rl.batching: continuous), generation 0's tool call is answered and its
    next turn handed in while generation 1's long first reply is still being drawn; the episodes are those
    that turn-by-turn batches give (the same keys, the same tokens)."""
    replies = {(0, 0): CALL, (0, 1): "Five.", (1, 0): "Let me think about it for a while. " * 8 + "It is 5."}
    streamed = Streaming(tok, replies, step=1, row=4)
    episodes = runner(tok, streamed).run(None, [(PROMPT, {}, 4)], step=1, n=2, device="cpu")
    assert streamed.log == [
        ("in", 0, 0),
        ("in", 1, 0),
        ("out", 0, 0),
        ("in", 0, 1),
        ("out", 0, 1),
        ("out", 1, 0),
    ]
    by_turns = runner(tok, Keyed(tok, replies, step=1, row=4)).run(
        None, [(PROMPT, {}, 4)], step=1, n=2, device="cpu"
    )
    assert [(e.tokens, e.policy, e.completion, e.turns) for e in episodes] == [
        (e.tokens, e.policy, e.completion, e.turns) for e in by_turns
    ]
    assert [e.turns for e in episodes] == [2, 1] and episodes[0].tool_calls == 1


def test_the_tools_of_a_turn_run_at_once(tok):
    """Both episodes' tool calls of a turn run together: each call waits at a barrier that opens only when the
    other call is there too (run one after the other, the first would time out and answer with an error)."""
    barrier = threading.Barrier(2, timeout=10)

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        barrier.wait()
        return a + b

    replies = {(0, 0): CALL, (0, 1): "Five.", (1, 0): CALL, (1, 1): "5"}
    episodes = runner(tok, Keyed(tok, replies, step=1, row=0), tools={"add": add}).run(
        None, [(PROMPT, {}, 0)], step=1, n=2, device="cpu"
    )
    assert [(e.tool_calls, e.tool_errors, e.turns) for e in episodes] == [(1, 0, 2), (1, 0, 2)]
    assert episodes[0].completion[1]["content"] == "5"


def test_failing_and_unknown_tools_answer_with_an_error_and_the_episode_goes_on(tok):
    bad = '<tool_call>\n{"name": "broken", "arguments": {"x": "1"}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    sampler = Scripted(tok, [bad, unknown, "I give up."])
    (e,) = runner(tok, sampler).run(None, [(PROMPT, {}, 0)], step=1, n=1, device="cpu")
    tools = [m for m in e.completion if m["role"] == "tool"]
    assert tools[0]["content"] == '{"error": "ValueError: no luck"}'
    assert "unknown tool 'nope'" in tools[1]["content"]
    assert (e.turns, e.tool_calls, e.tool_errors) == (3, 2, 2)
    msg, failed = call_tool({"add": add}, {"function": {"name": "add", "arguments": "{not json"}}, 100)
    assert failed and "not JSON" in msg["content"]


def test_max_turns_and_the_token_budget_end_an_episode(tok):
    sampler = Scripted(tok, [CALL, CALL, CALL])
    (e,) = runner(tok, sampler, max_turns=2).run(None, [(PROMPT, {}, 0)], step=1, n=1, device="cpu")
    assert (e.turns, e.tool_calls) == (2, 1)  # the second reply's call is not run: no turn is left
    assert e.completion[-1]["role"] == "assistant" and len(sampler.script) == 1
    # a budget that leaves no room for the result and a reply: the episode ends after the first reply
    sampler = Scripted(tok, [CALL, "5"], budget=30)
    (e,) = runner(tok, sampler, budget=30).run(None, [(PROMPT, {}, 0)], step=1, n=1, device="cpu")
    assert e.turns == 1 and len(e.tokens) <= 30 and all(m["role"] == "assistant" for m in e.completion)


class Counter:
    """An environment as TRL's documentation writes one: reset returns the task, methods are tools, get_reward
    scores the episode."""

    def reset(self, target: int = 3, **kwargs) -> str:
        self.count, self.target = 0, target
        return f" Press the button {target} times."

    def press(self) -> str:
        """Press the button once.

        Returns:
            The number of presses so far.
        """
        self.count += 1
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count == self.target)


def test_an_environment_written_for_trl_runs_unchanged(tok, tmp_path):
    (tmp_path / "env.py").write_text(inspect.getsource(Counter))  # the class as its own file
    cfg = RLSection(environment=f"{tmp_path}/env.py:Counter", rewards=[])
    envs = load_environment(cfg)
    assert (envs.name, envs.owns_reward, envs.takes_seed) == ("Counter", True, False)
    press = '<tool_call>\n{"name": "press", "arguments": {}}\n</tool_call>'
    # turn by turn: both first replies, then both second replies, then the third
    sampler = Scripted(tok, [press, press, "Done.", press, "Done."])
    r = runner(tok, sampler, tools={}, envs=envs)
    r.schemas = envs.schemas
    episodes = r.run(
        None, [(PROMPT, {"target": 2}, 0), (PROMPT, {"target": 2}, 1)], step=1, n=1, device="cpu"
    )
    assert "Press the button 2 times." in tok.decode(episodes[0].prompt_ids)  # the observation, in the prompt
    assert [e.tool_calls for e in episodes] == [1, 2]
    assert [e.env.get_reward() for e in episodes] == [0.0, 1.0]  # each episode's own instance kept its state
    assert check_deterministic(envs, {"target": 2}, 0) is None


def test_an_environment_that_ignores_its_seed_is_named(tmp_path):
    (tmp_path / "env.py").write_text(
        "import random\nclass Dice:\n    def reset(self, **kw):\n        return str(random.random())\n"
    )
    envs = load_environment(RLSection(environment=f"{tmp_path}/env.py:Dice", rewards=[]))
    assert isinstance(envs, Environments)
    warning = check_deterministic(envs, {}, 0)
    assert (
        "rl.environment (Dice) is not deterministic under its seed" in warning and "takes no seed" in warning
    )


def test_an_attack_inside_an_episode_comes_back_as_a_tool_error_and_the_episode_goes_on(tok):
    """The policy's code loops forever: its call ends at the timeout, the error is the tool's message, and the
    policy writes its next reply."""
    from training.rl.sandbox import Sandbox, make_python_tool

    loop = '<tool_call>\n{"name": "python", "arguments": {"code": "while True: pass"}}\n</tool_call>'
    sampler = Scripted(tok, [loop, "It timed out."])
    r = runner(tok, sampler, tools={"python": make_python_tool(Sandbox(timeout_s=1))})
    (e,) = r.run(None, [([{"role": "user", "content": "Loop."}], {}, 0)], step=1, n=1, device="cpu")
    assert e.completion[1] == {"role": "tool", "name": "python", "content": "error: timed out after 1 s"}
    assert (e.turns, e.tool_calls, e.tool_errors) == (2, 1, 1) and e.completion[-1][
        "content"
    ] == "It timed out."


def test_the_overlong_penalty_is_dapos_soft_punishment():
    from training.rl.rewards import overlong_penalty

    ids = [[0] * n for n in (10, 12, 14, 16, 20)]
    assert overlong_penalty(ids, max_tokens=16, buffer=4) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty([[0] * 13], max_tokens=16) == [-0.25]  # default buffer: a quarter of the budget
