"""A reasoning-gym task end to end on a tiny model: data.train/data.eval: reasoning_gym:TASK train two GRPO
steps scored by the reasoning_gym reward (the samples' prompts are the task's questions, their rewards the
task's own scores); an unknown task stops the CLI before training with exit 2, naming the key and close names."""

from __future__ import annotations

import json

import reasoning_gym
import yaml

from conftest import TINY_ARCH, TOKENIZER, run_cli, train_inprocess
from launching import rows

CONFIG = {"min_words": 3, "max_words": 4}


def write_recipe(tmp_path, task: str = "letter_counting"):
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {
            "train": f"reasoning_gym:{task}",
            "eval": f"reasoning_gym:{task}",
            "reasoning_gym": {"size": 8, "seed": 0, "eval_size": 4, "config": CONFIG},
            "max_length": 128,
            "cache": False,
        },
        "rl": {
            "num_generations": 3,
            "max_new_tokens": 5,
            "rewards": [{"function": "reasoning_gym", "args": {"answer_tag": "answer"}}],
        },
        "train": {"lr": 1e-3, "batch_size": 4, "max_steps": 2, "warmup_steps": 0},
        "eval": {"at_start": False, "every_steps": 2, "batch_size": 4},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_two_grpo_steps_on_a_reasoning_gym_task(tmp_path):
    assert train_inprocess(write_recipe(tmp_path)) == 0
    run = tmp_path / "run"
    train = rows(run, "reward")
    assert sorted(train) == [1, 2] and all("reward/reasoning_gym" in r for r in train.values())
    assert sorted(rows(run, "eval_reward")) == [2]
    lib = reasoning_gym.create_dataset("letter_counting", size=8, seed=0, **CONFIG)
    entries = {lib[i]["question"]: lib[i] for i in range(8)}
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        entry = entries[s["prompt"]]  # a training prompt: one of the task's questions
        answer = (
            s["completion"].split("<answer>")[-1].split("</answer>")[0]
            if "</answer>" in s["completion"]
            else None
        )
        assert s["reasoning_gym"] == lib.score_answer(answer and answer.strip(), entry)
    assert (run / "final" / "model.safetensors").is_file()


def test_an_unknown_task_stops_the_cli_before_training_with_exit_2(tmp_path):
    proc = run_cli("training.train", write_recipe(tmp_path, "leter_counting"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "error: data.train: reasoning_gym:leter_counting is not a reasoning-gym task (close names: letter_counting"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
