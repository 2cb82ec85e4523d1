"""reasoning-gym tasks as RL data and reward: data.train/data.eval: reasoning_gym:TASK build the prompt records
of reasoning_gym.create_dataset (held-out sets from eval_seed), cached under a key of what made them; the
reasoning_gym reward equals the task's own score_answer for right, wrong, partly right and untagged answers;
math_verify (math_equal) scores the arithmetic answers; every bad recipe is refused with its key named."""

from __future__ import annotations

import json
import re

import pytest
import reasoning_gym

from conftest import TOKENIZER
from training.config import ModelSection, parse_recipe
from training.core.errors import RecipeError
from training.data import build_datasets
from training.data.procedural import load_task
from training.data.prompts import row_columns
from training.data.tokenizer import load_tokenizer
from training.rl.rewards import BUILTINS

TASKS = {  # an arithmetic task and a letters one, small settings
    "basic_arithmetic": {"min_terms": 2, "max_terms": 3, "max_digits": 2},
    "letter_counting": {"min_words": 3, "max_words": 5},
}
RL = {"rewards": [{"function": "reasoning_gym", "args": {"answer_tag": "answer"}}]}


def recipe(tmp_path, task: str, **data):
    settings = {"size": 6, "seed": 3, "eval_size": 4, "config": TASKS[task]}  # eval_seed: 3 + 6
    return parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": TOKENIZER},
            "data": {
                "train": f"reasoning_gym:{task}",
                "eval": f"reasoning_gym:{task}",
                "reasoning_gym": settings,
                "cache_dir": str(tmp_path / "cache"),
                **data,
            },
            "rl": RL,
        }
    )


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_the_records_are_the_tasks_entries_and_held_out_sets_take_eval_seed(tmp_path, tok, task):
    train, evals = build_datasets(recipe(tmp_path, task), tok)
    for ds, size, seed in ((train, 6, 3), (evals["eval"], 4, 9)):
        lib = reasoning_gym.create_dataset(task, size=size, seed=seed, **TASKS[task])
        prompts, columns = row_columns(ds)
        assert prompts == [lib[i]["question"] for i in range(size)]
        assert [c["answer"] for c in columns] == [lib[i]["answer"] for i in range(size)]
        made = [json.loads(c["reasoning_gym"]) for c in columns]
        assert [m["task"] for m in made] == [task] * size and made[0]["config"] == TASKS[task]
        assert [m["entry"]["metadata"]["source_index"] for m in made] == list(range(size))
    assert set(row_columns(train)[0]).isdisjoint(row_columns(evals["eval"])[0])  # another seed: other prompts
    # the cache key is what made the records: a second build is a hit, another seed another entry
    build_datasets(recipe(tmp_path, task), tok)
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1
    build_datasets(recipe(tmp_path, task, **{"reasoning_gym": {"seed": 5, "config": TASKS[task]}}), tok)
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 2


SMALL = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}


def test_held_out_sets_leave_out_training_questions_that_a_small_task_repeats(tmp_path, tok):
    """These one-digit sums have 121 distinct questions: other seeds draw training questions again."""
    small = {"reasoning_gym": {"size": 40, "eval_size": 20, "config": SMALL}, "cache": False}
    train, evals = build_datasets(recipe(tmp_path, "basic_arithmetic", **small), tok)
    lib = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=40, **SMALL)
    drawn = [lib[i]["question"] for i in range(20)]
    trained, held_out = set(row_columns(train)[0]), row_columns(evals["eval"])[0]
    assert held_out == [q for q in drawn if q not in trained] and 0 < len(held_out) < 20
    every = {"reasoning_gym": {"size": 3000, "eval_size": 20, "config": SMALL}, "cache": False}
    with pytest.raises(
        RecipeError, match="data.eval: every one of the 20 held-out prompts of reasoning_gym:"
    ):
        build_datasets(recipe(tmp_path, "basic_arithmetic", **every), tok)


def test_a_worked_example_is_an_earlier_turn_of_every_prompt(tmp_path, tok):
    """data.reasoning_gym.example: each prompt is the chat (example question, its answer, the question); the
    held-out set still leaves out the training questions, and the example is part of the cache key."""
    example = {"question": "Calculate 2 + 3.", "answer": "5"}
    settings = {"size": 40, "eval_size": 20, "config": SMALL, "example": example}
    train, evals = build_datasets(recipe(tmp_path, "basic_arithmetic", reasoning_gym=settings), tok)
    lib = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=0, **SMALL)
    turn = [{"role": "user", "content": "Calculate 2 + 3."}, {"role": "assistant", "content": "5"}]
    prompts = row_columns(train)[0]
    assert prompts == [[*turn, {"role": "user", "content": lib[i]["question"]}] for i in range(40)]
    trained = {p[-1]["content"] for p in prompts}
    held_out = [p[-1]["content"] for p in row_columns(evals["eval"])[0]]
    assert held_out and trained.isdisjoint(held_out)
    rendered = tok.decode(train[0]["input_ids"])
    assert rendered.index("Calculate 2 + 3.") < rendered.index(lib[0]["question"])
    build_datasets(recipe(tmp_path, "basic_arithmetic", reasoning_gym={**settings, "example": None}), tok)
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 2


