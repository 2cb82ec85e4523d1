"""Weighted mixtures (data.train: [{path, weight}, ...]): the token shares follow the weights, per-source
counts reach metrics.jsonl, the order follows the seed, and a bad source is named by its key."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from conftest import ROOT, TINY_ARCH, TOKENIZER, train_inprocess
from training.config import ModelSection, parse_recipe
from training.core.errors import RecipeError
from training.data.streaming import StreamLoader
from training.data.tokenizer import load_tokenizer


def shards(tmp_path):
    """Two sources of different lengths: short alpaca answers and long-ish stories (as instructions)."""
    alpaca = (ROOT / "data/alpaca_tiny.jsonl").read_text()
    stories = (ROOT / "data/tiny_stories.txt").read_text().splitlines()[:300]
    story_rows = [{"instruction": "Tell a story.", "output": s} for s in stories if s.strip()]
    (tmp_path / "short.jsonl").write_text(alpaca)
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in story_rows))
    return str(tmp_path / "short.jsonl"), str(tmp_path / "long.jsonl")


def mixture(tmp_path, seed=0, **train):
    short, long = shards(tmp_path)
    return {
        "output_dir": str(tmp_path / "run"),
        "seed": seed,
        "model": {"name_or_path": TOKENIZER},
        "data": {
            "train": [{"path": short, "weight": 0.7}, {"path": long, "weight": 0.3}],
            "format": "instruction",
            "max_length": 64,
            "packing": True,
            "streaming": True,
            "stream_window": 64,
            "num_proc": 1,
        },
        "train": {"max_steps": 10, "batch_size": 4, **train},
    }


def loader(recipe: dict) -> StreamLoader:
    tokenizer = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    return StreamLoader(parse_recipe(recipe), tokenizer, 0, 1, torch.device("cpu"))


def test_token_shares_follow_the_weights_and_the_seed_fixes_the_order(tmp_path):
    dl = loader(mixture(tmp_path))
    it = iter(dl)
    batches = [next(it) for _ in range(50)]
    short, long = dl.tokens
    assert abs(short / (short + long) - 0.7) < 0.02, dl.tokens
    assert sum(int(b["input_ids"].ne(0).sum()) for b in batches) > 0
    assert dl.metrics()["data_tokens/short"] == short and dl.metrics()["data_tokens/long"] == long
    # the same seed gives the same rows; another seed another order
    again = iter(loader(mixture(tmp_path)))
    assert all(torch.equal(next(again)["input_ids"], b["input_ids"]) for b in batches[:5])
    other = iter(loader(mixture(tmp_path, seed=1)))
    assert not all(torch.equal(next(other)["input_ids"], b["input_ids"]) for b in batches[:5])


def test_mixture_run_logs_per_source_tokens(tmp_path):
    recipe = mixture(tmp_path)
    recipe["model"] = {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)}
    recipe["train"] = {"max_steps": 4, "batch_size": 4, "lr": 1e-3, "warmup_steps": 0}
    recipe["eval"] = {"at_start": False}
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert train_inprocess(path) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    assert last["step"] == 4 and last["data_tokens/short"] > last["data_tokens/long"] > 0
    assert last["data_tokens/short"] + last["data_tokens/long"] == sum(
        r["tokens"] for r in rows if "loss" in r
    )


def test_each_source_has_its_own_eval_and_eval_loss_covers_all_their_tokens(tmp_path):
    """data.eval: {short: ..., long: ...} scores each held-out set on its own (eval_loss/NAME) and
    eval_loss is the loss over all their labelled tokens, so the token-weighted mean of the two."""
    from training.data import build_datasets

    recipe = mixture(tmp_path)
    short, long = (src["path"] for src in recipe["data"]["train"])
    recipe["data"]["eval"] = {"short": short, "long": long}
    recipe["model"] = {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)}
    recipe["train"] = {"max_steps": 2, "batch_size": 4, "lr": 1e-3, "warmup_steps": 0}
    recipe["eval"] = {"at_start": True, "max_batches": 3}
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert train_inprocess(path) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2]
    _, sets = build_datasets(parse_recipe(recipe), load_tokenizer(ModelSection(name_or_path=TOKENIZER)))
    assert sorted(sets) == ["long", "short"]
    counts = {  # labelled tokens in the first 3 eval batches of 4 rows
        name: sum(sum(x != -100 for x in row["labels"][1:]) for row in ds.select(range(min(12, len(ds)))))
        for name, ds in sets.items()
    }
    for r in evals:
        a, b = r["eval_loss/short"], r["eval_loss/long"]
        assert a != b and r["eval_ppl/short"] == pytest.approx(math.exp(a))
        mean = (a * counts["short"] + b * counts["long"]) / (counts["short"] + counts["long"])
        assert r["eval_loss"] == pytest.approx(mean, rel=1e-6)
    assert (tmp_path / "run" / "loss.png").is_file()


def test_a_held_out_set_name_must_name_a_metric():
    recipe = {
        "output_dir": "unused",
        "model": {"name_or_path": TOKENIZER},
        "data": {"train": "data/alpaca_tiny.jsonl", "eval": {"my set": "data/alpaca_tiny.jsonl"}},
    }
    with pytest.raises(RecipeError, match=r"eval.my set: a held-out set's name is letters, digits"):
        parse_recipe(recipe)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["train"][1].update(weight=-1), "train[1].weight must be a positive number (got -1)"),
        (lambda d: d["train"][0].update(path="missing/nowhere.jsonl"), "data.train[0].path: data file"),
    ],
)
def test_bad_sources_are_named(tmp_path, change, message, capsys):
    recipe = mixture(tmp_path)
    recipe["model"] = {
        "tokenizer": TOKENIZER,
        "from_scratch": dict(TINY_ARCH),
    }  # errors come before the model
    change(recipe["data"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    try:
        code = train_inprocess(path)
    except SystemExit as e:  # a recipe error exits from the CLI wrapper
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
