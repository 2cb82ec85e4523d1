"""Before training, a run whose plan exceeds the machine's memory is warned about, naming the setting that
would make it fit (training.planning.preflight.memory_fit); a run that fits says what it needs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import SMOLLM2_TOKENIZER, TINY_ARCH, TOKENIZER, train_inprocess
from training.config import parse_recipe
from training.data import load_tokenizer
from training.launch.backend import launched_backend
from training.planning import preflight
from training.planning.memory import GiB

CPU = torch.device("cpu")


@pytest.fixture
def recipe(tmp_path):
    """A small model whose activations dominate: 16 rows of 1024 tokens through 8 layers of 256, over SmolLM2's
    whole vocabulary (planned, never trained)."""
    arch = dict(TINY_ARCH, hidden_size=256, intermediate_size=512, num_hidden_layers=8)
    arch["max_position_embeddings"] = 1024
    return parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"tokenizer": SMOLLM2_TOKENIZER, "from_scratch": arch},
            "data": {"train": "x.txt", "format": "text", "max_length": 1024},
            "train": {"batch_size": 16, "grad_accum": 1},
        }
    )


def needs(recipe, tok, batch_size, grad_accum, checkpointing, tiled=False) -> float:
    """The planner's host-memory figure (GiB) for one CPU process with these settings."""
    config = preflight.model_config(recipe, tok)
    inv = preflight.inventory(recipe, config)
    switches = {"gradient_checkpointing": True} if checkpointing else {}
    r = preflight.with_batch(
        recipe, batch_size, grad_accum, switches | ({"tiled_mlp": True} if tiled else {})
    )
    b = launched_backend()
    b = type(b)(**{**b.__dict__, "cpu": True})
    return preflight.plan_backend(r, inv, b, 1, 0.0, None, checkpointing, 1).host_gib


def available(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(preflight.psutil, "virtual_memory", lambda: SimpleNamespace(available=gib * GiB))


def test_a_run_that_fits_warns_nothing(recipe, monkeypatch):
    tok = load_tokenizer(recipe.model)
    available(monkeypatch, 64)
    assert preflight.memory_fit(recipe, preflight.run_inventory(recipe, tok), launched_backend(), CPU) is None


def test_a_smaller_micro_batch_with_more_accumulation_is_named_first(recipe, monkeypatch):
    """The same examples per step, the largest micro-batch that fits: 8 x 2 does not, 4 x 4 does."""
    tok = load_tokenizer(recipe.model)
    full, half, quarter = (needs(recipe, tok, 16 // k, k, False) for k in (1, 2, 4))
    assert quarter < half < full
    available(monkeypatch, (half + quarter) / 2)
    warning = preflight.memory_fit(recipe, preflight.run_inventory(recipe, tok), launched_backend(), CPU)
    assert warning.startswith("memory: the plan for this run needs more than this machine has (needs ")
    assert "it may be killed for memory mid-run" in warning
    assert f"it would fit with train.batch_size=4 train.grad_accum=4 ({quarter:.1f} GiB)" in warning, warning


def test_checkpointing_is_named_when_no_smaller_batch_alone_fits(recipe, monkeypatch):
    tok = load_tokenizer(recipe.model)
    one = needs(recipe, tok, 1, 16, False)
    ckpt_full, ckpt_half = needs(recipe, tok, 16, 1, True), needs(recipe, tok, 8, 2, True)
    assert ckpt_half < min(ckpt_full, one)
    available(monkeypatch, (ckpt_half + min(ckpt_full, one)) / 2)  # batch 1 is too much without checkpointing
    warning = preflight.memory_fit(recipe, preflight.run_inventory(recipe, tok), launched_backend(), CPU)
    want = "it would fit with model.gradient_checkpointing=true train.batch_size=8 train.grad_accum=2"
    assert f"{want} ({ckpt_half:.1f} GiB)" in warning, warning


def test_the_tiled_mlp_is_named_when_checkpointing_alone_does_not_fit(tmp_path, monkeypatch):
    """One row of 4096 tokens through a 16x-wide MLP: with checkpointing the one recomputed layer's
    intermediates dominate; 16 tiles of 256 tokens hold them one tile at a time."""
    arch = dict(TINY_ARCH, hidden_size=256, intermediate_size=4096, num_hidden_layers=8)
    arch["max_position_embeddings"] = 4096
    recipe = parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"tokenizer": TOKENIZER, "from_scratch": arch},
            "data": {"train": "x.txt", "format": "text", "max_length": 4096},
            "train": {"batch_size": 1, "grad_accum": 1},
        }
    )
    tok = load_tokenizer(recipe.model)
    ckpt, tiled = needs(recipe, tok, 1, 1, True), needs(recipe, tok, 1, 1, True, tiled=True)
    assert tiled < ckpt
    available(monkeypatch, (tiled + ckpt) / 2)
    warning = preflight.memory_fit(recipe, preflight.run_inventory(recipe, tok), launched_backend(), CPU)
    assert (
        f"it would fit with model.gradient_checkpointing=true model.tiled_mlp=true ({tiled:.1f} GiB)"
        in warning
    )


def test_a_run_within_ten_percent_of_the_limit_is_told_what_would_lower_it(recipe, monkeypatch, caplog):
    tok = load_tokenizer(recipe.model)
    need = needs(recipe, tok, 16, 1, False)
    available(monkeypatch, need / 0.95)
    with caplog.at_level("INFO", logger="training.planning.preflight"):
        assert (
            preflight.memory_fit(recipe, preflight.run_inventory(recipe, tok), launched_backend(), CPU)
            is None
        )
    assert (
        "memory: that is within 10% of the limit; it would fit with train.batch_size=8 train.grad_accum=2"
        in (caplog.text)
    )


def test_nothing_that_fits_points_at_the_planner(recipe, monkeypatch):
    tok = load_tokenizer(recipe.model)
    available(monkeypatch, 0.001)
    warning = preflight.memory_fit(recipe, preflight.run_inventory(recipe, tok), launched_backend(), CPU)
    assert "no smaller batch, checkpointing or tiling makes it fit" in warning
    assert "python -m training.plan compares them" in warning


def test_the_warning_is_said_before_training_and_the_run_goes_on(make_recipe, monkeypatch, capfd):
    available(monkeypatch, 0.001)
    path = make_recipe(train={"max_steps": 1})
    assert train_inprocess(path) == 0
    err = capfd.readouterr().err
    assert "memory: the plan for this run needs more than this machine has" in err
    assert err.index("memory: the plan") < err.index("done: ")  # said at start-up; the run still ends well
