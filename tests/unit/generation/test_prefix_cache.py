"""Prefix reuse (training/generation/prefix_cache.py) draws what recomputing draws, token for token in fp32 on
the CPU, while the model is fed only what is new: a group's shared prompt once, an episode's next turn only
past its last turn. Models whose cache is not plain, and ranks generating in step, are drawn without it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from conftest import TINY_ARCH
from training.generation import Request, TransformersEngine, sample_seed
from training.generation.prefix_cache import SHARED_PREFIX_TOKENS, PrefixStore, reusable, shared_prefix

EOS, PAD = 2, 0
CONTEXTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 32, 33]]
BUDGETS = [24, 7, 30, 1]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH)).eval()


class Fed:
    """Counts the tokens each forward pass of `model` is fed."""

    def __init__(self, model):
        self.counts = []
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.handle = base.model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        self.counts.append(ids.numel() if ids is not None else kwargs["inputs_embeds"].shape[:2].numel())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def engines(**kw):
    return TransformersEngine(3, 30, 1.0, 0.9, [EOS], PAD, **kw), TransformersEngine(
        3, 30, 1.0, 0.9, [EOS], PAD, reuse_prefixes=False, **kw
    )


def tokens(c, k: int) -> list[int]:
    return c.ids[k, : int(c.mask[k].sum())].tolist()


def all_tokens(c) -> list[list[int]]:
    return [tokens(c, k) for k in range(c.ids.shape[0])]


def grouped(greedy: bool, n: int = 3) -> list[Request]:
    """Each context `n` times (a group's generations), each with its own key and the context's budget."""
    return [
        Request(ids, None if greedy else sample_seed(3, 1, row, g), budget)
        for row, (ids, budget) in enumerate(zip(CONTEXTS, BUDGETS))
        for g in range(n)
    ]


@pytest.mark.parametrize("greedy", [False, True])
def test_a_groups_prompt_is_computed_once_and_draws_what_recomputing_draws(model, greedy):
    reuse, recompute = engines()
    requests = grouped(greedy)
    with Fed(model) as fed:
        got = reuse.batch(model, requests, "cpu")
    want = recompute.batch(model, requests, "cpu")
    assert all_tokens(got) == all_tokens(want)
    # the first pass is the distinct prompts but their last token (padded to the longest: 3 x 8; [20] has
    # nothing before its last token), the second the 12 rows' last tokens
    assert fed.counts[:2] == [3 * 8, 12 * 1]
    if not greedy:
        assert len({tuple(t) for t in all_tokens(got)}) > 4  # a group's generations differ


@pytest.mark.parametrize("greedy", [False, True])
def test_later_turns_go_on_from_the_last_turns_keys_and_values(model, greedy):
    """Three turns of episodes: each turn's context is the last one, its reply and a tool result of its own
    length. With a store the model is fed only the new part (the longest one, padded); the tokens are the
    ones recomputing draws, and the ones each episode draws alone."""
    reuse, recompute = engines()
    store, contexts = PrefixStore(), [list(c) for c in CONTEXTS]
    for turn in range(3):
        requests = [
            Request(c, None if greedy else sample_seed(3, 1, row, 0, turn), 12)
            for row, c in enumerate(contexts)
        ]
        with Fed(model) as fed:
            got = reuse.batch(model, requests, "cpu", prefixes=store)
        assert all_tokens(got) == all_tokens(recompute.batch(model, requests, "cpu"))
        assert [tokens(got, k) for k in range(4)] == [
            tokens(recompute.batch(model, [r], "cpu"), 0) for r in requests
        ]
        if turn:  # fed the reply's last token and the tool result, not the whole context again
            assert fed.counts[0] == 4 * (1 + 3)
        contexts = [c + tokens(got, k) + [40 + k] * (k % 3 + 1) for k, c in enumerate(contexts)]
    assert sorted(len(k) for k in store.entries) == sorted(
        len(c) - (k % 3 + 1) - 1 for k, c in enumerate(contexts)
    )


def test_under_lora_too(model):
    torch.manual_seed(1)
    peft = get_peft_model(
        LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH)),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    reuse, recompute = engines()
    with Fed(peft) as fed:
        got = reuse.batch(peft, grouped(False), "cpu")
    assert all_tokens(got) == all_tokens(recompute.batch(peft, grouped(False), "cpu"))
    assert fed.counts[1] == 12


def test_sliding_windows_and_ranks_in_step_are_drawn_without_reuse(model):
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, sliding_window=64, num_key_value_heads=4, **TINY_ARCH)
    mistral = MistralForCausalLM(config).eval()
    assert reusable(model) and not reusable(mistral)
    with Fed(mistral) as fed:
        got = engines()[0].batch(mistral, grouped(False), "cpu", prefixes=PrefixStore())
    assert fed.counts[0] == 12 * 9  # every row's whole context, in one pass
    assert all_tokens(got) == all_tokens(engines()[1].batch(mistral, grouped(False), "cpu"))
    # ZeRO-3/FSDP ranks must make as many forward passes as each other: no prefill pass of their own
    assert not engines(synced=True)[0].reuses(model, grouped(False), PrefixStore())
    assert engines()[0].reuses(model, grouped(False), None)


def test_ranks_that_gather_the_weights_for_each_call_reuse_with_every_pass_inside_the_gathering(model):
    """ZeRO-3/FSDP by default: each call's weights gathered whole once (the engine's `gathered`), each rank then
    prefilling and generating on its own, so contexts are reused, and no forward pass runs outside the gathering
    (a sharded forward outside it would gather per layer, every rank in step)."""
    inside, entered = [False], []

    @contextlib.contextmanager
    def gathered(m):
        entered.append(m)
        inside[0] = True
        try:
            yield True
        finally:
            inside[0] = False

    def check(module, args):
        assert inside[0], "a forward pass outside the gathering"

    reuse, recompute = engines(synced=True, gathered=gathered)
    assert not reuse.in_step and reuse.reuses(model, grouped(False), PrefixStore())
    handle = model.register_forward_pre_hook(check)
    try:
        with Fed(model) as fed:
            got = reuse.batch(model, grouped(False), "cpu", prefixes=PrefixStore())
        assert fed.counts[0] == 3 * 8  # the group's context prefilled once (its last token fed by generate)
        assert entered == [model]  # the prefill and the draw in one gathering
        reuse.idle(model, "cpu")
        assert entered == [model, model]  # a rank's idle call gathers too: every rank gathers as often
    finally:
        handle.remove()
    assert all_tokens(got) == all_tokens(recompute.batch(model, grouped(False), "cpu"))


@pytest.mark.parametrize("greedy", [False, True])
def test_a_prefix_all_prompts_share_is_computed_once(model, greedy):
    """Prompts that open alike (a system prompt and its tools) are fed the shared part once, then each its own
    rest; each draws what recomputing draws, and what it draws alone."""
    system = list(range(50, 50 + SHARED_PREFIX_TOKENS + 4))
    contexts = [system + c + [60] for c in CONTEXTS]
    reuse, recompute = engines()
    requests = [
        Request(c, None if greedy else sample_seed(3, 1, row, g), b)
        for row, (c, b) in enumerate(zip(contexts, BUDGETS))
        for g in range(2)
    ]
    with Fed(model) as fed:
        got = reuse.batch(model, requests, "cpu")
    assert all_tokens(got) == all_tokens(recompute.batch(model, requests, "cpu"))
    assert all_tokens(got)[::2] == [tokens(recompute.batch(model, [r], "cpu"), 0) for r in requests[::2]]
    # the shared part once, then the 4 prompts' own parts but their last token (padded to the longest: 4 x 9),
    # then the 8 rows' last tokens
    assert fed.counts[:3] == [len(system), 4 * 9, 8 * 1]


def test_the_shared_prefix_leaves_every_context_a_token():
    assert shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == [1, 2]
    assert shared_prefix([[1, 2, 3], [1, 5]]) == [1]
    assert shared_prefix([[7, 8], [1, 2]]) == [] and shared_prefix([[1, 2, 3]]) == []
