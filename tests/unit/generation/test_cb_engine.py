"""The continuous batching engine draws what the transformers engine draws: token for token in fp32 on the CPU,
sampled (top-p < 1) and greedy, for contexts and budgets of different lengths, with fewer of continuous
batching's batch slots than requests (so requests are admitted and retired as others finish); a request's tokens
do not depend on its companions or on the slots; and a model continuous batching cannot run falls back to
batched generate, named."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

from conftest import TINY_ARCH
from training.generation import Request, TransformersEngine, sample_seed
from training.generation.cb_engine import ContinuousBatchingEngine, KeyedNoise, cb_refusal, engine_for
from training.generation.keyed import gumbel

EOS, PAD = 2, 0
# contexts of different lengths, budgets of different lengths (one of a single token)
CONTEXTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 32, 33], [40, 41], [50, 51, 52]]
BUDGETS = [24, 7, 30, 16, 1, 12]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH)).eval()


def every(c) -> list[list[int]]:
    """Each row's tokens, up to and including its end."""
    return [c.ids[k, : int(c.mask[k].sum())].tolist() for k in range(c.ids.shape[0])]


def requests(greedy: bool, rows: list[int] | None = None) -> list[Request]:
    rows = range(len(CONTEXTS)) if rows is None else rows
    return [
        Request(CONTEXTS[row], None if greedy else sample_seed(3, 1, row, 0, turn=1), BUDGETS[row])
        for row in rows
    ]


@pytest.mark.parametrize("greedy", [False, True])
def test_continuous_batching_draws_what_generate_draws(model, greedy):
    reference = TransformersEngine(3, 30, 1.0, 0.9, [EOS], PAD)
    engine = ContinuousBatchingEngine(
        3, 30, 1.0, 0.9, [EOS], PAD, max_requests_per_batch=2
    )  # 2 slots, 6 requests
    batch = requests(greedy)
    drawn = engine.batch(model, batch, "cpu")
    batched = reference.batch(model, batch, "cpu")
    alone = [reference.batch(model, [r], "cpu") for r in batch]
    assert every(drawn) == every(batched) == [every(c)[0] for c in alone]
    assert all(len(t) <= b for t, b in zip(every(drawn), BUDGETS))  # each stopped at its own budget
    assert len(every(drawn)[4]) == 1
    ended = [t for t, b in zip(every(drawn), BUDGETS) if len(t) < b]
    assert all(t[-1] == EOS for t in ended)  # a row shorter than its budget ended on the end token, kept
    assert ended or not greedy
    assert model.config._attn_implementation == "sdpa" and not model.training  # the model as it was


def test_the_draw_keeps_the_model_training_mode(model):
    engine = ContinuousBatchingEngine(3, 4, 1.0, 1.0, [EOS], PAD)
    model.train()
    try:
        engine.batch(model, requests(False, [0]), "cpu")
        assert model.training
    finally:
        model.eval()


def test_a_request_draws_the_same_whatever_its_companions_and_slots(model):
    engine = ContinuousBatchingEngine(3, 30, 1.0, 0.9, [EOS], PAD, max_requests_per_batch=1)
    alone = engine.batch(model, requests(False, [2]), "cpu")
    crowd = ContinuousBatchingEngine(3, 30, 1.0, 0.9, [EOS], PAD, max_requests_per_batch=8)
    first = crowd.batch(model, requests(False, [2, 0, 1, 3]), "cpu")
    last = crowd.batch(model, requests(False, [5, 1, 4, 2]), "cpu")
    assert every(first)[0] == every(alone)[0] == every(last)[3]
    other = engine.batch(model, [Request(CONTEXTS[2], sample_seed(3, 1, 2, 1, turn=1), BUDGETS[2])], "cpu")
    assert every(other)[0] != every(alone)[0]  # the key matters: another generation draws other tokens


def test_the_groups_of_a_window_equal_the_transformers_engine(model):
    args = (3, 20, 0.7, 0.95, [EOS], PAD)
    prompts, rows = [[5, 6, 7], [9, 10], [20, 21, 22, 23, 24]], [4, 7, 9]
    drawn = ContinuousBatchingEngine(*args).groups(model, prompts, step=2, rows=rows, n=3, device="cpu")
    reference = TransformersEngine(*args).groups(model, prompts, step=2, rows=rows, n=3, device="cpu")
    assert [every(c) for c in drawn] == [every(c) for c in reference]


def test_a_lora_policy_and_its_frozen_base_draw_what_generate_draws():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, **TINY_ARCH)
    lora = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    cb, reference, batch = (
        ContinuousBatchingEngine(3, 30, 1.0, 0.9, [EOS], PAD),
        TransformersEngine(3, 30, 1.0, 0.9, [EOS], PAD),
        requests(False),
    )
    policy = every(cb.batch(lora, batch, "cpu"))
    assert policy == every(reference.batch(lora, batch, "cpu"))
    with lora.disable_adapter():  # the reference policy of a LoRA run
        frozen = every(cb.batch(lora, batch, "cpu"))
        assert frozen == every(reference.batch(lora, batch, "cpu"))
    assert frozen != policy


def test_a_batch_is_sampled_or_greedy(model):
    engine = ContinuousBatchingEngine(3, 8, 1.0, 1.0, [EOS], PAD)
    with pytest.raises(ValueError, match="sampled or greedy"):
        engine.batch(model, [Request([5], None, 4), Request([6], 1, 4)], "cpu")


def test_keyed_noise_is_taken_by_position_whatever_the_order_of_asking():
    stream = torch.Generator().manual_seed(11)
    expected = [gumbel(50, stream) for _ in range(5)]
    noise = KeyedNoise(11)
    asked = [(0, noise.at(0, 50)), (2, noise.at(2, 50)), (2, noise.at(2, 50)), (1, noise.at(1, 50))]
    asked.append((4, noise.at(4, 50)))
    assert all(torch.equal(n, expected[p]) for p, n in asked)


def test_continuous_batching_cannot_step_with_other_ranks():
    with pytest.raises(ValueError, match="ZeRO-3/FSDP"):
        ContinuousBatchingEngine(3, 8, 1.0, 1.0, [EOS], PAD, synced=True)


def test_a_model_continuous_batching_cannot_run_falls_back_to_generate_named(model):
    base = TransformersEngine(3, 8, 1.0, 1.0, [EOS], PAD)
    said = []
    engine = engine_for(model, base, said.append)
    assert type(engine) is ContinuousBatchingEngine and engine.seed == 3 and engine.eos_token_ids == [EOS]
    assert said == ["rollouts: continuous batching (paged attention), keyed"]
    mamba = MambaForCausalLM(MambaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, state_size=4))
    with pytest.raises(ValueError):  # continuous batching itself fails on it
        engine.batch(mamba, [Request([5, 6], 1, 4)], "cpu")
    said.clear()
    assert engine_for(mamba, base, said.append) is base
    assert said == [
        "rollouts: batched generate (continuous batching cannot run this model: "
        "MambaForCausalLM's attention does not take paged attention)"
    ]
    synced = TransformersEngine(3, 8, 1.0, 1.0, [EOS], PAD, synced=True)
    assert engine_for(model, synced, said.append) is synced
    assert "every rank must step generate together" in said[-1]
    assert cb_refusal(model) is None
