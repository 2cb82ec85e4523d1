"""The start-up numbers (training/data/scale.py): tokens per step, tokens in the corpus, steps per epoch,
and the hint to group or pack when random batches would be mostly padding."""

from __future__ import annotations

import random

import datasets

from conftest import TOKENIZER
from training.config import parse_recipe
from training.data.scale import padding_hint, scale_lines


def examples(lengths: list[int]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"input_ids": [[1] * n for n in lengths], "labels": [[1] * n for n in lengths]}
    )


def test_random_batches_of_spread_lengths_get_the_hint_and_uniform_ones_do_not():
    rng = random.Random(0)
    spread = examples([int(rng.lognormvariate(5.3, 0.8)) + 10 for _ in range(400)])
    hint = padding_hint(spread, 8, seed=0)
    assert hint is not None, "random batches of 8 over lengths 10-1000+ are mostly padding"
    random_eff = float(hint.split(" are ")[1].split(" ")[0])
    grouped_eff = float(hint.split("would make it ")[1].split(",")[0])
    assert 0.3 < random_eff < 0.6 and grouped_eff > 0.8, hint
    assert padding_hint(examples([60 + rng.randrange(8) for _ in range(400)]), 8, seed=0) is None


def test_scale_lines_count_the_tokens_and_the_steps():
    recipe = parse_recipe(
        {
            "output_dir": "unused",
            "model": {"name_or_path": TOKENIZER},
            "data": {"train": "data/alpaca_tiny.jsonl", "format": "instruction", "max_length": 64},
            # random order asked for: the padding hint (train.group_by_length: auto would group these itself)
            "train": {"batch_size": 4, "grad_accum": 2, "max_steps": 10, "group_by_length": False},
        }
    )
    ds = examples([50] * 200 + [400] * 200)  # 90,000 tokens
    lines = scale_lines(recipe, None, world=2, total_steps=10, train_ds=ds)
    assert lines[0].startswith("data scale: at most 1.0k tokens per step (4 x 2 rank(s) x 2 accumulation")
    assert lines[1] == "data scale: 90.0k tokens in the corpus (counted), about 88 steps per epoch"
    assert lines[2] == "data scale: 10 steps train 10.2k tokens = 0.11 epochs"
    assert any(line.startswith("data: random batches of 4 are") for line in lines)
    auto = recipe.model_copy(update={"train": recipe.train.model_copy(update={"group_by_length": "auto"})})
    assert not any(line.startswith("data: random batches") for line in scale_lines(auto, None, 2, 10, ds))


def test_online_rl_counts_prompts_generations_and_the_generation_budget():
    """An RL run of 10 steps x 4 prompts of a 96-prompt file said '12.8k tokens = 4.83 epochs'; it samples 40
    prompts, 0.42 epochs of them."""
    raw = {
        "output_dir": "unused",
        "model": {"name_or_path": TOKENIZER},
        "data": {"train": "data/rl/train.jsonl", "max_length": 128},
        "rl": {"num_generations": 4, "max_new_tokens": 32, "rewards": [{"function": "length_penalty"}]},
        "train": {"batch_size": 4, "max_steps": 10},
    }
    prompts = datasets.Dataset.from_dict({"input_ids": [[1] * 20] * 96, "row": list(range(96))})
    lines = scale_lines(parse_recipe(raw), None, world=1, total_steps=10, train_ds=prompts)
    assert lines == [
        "data scale: 4 prompts per step (4 x 1 rank(s) x 1 accumulation) x 4 generations = 16 completions of at "
        "most 32 tokens: a generation budget of 512 tokens per sampling step",
        "data scale: 96 prompts in the corpus (counted), about 24 steps per epoch of prompts",
        "data scale: 10 steps sample 40 prompts (160 generations) = 0.42 epochs of prompts",
    ]
    raw["rl"]["num_iterations"] = 2  # each batch of rollouts trains two steps: half the prompts
    lines = scale_lines(parse_recipe(raw), None, world=2, total_steps=10, train_ds=prompts)
    assert lines[1].endswith("about 24 steps per epoch of prompts, each batch of rollouts trained 2 steps")
    assert lines[2] == "data scale: 10 steps sample 40 prompts (160 generations) = 0.42 epochs of prompts"
    assert not any("tokens in the corpus" in line for line in lines)
