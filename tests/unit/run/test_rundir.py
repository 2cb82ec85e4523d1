"""training.run.rundir.resolve_source: the one function that decides what a user-given path is (a run
directory, its final/, a checkpoint, an adapter or model directory, a hub name), on hand-made
directories; every refusal is a UserError naming the option and the path."""

from __future__ import annotations

import pytest

from training.core.errors import UserError
from training.run.rundir import (
    ADAPTER_CONFIG,
    CHECKPOINT_MARKER,
    CHECKPOINT_STATE,
    MODEL_CONFIG,
    RunDir,
    Source,
    resolve_source,
)


def make_run(root, *, final: str | None = None, steps: tuple = (), incomplete: tuple = ()) -> RunDir:
    """A run directory with config.yaml, optionally final/ (an "adapter" or a "model") and checkpoints."""
    run = RunDir(root)
    run.root.mkdir(parents=True)
    run.config.write_text("output_dir: x\n")
    if final is not None:
        run.final.mkdir()
        (run.final / (ADAPTER_CONFIG if final == "adapter" else MODEL_CONFIG)).write_text("{}")
    for step in steps:
        run.checkpoint(step).mkdir(parents=True)
        (run.checkpoint(step) / CHECKPOINT_MARKER).write_text("")
        (run.checkpoint(step) / CHECKPOINT_STATE).write_text("{}")
    for step in incomplete:  # killed while saving: no marker
        run.checkpoint(step).mkdir(parents=True)
    return run


def test_run_with_final_resolves_to_final(tmp_path):
    run = make_run(tmp_path / "run", final="adapter", steps=(2, 4))
    assert resolve_source(run.root) == Source("adapter", run.final, run)
    assert resolve_source(run.final) == Source("adapter", run.final, run)
    full = make_run(tmp_path / "full", final="model")
    assert resolve_source(str(full.root)) == Source("model", full.final, full)


def test_run_without_final_resolves_to_newest_complete_checkpoint(tmp_path):
    run = make_run(tmp_path / "run", steps=(2, 10), incomplete=(12,))
    assert resolve_source(run.root) == Source("checkpoint", run.checkpoint(10), run)


def test_checkpoint_resolves_with_its_run(tmp_path):
    run = make_run(tmp_path / "run", steps=(2, 4))
    assert resolve_source(run.checkpoint(2)) == Source("checkpoint", run.checkpoint(2), run)


def test_adapter_and_model_directories_outside_runs(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / ADAPTER_CONFIG).write_text("{}")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / MODEL_CONFIG).write_text("{}")
    assert resolve_source(tmp_path / "adapter") == Source("adapter", tmp_path / "adapter", None)
    assert resolve_source(tmp_path / "model") == Source("model", tmp_path / "model", None)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_source(tmp_path / "m.gguf") == Source("model", tmp_path / "m.gguf", None)


def test_hub_and_bundled_names(tmp_path):
    assert resolve_source("HuggingFaceTB/SmolLM2-135M") == Source("model", "HuggingFaceTB/SmolLM2-135M")
    assert resolve_source("bundled:smollm2-135m-instruct") == Source("model", "bundled:smollm2-135m-instruct")
    with pytest.raises(UserError, match="no such run or adapter directory, checkpoint or model"):
        resolve_source("HuggingFaceTB/SmolLM2-135M", what="run", hub=False)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such run or adapter directory, checkpoint or model"),
        ("./missing/dir", "no such run or adapter directory, checkpoint or model"),
        ("empty-run", "the run has neither final/ nor a complete checkpoint yet"),
        ("run/checkpoints/step-12", "an incomplete checkpoint"),
        ("plain-dir", "not a run directory, checkpoint, adapter or model directory"),
        ("notes.txt", "a file; give a run directory"),
    ],
)
def test_refusals_name_the_option_and_the_path(tmp_path, monkeypatch, case, message):
    monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "empty-run")
    make_run(tmp_path / "run", steps=(2,), incomplete=(12,))
    (tmp_path / "plain-dir").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    path = case if case.startswith(".") else str(tmp_path / case)
    with pytest.raises(UserError) as info:
        resolve_source(path, what="method.lora.init_from")
    assert str(info.value).startswith(f"method.lora.init_from: {path}: ")
    assert message in str(info.value)
