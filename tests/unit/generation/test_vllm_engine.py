"""rl.generator=vllm on a CPU: what can be checked without vLLM. The requests a VLLMEngine sends (one per
completion, seeded by its key, so that one process and two ask for the same draws), when it pushes the
policy's weights (once per sampling step and once per evaluation), how vLLM's token lists become the
Completions the objective reads, and the refusals (no package, a model from scratch, QLoRA). The engine
itself runs in the GPU test of tests/integration/test_rl.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from conftest import ROOT, deep_update, train_inprocess
from training.config import parse_recipe
from training.core.errors import RecipeError
from training.generation import Request, TransformersEngine, sample_seed
from training.generation import vllm_engine as vllm_rollout
from training.generation.vllm_engine import VLLMEngine, check_vllm_installed, padded_completions

EOS, PAD = 2, 0


class Params:
    """vllm.SamplingParams' stand-in: the keyword arguments it was given."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeLLM:
    """LLM.generate's stand-in: each request's completion is its seed's last digits, then EOS."""

    def __init__(self):
        self.requests = []

    def generate(self, prompts, sampling_params, use_tqdm):
        out = []
        for p, sp in zip(prompts, sampling_params, strict=True):
            self.requests.append((p["prompt_token_ids"], sp))
            seed = getattr(sp, "seed", None)
            tokens = [5, 6, 7] if seed is None else [10 + seed % 50, 11, EOS]
            out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens)]))
        return out


class FakeEngine:
    def __init__(self):
        self.llm, self.pushes = FakeLLM(), 0

    def sync_weights(self):
        self.pushes += 1


@pytest.fixture
def sampler(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=Params))
    base = TransformersEngine(
        seed=7, max_new_tokens=4, temperature=0.8, top_p=0.9, eos_token_ids=[EOS], pad_token_id=PAD
    )
    s = VLLMEngine(base, accelerator=None, tokenizer=None, gpu_memory_utilization=0.3, max_model_len=64)
    s.engine = FakeEngine()
    return s


def test_each_completion_is_one_request_seeded_by_its_key(sampler):
    groups = sampler.groups(None, [[1, 2], [3]], step=4, rows=[10, 11], n=2, device="cpu")
    seeds = [sp.seed for _, sp in sampler.engine.llm.requests]
    assert seeds == [sample_seed(7, 4, r, g) for r in (10, 11) for g in (0, 1)]
    assert [p for p, _ in sampler.engine.llm.requests] == [[1, 2], [1, 2], [3], [3]]
    sp = sampler.engine.llm.requests[0][1]
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.stop_token_ids, sp.n) == (0.8, 0.9, 4, [EOS], 1)
    assert [g.ids.shape for g in groups] == [torch.Size([2, 3])] * 2


def test_two_processes_ask_for_the_draws_of_one(sampler):
    """Rows split over two ranks are requested with the seeds one process gives them."""
    one = sampler.groups(None, [[1], [2], [3], [4]], 1, [0, 1, 2, 3], 2, "cpu")
    seeds_one = [sp.seed for _, sp in sampler.engine.llm.requests]
    sampler.engine.llm.requests.clear()
    two = [
        sampler.groups(None, [[1], [2]], 1, [0, 1], 2, "cpu"),
        sampler.groups(None, [[3], [4]], 1, [2, 3], 2, "cpu"),
    ]
    assert [sp.seed for _, sp in sampler.engine.llm.requests] == seeds_one
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(one, two[0] + two[1]))


def test_weights_are_pushed_once_per_sampling_step_and_per_evaluation(sampler):
    for step in (1, 1, 2):  # a window of two micro-batches at step 1, then step 2
        sampler.groups(None, [[1]], step, [0], 2, "cpu")
    assert sampler.engine.pushes == 2
    sampler.greedy(None, [[1], [2]], "cpu", version=2)  # the policy after step 2's update
    sampler.greedy(None, [[3]], "cpu", version=2)  # the same evaluation's next batch
    assert sampler.engine.pushes == 3
    greedy = sampler.engine.llm.requests[-1][1]
    assert greedy.temperature == 0.0 and not hasattr(greedy, "seed")


def test_an_episode_turn_is_one_call_of_keyed_requests_with_their_own_budgets(sampler):
    """Episodes on vLLM: a turn of every episode still going is one call, each request seeded by its key
    (seed, step, row, generation, turn) with the budget the episode has left; the turns of one step push the
    weights once."""
    keys = [sample_seed(7, 3, 10, 0, 1), sample_seed(7, 3, 11, 1, 1)]
    turn1 = [Request([1, 2, 9], keys[0], 3), Request([4, 9, 9, 9], keys[1], 1)]
    c = sampler.batch(None, turn1, "cpu", version=3)
    turn2 = [Request([1, 2, 9, 5], sample_seed(7, 3, 10, 0, 2), 2)]
    sampler.batch(None, turn2, "cpu", version=3)
    sent = sampler.engine.llm.requests
    assert [(p, sp.seed, sp.max_tokens) for p, sp in sent] == [
        ([1, 2, 9], keys[0], 3),
        ([4, 9, 9, 9], keys[1], 1),
        ([1, 2, 9, 5], sample_seed(7, 3, 10, 0, 2), 2),
    ]
    assert sampler.engine.pushes == 1 and c.ids.shape[0] == 2
    sampler.batch(None, [Request([1], None, 4)], "cpu", version=3)  # a greedy evaluation after step 3
    assert sampler.engine.pushes == 2 and sent[-1][1].temperature == 0.0


def test_vllm_token_lists_become_masked_completions():
    c = padded_completions([[4, EOS], [4, 5, 6], [EOS]], [EOS], pad=EOS, seconds=1.5)
    # pad == EOS (as in SmolLM2): the padding after an unfinished completion is not mistaken for its end
    assert c.mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert c.ids.tolist() == [[4, EOS, EOS], [4, 5, 6], [EOS, EOS, EOS]]
    assert c.lengths.tolist() == [2, 3, 1] and c.seconds == 1.5


def test_a_missing_package_is_named(monkeypatch):
    real = vllm_rollout.importlib.util.find_spec
    monkeypatch.setattr(
        vllm_rollout.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name)
    )
    with pytest.raises(
        RecipeError, match=r"rl.generator=vllm needs the vllm package: pip install 'llm-forge\[vllm\]'"
    ):
        check_vllm_installed()


RL = {"rl": {"generator": "vllm", "rewards": [{"function": "length_penalty"}]}}


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"model": {"tokenizer": "tok", "from_scratch": {"hidden_size": 64}}},
            "model.name_or_path must be a pretrained model",
        ),
        ({"model": {"name_or_path": "tiny"}, "method": {"type": "qlora"}}, "merged into 4-bit weights"),
        ({"model": {"name_or_path": "tiny"}, "rl": {"vllm_gpu_memory_utilization": 1.0}}, "less than 1"),
    ],
)
def test_the_recipe_refuses_what_vllm_generation_cannot_do(extra, message):
    raw = deep_update({"output_dir": "x", "data": {"train": "p.jsonl"}, **RL}, extra)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(raw)


def test_a_cpu_run_is_refused_before_training_with_exit_2(make_recipe, tiny_model_dir, capsys):
    prompts = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts", "max_length": 128}
    recipe = make_recipe(model={"name_or_path": str(tiny_model_dir)}, rl=RL["rl"], data=prompts)
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe)
    assert e.value.code == 2
    assert "rl.generator=vllm needs CUDA GPUs" in capsys.readouterr().err