@pytest.mark.parametrize("task", sorted(TASKS))
def test_the_reward_is_the_tasks_own_score_answer(tmp_path, task):
    settings = recipe(tmp_path, task).data.reasoning_gym
    records = load_task(task, settings, False, "data.train")
    lib = reasoning_gym.create_dataset(task, size=6, seed=3, **TASKS[task])
    for i in range(3):
        entry, right = lib[i], lib[i]["answer"]
        answers = {  # completion -> the answer the task is asked to score
            f"Let me think. <answer>{right}</answer>": right,
            f"<answer> {right} </answer>": right,  # stripped, as reasoning-gym's extract_answer does
            f"<answer>{right}</answer> or <answer>none</answer>": "none",  # the last tag, wrong
            f"<answer>The answer is {right}</answer>": f"The answer is {right}",  # partly right
            right: None,  # untagged
        }
        got = BUILTINS["reasoning_gym"](
            completions=list(answers),
            reasoning_gym=[records[i]["reasoning_gym"]] * len(answers),
            answer_tag="answer",
        )
        want = [float(lib.score_answer(a, entry)) for a in answers.values()]
        assert got == want
        assert want[0] == 1.0 and want[2] == want[4] == 0.0 and 0 < want[3] < 1


def test_math_verify_is_math_equal_and_scores_the_arithmetic_answers(tmp_path):
    assert BUILTINS["math_verify"] is BUILTINS["math_equal"]
    lib = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=3, **TASKS["basic_arithmetic"])
    answers = [lib[i]["answer"] for i in range(20)]
    right = [f"<answer>{a}</answer>" for a in answers]
    wrong = [f"<answer>{int(a) + 1}</answer>" for a in answers]
    score = BUILTINS["math_verify"]
    assert score(completions=right, answer=answers, answer_tag="answer") == [1.0] * 20
    assert score(completions=wrong, answer=answers, answer_tag="answer") == [0.0] * 20
    r = parse_recipe({**recipe_dict(), "rl": {"rewards": [{"function": "math_verify"}]}})
    assert r.rl.rewards[0].name == "math_verify" and r.rl.columns() == ["answer"]


def test_seeds_closer_than_size_share_prompts_so_held_out_sets_start_at_seed_plus_size():
    """Entry i of seed s is entry i - 1 of seed s + 1 (reasoning-gym draws it with Random(s + i))."""
    one, next_seed = (reasoning_gym.create_dataset("chain_sum", size=3, seed=s) for s in (7, 8))
    assert [one[i]["question"] for i in (1, 2)] == [next_seed[i]["question"] for i in (0, 1)]
    assert (
        parse_recipe({**recipe_dict(), "rl": RL}).data.reasoning_gym.eval_seed == 1000
    )  # seed 0 + size 1000


def recipe_dict() -> dict:
    return {
        "output_dir": "/tmp/x",
        "model": {"name_or_path": "m"},
        "data": {"train": "reasoning_gym:chain_sum"},
    }


@pytest.mark.parametrize(
    "data, rl, message",
    [
        ({"reasoning_gym": {"size": 4}}, RL, "data.train: reasoning_gym:chain_sum makes RL prompt records"),
        (
            {"train": ["reasoning_gym:chain_sum", "a.jsonl"]},
            RL,
            "train: reasoning_gym:TASK names one task (e.g. reasoning_gym:letter_counting) and is the whole split",
        ),
        (
            {"train": "a.jsonl", "reasoning_gym": {"size": 4}},
            RL,
            "reasoning_gym: applies to data.train/data.eval given as reasoning_gym:TASK",
        ),
        (
            {
                "eval": "reasoning_gym:chain_sum",
                "reasoning_gym": {"size": 10, "eval_seed": 5, "eval_size": 10},
            },
            RL,
            "reasoning_gym.eval_seed: reasoning-gym draws entry i of seed s with Random(s + i), so eval's seeds "
            "5..14 would repeat training prompts of chain_sum (seeds 0..9); use eval_seed >= 10 (the default: "
            "seed + size)",
        ),
        (
            {"reasoning_gym": {"config": {"seed": 1}}},
            RL,
            "config: seed are set by reasoning_gym.size/seed/eval_seed",
        ),
        (
            {"train": [{"path": "reasoning_gym:chain_sum"}, {"path": "a.jsonl"}]},
            RL,
            "train[0].path: reasoning_gym:TASK makes RL prompts, not a mixture source",
        ),
        (
            {},
            {"rewards": [{"function": "reasoning_gym", "args": {"column": "x"}}]},
            "args: column not a setting",
        ),
    ],
)
def test_the_recipe_refuses(data, rl, message):
    raw = recipe_dict()
    raw["data"] = {**raw["data"], **data}
    if "makes RL prompt records" not in message:
        raw["rl"] = rl
    with pytest.raises(RecipeError, match=re.escape(message)):
        parse_recipe(raw)


@pytest.mark.parametrize(
    "task, config, message",
    [
        (
            "leter_counting",
            {},
            "data.train: reasoning_gym:leter_counting is not a reasoning-gym task (close names: letter_counting",
        ),
        (
            "letter_counting",
            {"min_wrds": 3},
            "data.reasoning_gym.config.min_wrds: not a setting of letter_counting (it takes min_words, max_words)",
        ),
        ("letter_counting", {"min_words": 0}, "data.reasoning_gym.config: letter_counting refuses"),
    ],
)
def test_unknown_tasks_and_settings_are_named(tmp_path, task, config, message):
    settings = recipe(tmp_path, "letter_counting").data.reasoning_gym.model_copy(update={"config": config})
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_task(task, settings, False, "data.train")
