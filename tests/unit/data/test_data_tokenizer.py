"""Tokenizer training for pretraining from scratch: a byte-level BPE trained on the corpus, cached, used by a run."""

import json

import pytest

import training.data.tokenizer_training as tt
from conftest import ROOT, TINY_ARCH, train_inprocess
from training.config import ModelSection, TokenizerTraining, parse_recipe
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer

CORPUS = str(ROOT / "data/tiny_stories.txt")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_trained_bpe_round_trips_and_is_cached(cache, monkeypatch):
    cfg = ModelSection(from_scratch={}, train_tokenizer=TokenizerTraining(vocab_size=400, files=[CORPUS]))
    tok = load_tokenizer(cfg)
    assert len(tok) == 400
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    text = "Tom went to the park with a dog. Ünïcode ✓ works too"  # byte-level: no unknown tokens
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    # merges learned from the corpus (33 bytes)
    assert len(tok("The dog found a ball in the park.")["input_ids"]) <= 33 // 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>user"
    )

    calls = []

    class Trains(Exception):
        """Raised by the stub: training was asked for."""

    def stub(*a):
        calls.append(a)
        raise Trains

    monkeypatch.setattr(tt, "train_bpe", stub)
    again = load_tokenizer(cfg)  # cached: no training
    assert not calls and again(text)["input_ids"] == ids
    cfg2 = ModelSection(from_scratch={}, train_tokenizer=TokenizerTraining(vocab_size=500, files=[CORPUS]))
    with pytest.raises(Trains):
        load_tokenizer(cfg2)  # a different vocab size is a different tokenizer: it must train (stubbed here)
    assert calls


def test_recipe_rules_for_train_tokenizer():
    r = parse_recipe(
        {
            "output_dir": "x",
            "model": {"from_scratch": {}, "train_tokenizer": {"vocab_size": 1000}},
            "data": {"train": CORPUS, "format": "text"},
        }
    )
    assert r.model.train_tokenizer.files == [CORPUS]  # defaults to data.train
    with pytest.raises(RecipeError, match="train_tokenizer is for model.from_scratch"):
        parse_recipe(
            {
                "output_dir": "x",
                "model": {"name_or_path": "m", "train_tokenizer": {}},
                "data": {"train": CORPUS},
            }
        )
    with pytest.raises(RecipeError, match="needs model.tokenizer .* or model.train_tokenizer"):
        parse_recipe({"output_dir": "x", "model": {"from_scratch": {}}, "data": {"train": CORPUS}})


def test_pretraining_run_with_trained_tokenizer_learns(make_recipe, tmp_path, cache):
    recipe = make_recipe(
        model={"tokenizer": None, "train_tokenizer": {"vocab_size": 512}, "from_scratch": dict(TINY_ARCH)},
        data={"eval_fraction": 0.1, "max_length": 64},
        train={"max_steps": 12, "batch_size": 8, "lr": 5e-3},
        eval={"at_start": True, "max_batches": 4},
    )
    assert train_inprocess(recipe) == 0
    run = tmp_path / "run"
    rows = (run / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(row)["eval_loss"] for row in rows if "eval_loss" in row]
    assert evals[-1] < evals[0] - 1.0  # a 512-token vocabulary starts near ln(512) = 6.2 and falls fast
    saved = json.loads((run / "final" / "tokenizer.json").read_text())
    # 256 bytes + 3 special tokens + merges (this small corpus runs out of frequent pairs before 512)
    assert len(saved["model"]["vocab"]) > 300 and saved["added_tokens"][0]["content"] == "<|endoftext|>"
    assert list(cache.glob("tokenizers/bpe-512-*/tokenizer.json"))
