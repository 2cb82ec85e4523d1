"""Keyed generation is independent of batching: a request drawn in a batch with others (left-padded, each row
with its own key and budget) draws the tokens it draws alone, token for token in fp32 on the CPU; a window's
groups drawn in one call equal each group drawn alone; and the episode runner, which draws every live
episode's turn in one call, gives the episodes each group gives alone."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_ARCH
from training.generation import Request, TransformersEngine, sample_seed
from training.rl.build import make_engine

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH)).eval()


def tokens(c, k: int) -> list[int]:
    return c.ids[k, : int(c.mask[k].sum())].tolist()


# contexts of different lengths (left padding), budgets of different lengths (rows cut at their own)
CONTEXTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 32, 33], [40, 41]]
BUDGETS = [24, 7, 30, 16, 1]


@pytest.mark.parametrize("greedy", [False, True])
def test_a_request_in_a_batch_draws_what_it_draws_alone(model, greedy):
    engine = TransformersEngine(3, 30, 1.0, 0.9, [EOS], PAD)
    requests = [
        Request(ids, None if greedy else sample_seed(3, 1, row, 0, turn=1), budget)
        for row, (ids, budget) in enumerate(zip(CONTEXTS, BUDGETS))
    ]
    together = engine.batch(model, requests, "cpu")
    alone = [engine.batch(model, [r], "cpu") for r in requests]
    assert [tokens(together, k) for k in range(len(requests))] == [tokens(c, 0) for c in alone]
    assert all(len(tokens(together, k)) <= b for k, b in enumerate(BUDGETS))  # each cut at its own budget
    assert len(tokens(together, 4)) == 1
    if not greedy:  # the keys matter: other keys draw other tokens
        other = engine.batch(model, [Request(r.ids, r.seed + 1, r.max_new_tokens) for r in requests], "cpu")
        assert [tokens(other, k) for k in range(5)] != [tokens(together, k) for k in range(5)]


def test_a_batch_is_sampled_or_greedy(model):
    engine = TransformersEngine(3, 8, 1.0, 1.0, [EOS], PAD)
    with pytest.raises(ValueError, match="sampled or greedy"):
        engine.batch(model, [Request([5], None, 4), Request([6], 1, 4)], "cpu")


def test_the_groups_of_a_window_drawn_together_equal_each_group_alone(model):
    engine = TransformersEngine(3, 20, 1.0, 1.0, [EOS], PAD)
    prompts, rows = [[5, 6, 7], [9, 10], [20, 21, 22, 23, 24]], [4, 7, 9]
    together = engine.groups(model, prompts, step=2, rows=rows, n=3, device="cpu")
    for p, r, c in zip(prompts, rows, together):
        alone = engine.group(model, p, step=2, row=r, n=3, device="cpu")
        assert [tokens(c, k) for k in range(3)] == [tokens(alone, k) for k in range(3)]
    assert len({tuple(tokens(c, k)) for c in together for k in range(3)}) > 3  # the rows differ


def test_generation_runs_in_the_mixed_precision_the_policy_trains_in(model):
    """`generate` calls the inner model, not the forward accelerate wraps in its autocast: the engine enters the
    recipe's autocast itself (in the calling thread, so rl.async's background draws too); none by default. The
    RL and distillation builders hand it the accelerator's."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    try:
        TransformersEngine(3, 2, 1.0, 1.0, [EOS], PAD).batch(model, [Request([5, 6], 1, 2)], "cpu")
        bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        TransformersEngine(3, 2, 1.0, 1.0, [EOS], PAD, autocast=bf16).batch(
            model, [Request([5, 6], 1, 2)], "cpu"
        )
    finally:
        hook.remove()
    assert seen == [torch.float32] * 2 + [torch.bfloat16] * 2
    tok = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    rl = SimpleNamespace(
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        generator="transformers",
        batching="static",
        gather_for_generation=True,
    )
    recipe, accelerator = SimpleNamespace(seed=0, rl=rl), SimpleNamespace(autocast=bf16)
    with make_engine(recipe, accelerator, tok, False, model).autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_frozen_weights_are_cast_once_a_call_under_autocast():
    """A LoRA run's frozen base under bf16 autocast: `generate` sees those weights marked as requiring gradients
    (autocast then keeps each one's cast for the call instead of casting it at every decoding step), draws exactly
    what it draws without, and leaves them frozen, with no gradient. A background thread (rl.async's draws, whose
    copy shares them with the policy training beside it) and a run without autocast leave them as they are."""
    torch.manual_seed(0)
    frozen = LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH)).eval().requires_grad_(False)
    seen = []
    hook = frozen.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda m, i: seen.append(m.weight.requires_grad)
    )
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    engine = TransformersEngine(3, 12, 1.0, 1.0, [EOS], PAD, autocast=bf16)
    requests = [Request(ids, sample_seed(3, 1, row, 0), 12) for row, ids in enumerate(CONTEXTS)]
    try:
        main = engine.batch(frozen, requests, "cpu")
        on_main, seen[:] = list(seen), []
        background = []
        worker = threading.Thread(target=lambda: background.append(engine.batch(frozen, requests, "cpu")))
        worker.start()
        worker.join()
        in_thread, seen[:] = list(seen), []
        # without autocast (fp32) there is nothing to cast
        TransformersEngine(3, 12, 1.0, 1.0, [EOS], PAD).batch(frozen, requests, "cpu")
    finally:
        hook.remove()
    assert on_main and all(on_main) and in_thread and not any(in_thread) and seen and not any(seen)
    assert [tokens(main, k) for k in range(5)] == [tokens(background[0], k) for k in range(5)]
    assert not any(p.requires_grad or p.grad is not None for p in frozen.parameters())


def test_rows_done_are_set_aside_and_the_others_go_on_alone(model):
    """Rows that ended (their end token, or their own budget) leave the batch: the later decoding steps run over
    the rows still drawing only, and every row draws what it draws alone (the test above)."""
    engine = TransformersEngine(3, 30, 1.0, 1.0, [EOS], PAD)
    requests = [
        Request(ids, sample_seed(3, 1, row, 0), b) for row, (ids, b) in enumerate(zip(CONTEXTS, BUDGETS))
    ]
    rows = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        c = engine.batch(model, requests, "cpu")
    finally:
        hook.remove()
    lengths = [len(tokens(c, k)) for k in range(5)]
    assert rows[0] == 5 and rows[-1] == 1 and rows == sorted(rows, reverse=True)  # fewer rows as they end
    assert len(rows) == max(lengths)  # one forward pass a token of the longest row, none after it
    assert sum(rows) < 5 * max(lengths)  # the rows done are not stepped on
    assert lengths[4] == 1 and lengths[1] <= 7  # each row cut at its own budget
