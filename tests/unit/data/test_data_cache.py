"""The on-disk data cache: hit on a second launch (no preprocessing), invalidated by anything that changes
the result (data file bytes, tokenizer, max_length, packing, column mapping)."""

import json
import logging
import shutil

import pytest

import training.data.pipeline as data_mod
from conftest import ROOT, TOKENIZER
from training.config import ModelSection, parse_recipe
from training.data.formats import CHATML
from training.data.tokenizer import load_tokenizer

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": str(2 * i)},
        ]
    }
    for i in range(40)
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


@pytest.fixture
def counting(monkeypatch):
    """Counts calls of the tokenizing step, so a cache hit is visible as zero calls."""
    calls = []
    real = data_mod.tokenize_parallel

    def wrapped(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(data_mod, "tokenize_parallel", wrapped)
    return calls


def recipe(tmp_path, train, **data):
    return parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": TOKENIZER},
            "data": {"train": str(train), "max_length": 64, "cache_dir": str(tmp_path / "cache"), **data},
        }
    )


def test_second_build_hits_the_cache_and_changes_invalidate_it(tmp_path, tok, counting, caplog):
    caplog.set_level(logging.INFO)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    first, _ = data_mod.build_datasets(recipe(tmp_path, path, packing=True), tok)
    assert len(counting) == 1 and "data cache written" in caplog.text
    caplog.clear()
    again, _ = data_mod.build_datasets(recipe(tmp_path, path, packing=True), tok)
    assert len(counting) == 1, "second launch must not preprocess"
    assert "data cache hit, preprocessing skipped" in caplog.text
    assert again[:] == first[:]
    assert "packing efficiency" in caplog.text  # the start-up line is reported on a hit too

    # Each of these changes the result, so each must miss.
    data_mod.build_datasets(recipe(tmp_path, path, packing=False), tok)
    assert len(counting) == 2
    data_mod.build_datasets(recipe(tmp_path, path, packing=True, max_length=48), tok)
    assert len(counting) == 3
    other_tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    other_tok.chat_template = CHATML  # a different template renders different tokens
    data_mod.build_datasets(recipe(tmp_path, path, packing=True), other_tok)
    assert len(counting) == 4
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text(path.read_text().replace('"messages"', '"dialog"'))
    data_mod.build_datasets(recipe(tmp_path, renamed, packing=True, columns={"messages": "dialog"}), tok)
    assert len(counting) == 5

    # Same name, new contents: the cache notices.
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:20]))
    caplog.clear()
    changed, _ = data_mod.build_datasets(recipe(tmp_path, path, packing=True), tok)
    assert len(counting) == 6 and "data cache written" in caplog.text
    assert sum(map(len, changed["input_ids"])) < sum(map(len, first["input_ids"]))


def test_cache_can_be_disabled_and_survives_a_half_written_entry(tmp_path, tok, counting):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    data_mod.build_datasets(recipe(tmp_path, path, cache=False), tok)
    data_mod.build_datasets(recipe(tmp_path, path, cache=False), tok)
    assert len(counting) == 2 and not (tmp_path / "cache").exists()
    # a crashed writer leaves only a temporary directory: it is not mistaken for an entry
    data_mod.build_datasets(recipe(tmp_path, path), tok)
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p.name != "units")
    shutil.move(entry, entry.with_name(f".tmp-{entry.name}.999"))  # what fs.atomic_dir leaves when killed
    data_mod.build_datasets(recipe(tmp_path, path), tok)
    assert len(counting) == 4 and entry.is_dir()


def text_recipe(tmp_path, files, **data):
    return parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": TOKENIZER},
            "data": {"train": [str(f) for f in files], "format": "text", "max_length": 16, **data},
        }
    )


def test_parallel_per_shard_tokenizing_equals_the_serial_pipeline(tmp_path, tok, monkeypatch):
    from training.data import shards
    from training.data.examples import tokenize_split
    from training.data.load import load_raw

    stories = (ROOT / "data/tiny_stories.txt").read_text().splitlines()
    files = []
    for i, (a, b) in enumerate([(0, 150), (150, 230), (230, 420)]):
        files.append(tmp_path / f"s{i}.txt")
        files[-1].write_text("\n".join(stories[a:b]) + "\n")
    # the serial pipeline on the whole split (what build_datasets did before units): the reference
    recipe = text_recipe(tmp_path, files, cache=False)
    raw = load_raw([str(f) for f in files], "text", "data.train")
    want, _ = tokenize_split(raw, recipe.data, tok)
    monkeypatch.setattr(shards, "UNIT_ROWS", 64)  # files cut into several units
    monkeypatch.setattr(shards, "PARALLEL_MIN_ROWS", 0)
    got, _ = data_mod.build_datasets(text_recipe(tmp_path, files, cache=False, num_proc=2), tok)
    assert got[:] == want[:]

    # per-shard cache: adding a shard tokenizes only the new shard's units
    cache = tmp_path / "cache"
    data_mod.build_datasets(text_recipe(tmp_path, files[:2], cache_dir=str(cache), num_proc=1), tok)
    before = {p.name: p.stat().st_mtime_ns for p in (cache / "units").iterdir() if p.is_dir()}
    assert len(before) == 3 + 2  # 150 + 80 rows in units of 64
    again, _ = data_mod.build_datasets(text_recipe(tmp_path, files, cache_dir=str(cache), num_proc=1), tok)
    after = {p.name: p.stat().st_mtime_ns for p in (cache / "units").iterdir() if p.is_dir()}
    assert {k: after[k] for k in before} == before and len(after) == len(before) + 3  # 190 new rows
    assert again[:] == want[:]
