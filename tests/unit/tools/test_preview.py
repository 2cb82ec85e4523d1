"""python -m training.preview: the first records as the trainer tokenizes them, the loss tokens marked, and the
records' lengths against max_length."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from training.preview import main

LORA = str(ROOT / "training/recipes/lora.yaml")


def test_the_preview_marks_the_answer_as_the_loss_and_counts_lengths(capsys):
    assert main([LORA, "--examples", "2", "--scan", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    first = out["examples"][0]
    loss = [s for s in first["segments"] if s["loss"]]
    assert len(loss) == 1 and loss[0]["text"].startswith(
        "2099-08-04<|im_end|>"
    )  # the assistant's answer only
    assert first["segments"][0]["text"].startswith("<|im_start|>system") and not first["segments"][0]["loss"]
    assert sum(s["tokens"] for s in first["segments"]) == first["tokens"]
    assert first["loss_tokens"] == loss[0]["tokens"] and len(out["examples"]) == 2
    assert out["scanned"] == 200 and out["longer_than_max_length"] == 0 and out["max_length"] == 256
    assert sum(out["lengths"]["counts"]) == 200 and out["tokens"] > 200 * 50


def test_a_short_max_length_shows_what_would_be_truncated(capsys):
    assert main([LORA, "data.max_length=64", "--examples", "1", "--scan", "100"]) == 0
    text = capsys.readouterr().out
    assert "--- example 1: 64 tokens" in text  # truncated as training truncates it
    longer = int(text.split("untruncated; ")[1].split(" (")[0])
    assert 0 < longer <= 100 and "longer than max_length=64 (data.too_long: truncate)" in text


def test_preference_data_is_refused_with_the_key(capsys):
    with pytest.raises(SystemExit) as exit:
        main([str(ROOT / "training/recipes/dpo.yaml")])
    assert exit.value.code == 2
    assert "data.format=pairwise: the preview shows supervised data" in capsys.readouterr().err


def test_the_data_check_names_the_file_and_line_the_trainer_would_refuse(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    good = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'
    (tmp_path / "good.jsonl").write_text(good * 3)
    (tmp_path / "no_answer.jsonl").write_text(good + '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    (tmp_path / "broken.jsonl").write_text(good + '{"messages": [\n')
    (tmp_path / "late.jsonl").write_text(good * 3 + "{not json\n")  # past the records read
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "output_dir: runs/x\nmodel: {name_or_path: bundled:smollm2-135m-instruct}\nmethod: {type: lora}\n"
        "data: {format: chat, train: [good.jsonl, no_answer.jsonl], eval: [broken.jsonl]}\n"
    )
    assert main([str(recipe), "--check", "--json"]) == 0  # JSON for the app: the problems, keyed
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert problems == {
        "data.train": ["no_answer.jsonl line 2: no assistant message, so nothing to learn from"],
        "data.eval": ["broken.jsonl line 2: not valid JSON (Expecting value)"],  # the first problem of a set
    }
    assert (
        main([str(recipe), "data.eval=[missing.jsonl]", "data.train=[late.jsonl]", "--check", "--scan", "3"])
        == 2
    )
    assert capsys.readouterr().out.strip() == "data.eval: data file missing.jsonl does not exist"
    assert main([str(recipe), "data.eval=null", "data.train=[late.jsonl]", "--check", "--scan", "3"]) == 0
    assert capsys.readouterr().out.strip() == "no problem found"
