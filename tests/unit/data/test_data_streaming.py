"""Streaming training data (data.streaming): the same batches as the pre-tokenized run, in one process and
under 2-process DDP; a kill -9 mid-stream resumes at the same token, bit for bit, without reading any
record twice; bad shards are named with file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, TINY_ARCH, TOKENIZER, train_inprocess
from launching import (
    CKPT_AT,
    STEPS,
    TWO_RANKS,
    assert_same_run,
    kill_and_resume,
    launch,
    rows,
    weights,
)
from training.data.streaming import TRACE_ENV

pytestmark = pytest.mark.slow


def lines_to(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    return str(path)


def write_recipe(path: Path, data: dict, **extra) -> Path:
    recipe = {
        "output_dir": str(path.parent / "unused"),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {"max_length": 32, "cache_dir": str(path.parent / "cache"), "num_proc": 1, **data},
        "train": {"lr": 3e-3, "batch_size": 4, "max_steps": STEPS, "warmup_steps": 2, "scheduler": "cosine"},
        "eval": {"at_start": False, "every_steps": CKPT_AT},
        **extra,
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_streaming_trains_on_the_pretokenized_batches_single_and_ddp(tmp_path):
    stories = (ROOT / "data/tiny_stories.txt").read_text().splitlines()
    shards = [lines_to(tmp_path / "a.txt", stories[:90]), lines_to(tmp_path / "b.txt", stories[90:200])]
    recipe = write_recipe(
        tmp_path / "r.yaml",
        {"train": shards, "eval": lines_to(tmp_path / "eval.txt", stories[1000:1040]), "format": "text"},
    )
    ref, single, ddp = tmp_path / "pretokenized", tmp_path / "stream", tmp_path / "stream-ddp"
    assert train_inprocess(recipe, f"output_dir={ref}") == 0
    # one window holds the whole corpus: the window's shuffle is the pre-tokenized epoch's shuffle
    stream = ["data.streaming=true", "data.stream_window=1000"]
    assert train_inprocess(recipe, f"output_dir={single}", *stream) == 0
    assert_same_run(single, ref)
    got = rows(single, "loss")
    assert got[STEPS]["data_tokens/train"] == STEPS * 4 * 32  # every row a full block
    proc = launch("ddp.yaml", recipe, f"output_dir={ddp}", *stream, *TWO_RANKS)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_same_run(ddp, ref)


def test_kill_mid_stream_resumes_bit_identically_without_rereading(tmp_path, monkeypatch):
    records = (ROOT / "data/alpaca_tiny.jsonl").read_text().splitlines()
    shards = [lines_to(tmp_path / "a.jsonl", records[:70]), lines_to(tmp_path / "b.jsonl", records[70:180])]
    data = {
        "train": shards,
        "eval": lines_to(tmp_path / "eval.jsonl", records[180:]),
        "format": "instruction",
        "max_length": 64,
        "packing": True,
        "streaming": True,
        "stream_window": 10,  # the step-3 checkpoint falls inside a window: its buffer is part of the state
    }
    recipe = write_recipe(tmp_path / "r.yaml", data, checkpoint={"every_steps": CKPT_AT, "keep_last": 5})
    trace = tmp_path / "windows.txt"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    launch("single.yaml", recipe, f"output_dir={uninterrupted}")
    trace.unlink()
    kill_and_resume("single.yaml", recipe, killed)
    assert_same_run(killed, uninterrupted)

    a, b = weights(killed), weights(uninterrupted)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run's"
    state = torch.load(
        killed / "checkpoints" / f"step-{CKPT_AT}" / "custom_checkpoint_1.pkl", weights_only=False
    )
    (src,) = state["sources"]
    assert src["rows"], "the checkpoint falls inside a window: its unread rows travel in the state"
    windows = [line.split() for line in trace.read_text().splitlines()]
    resumed_pid = windows[-1][0]
    resumed = [(int(w[3]), int(w[4])) for w in windows if w[0] == resumed_pid and w[2] == "0"]
    # the resumed process starts reading where the checkpointed window ended, and reads each record once
    assert resumed[0][0] == src["pos"]["records"] > 0
    assert all(end == nxt for (_, end), (nxt, _) in zip(resumed, resumed[1:]))
    assert (
        rows(killed, "loss")[STEPS]["data_records_read"]
        < rows(uninterrupted, "loss")[STEPS]["data_records_read"]
    )


def test_bad_shard_is_named_with_file_and_line(tmp_path, make_recipe, capsys):
    good = json.dumps({"instruction": "Say hi.", "output": "hi"})
    bad = lines_to(tmp_path / "bad.jsonl", [good, good, "", '{"instruction": "x"}'])
    recipe = make_recipe(
        data={"train": bad, "format": "instruction", "streaming": True, "max_examples": None},
        train={"max_steps": 2},
    )
    with pytest.raises(SystemExit) as exit_:  # the CLI wrapper exits with the data error's code
        train_inprocess(recipe)
    assert exit_.value.code == 2
    assert f"{bad} line 4: missing string field 'output'" in capsys.readouterr().err
