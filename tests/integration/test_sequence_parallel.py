"""Sequence parallelism (training/parallel/sequence_parallel.py): every sequence split over 2 processes gives the
run of one process seeing the whole sequences; what cannot work is refused before anything loads; the
planner splits activations by the degree and names the degree that fits.

DeepSpeed Ulysses (accelerate_configs/sp_ulysses.yaml) runs here on 2 CPU processes over gloo, launched
exactly as a user would. The data are instruction examples (labels on the answers only, rows of
different lengths padded to the longest of the batch and then to a multiple of 2), so the test also
covers the labels shifted before the split (a shard's last token is labelled with the next shard's
first), the labelled and real token counts over the group, padding, and the accumulation window. Torch
context parallelism (cp.yaml) needs CUDA and is tested in test_distributed_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from conftest import ROOT, TINY_ARCH, TOKENIZER, train_inprocess
from launching import (
    LAUNCHER_ENV,
    assert_identical_run,
    assert_same_run,
    launch,
    launch_environment,
    rows,
    with_checkpoint_of,
)
from training.config import load_recipe
from training.core.errors import RecipeError
from training.launch.backend import Backend, read_backend

CONFIGS = ROOT / "accelerate_configs"
STEPS, CKPT_AT = 6, 3
# batch 2 x accumulation 3: the Ulysses group processes the same 6 rows per step as one process, and a
# resume at step 3 skips 9 micro-batches = 4 loader batches + 1 (the odd remainder of the group's cycle)
WINDOW = ["train.batch_size=2", "train.grad_accum=3"]


def write_recipe(path, output_dir, **extra) -> str:
    recipe = {
        "output_dir": str(output_dir),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {
            "train": str(ROOT / "data/alpaca_tiny.jsonl"),
            "format": "instruction",
            "max_length": 64,
            "eval_fraction": 0.05,
        },
        "train": {"lr": 3e-3, "max_steps": STEPS, "warmup_steps": 2, "scheduler": "cosine"},
        "eval": {"at_start": False, "every_steps": CKPT_AT},
        "checkpoint": {"every_steps": CKPT_AT, "keep_last": 5},
        **extra,
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sequence-parallel")


@pytest.mark.slow
def test_ulysses_on_two_processes_equals_one_process_and_resumes_exactly(work):
    """Over 60 s: two DeepSpeed launches (the run and its resume), and the first DeepSpeed run of a fresh
    environment JIT-compiles DeepSpeed's CPU ops (~3 min on 2 cores)."""
    recipe = write_recipe(work / "recipe.yaml", work / "unused")
    single, sp = work / "single", work / "sp"
    assert train_inprocess(recipe, f"output_dir={single}", *WINDOW) == 0
    proc = launch("sp_ulysses.yaml", recipe, f"output_dir={sp}", *WINDOW)
    assert "2 process(es), DEEPSPEED, DeepSpeed Ulysses sp=2" in proc.stderr
    assert "global batch 2 x 3 accumulation" in proc.stderr  # the group shares its batches
    assert_same_run(sp, single)  # losses, learning rates, eval losses, final weights
    # every real token counted once over the group (not once per process, not once per shard)
    tokens = {s: r["tokens"] for s, r in rows(sp, "loss").items()}
    assert tokens == {s: r["tokens"] for s, r in rows(single, "loss").items()}

    # kill-free resume from the step-3 checkpoint in a fresh directory: steps 4-6 and final/ as before
    resumed = with_checkpoint_of(sp, CKPT_AT, work / "sp-resumed")
    proc = launch("sp_ulysses.yaml", recipe, f"output_dir={resumed}", *WINDOW)
    assert f"resumed from {resumed / 'checkpoints' / f'step-{CKPT_AT}'}" in proc.stderr
    assert_identical_run(resumed, sp, steps=range(CKPT_AT + 1, STEPS + 1))  # measured: bit for bit


# ----------------------------------------------------------------------------- the batches before the split


def test_labels_are_shifted_and_rows_padded_before_the_sequence_is_split():
    from training.core.batch import IGNORE
    from training.data.loader import Collator
    from training.parallel.sequence_parallel import SplitCollator

    rows_ = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, IGNORE, 7, 8, 9]},
        {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
    ]
    collate = SplitCollator(Collator(pad_token_id=0), multiple=4, shift=True)  # context parallel, cp=2
    batch = collate(rows_)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2  # global positions, kept per shard
    assert "labels" not in batch
    # position i is labelled with token i+1: the shard [0:4]'s last target is the shard [4:8]'s first token
    assert batch["shift_labels"].tolist() == [
        [IGNORE, 7, 8, 9, IGNORE, IGNORE, IGNORE, IGNORE],
        [6, 7, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE],
    ]
    ulysses = SplitCollator(Collator(pad_token_id=0), multiple=2, shift=False)(rows_)  # DeepSpeed shifts
    assert ulysses["input_ids"].shape == (2, 6) and ulysses["labels"][0].tolist()[-1] == IGNORE


def test_the_loss_of_shifted_shards_adds_up_to_the_loss_of_the_whole_sequence():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from training.core.batch import IGNORE, labelled_tokens
    from training.data.loader import Collator
    from training.objectives.next_token import _full_loss, targets_of, token_loss
    from training.parallel.sequence_parallel import SplitCollator

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**TINY_ARCH, vocab_size=64), attn_implementation="sdpa"
    )
    ids = torch.randint(1, 64, (2, 8)).tolist()
    rows_ = [{"input_ids": r, "labels": [IGNORE] * 3 + r[3:]} for r in ids]
    whole, n, _ = token_loss(model, Collator(0)(rows_))
    split = SplitCollator(Collator(0), multiple=2, shift=True)(rows_)
    split_labels = Collator(0)(rows_)["labels"]
    full, m, _ = token_loss(model, split)  # all logits against the shifted labels
    assert n == m == labelled_tokens(split) == 2 * 5  # tokens 3..7 of each row
    torch.testing.assert_close(full, whole)
    # each shard's loss: its positions' logits (computed with the whole context, as the ring attention
    # gives them) against its slice of the shifted labels; the two add up to the whole sequence's loss
    inputs = {k: v for k, v in split.items() if k != "shift_labels"}
    with torch.no_grad():
        logits = model(**inputs).logits
    shards = [slice(0, 4), slice(4, 8)]
    losses = [_full_loss(logits[:, s], split["shift_labels"][:, s]) for s in shards]
    counts = [labelled_tokens({"shift_labels": split["shift_labels"][:, s]}) for s in shards]
    assert [int(c) for c in counts] == [2 * 2, 2 * 3]  # targets 3, 4 | 5, 6, 7 of each row: none twice
    assert all(loss > 0 for loss in losses)
    torch.testing.assert_close(sum(losses), whole)
    # labels shifted inside each shard instead would lose the target across the boundary (token 4)
    unshifted = [_full_loss(logits[:, s], targets_of({"labels": split_labels[:, s]})) for s in shards]
    assert sum(labelled_tokens({"labels": split_labels[:, s]}) for s in shards) == n - 2
    assert not torch.allclose(sum(unshifted), whole)


# ----------------------------------------------------------------------------- refused before loading


@pytest.fixture
def launched(monkeypatch):
    """launched(file) sets the environment `accelerate launch --config_file FILE` gives the processes."""

    def _env(config):
        for key in list(os.environ):
            if key.startswith(LAUNCHER_ENV):
                monkeypatch.delenv(key)
        for key, value in launch_environment(config).items():
            monkeypatch.setenv(key, value)

    return _env


def test_context_parallel_on_cpu_exits_2_naming_ulysses(work, launched, capsys):
    launched(CONFIGS / "cp.yaml")
    recipe = write_recipe(work / "cp.yaml", work / "cp-run")
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "parallelism_config_cp_size=2 (torch context parallelism) needs CUDA GPUs" in err
    assert "accelerate_configs/sp_ulysses.yaml" in err
    assert not (work / "cp-run").exists()  # nothing was written: refused before set-up


@pytest.mark.parametrize(
    "override, phrase",
    [
        ("data.max_length=63", "data.max_length=63 is not a multiple of 2"),
        ("data.packing=true", "data.packing=true cannot be used with sequence parallelism"),
        ("model.attn_implementation=eager", "model.attn_implementation=eager cannot be used with sequence"),
    ],
)
def test_ulysses_refuses_what_it_cannot_split_with_exit_2(override, phrase, work, launched, capsys):
    launched(CONFIGS / "sp_ulysses.yaml")
    recipe = write_recipe(work / "sp-bad.yaml", work / "sp-bad")
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe, override)
    assert e.value.code == 2 and phrase in capsys.readouterr().err


def test_ulysses_degree_must_split_the_attention_heads(work, launched):
    from training.data.tokenizer import load_tokenizer
    from training.parallel.accelerator import check_model_parallelism

    launched(CONFIGS / "sp_ulysses.yaml")
    three = write_recipe(
        work / "heads.yaml",
        work / "heads",
        model={
            "tokenizer": TOKENIZER,
            "from_scratch": {**TINY_ARCH, "hidden_size": 48, "num_attention_heads": 3},
        },
    )
    recipe = load_recipe(three)
    with pytest.raises(RecipeError) as e:  # before the model is built (trainer: exit 2)
        check_model_parallelism(recipe, load_tokenizer(recipe.model))
    assert "parallelism_config_sp_size=2" in str(e.value) and "3 attention heads (num_attention_heads" in str(
        e.value
    )
    assert "model.from_scratch.num_attention_heads" in str(e.value)
    recipe = load_recipe(write_recipe(work / "heads4.yaml", work / "heads4"))  # 4 heads: fine
    check_model_parallelism(recipe, load_tokenizer(recipe.model))


def test_grouped_key_value_heads_may_be_fewer_than_processes():
    from transformers import LlamaConfig

    from training.launch.checks import check_sequence_parallel

    config = LlamaConfig(**{**TINY_ARCH, "num_attention_heads": 8, "hidden_size": 64}, num_key_value_heads=2)

    def ulysses(sp):
        return Backend("sp", "sp.yaml", "deepspeed", num_processes=sp, sp_size=sp)

    check_sequence_parallel(config, ulysses(2))
    check_sequence_parallel(config, ulysses(4))  # DeepSpeed repeats the 2 key/value heads
    config.num_key_value_heads = 3
    config.num_attention_heads = 12
    with pytest.raises(
        RecipeError, match="neither divides nor is a multiple of the model's 3 key/value heads"
    ):
        check_sequence_parallel(config, ulysses(2))


# ----------------------------------------------------------------------------- planner and app


def test_planner_splits_activations_and_names_the_degree_that_fits(make_recipe, tmp_path):
    from training.planning.memory import estimate
    from training.planning.report import format_plan

    cfg = tmp_path / "cfg"
    cfg.mkdir()
    for name in ("zero2", "sp_ulysses"):
        (cfg / f"{name}.yaml").write_text((CONFIGS / f"{name}.yaml").read_text())
    arch = {**TINY_ARCH, "num_attention_heads": 8, "max_position_embeddings": 65536}
    recipe = load_recipe(
        make_recipe(
            model={"tokenizer": TOKENIZER, "from_scratch": arch},
            data={"max_length": 16384},
            # full logits: every activation term is per token (the chunked loss adds one fixed-size chunk)
            train={"loss_impl": "full"},
        )
    )
    plans = {p.backend + p.mesh: p for p in estimate(recipe, 8, 80, configs_dir=cfg)}
    zero2, sp2 = plans["zero2"], plans["sp_ulysses" + "sp=2"]
    assert sp2.devices == 8 and sp2.params_gib == zero2.params_gib  # ZeRO-2 over all 8 either way
    assert sp2.activations_gib == pytest.approx(zero2.activations_gib / 2, rel=1e-3)
    # a GPU too small for the whole sequence and for half of it: the smallest degree that fits
    need = zero2.peak_gib - zero2.activations_gib
    gpu = need + zero2.activations_gib / 3 + 0.75  # fits at sp=4, not at sp=2
    plans = estimate(recipe, 8, gpu, configs_dir=cfg)
    best = next(p for p in plans if p.recommended)
    assert (best.backend, best.mesh, best.gradient_checkpointing) == ("sp_ulysses", "sp=4", False)
    assert "--num_processes 8 --parallelism_config_sp_size 4 -m training.train" in best.command
    assert "| sp_ulysses (sp=4) | 8 |" in format_plan(plans)


def test_app_lists_both_files_and_asks_for_whole_groups(tmp_path):
    from app.runs import LaunchRefused, backend_label, default_processes, launch_argv
    from app.workspace import Workspace

    ws = Workspace(tmp_path)
    backends = ws.backends()
    assert {"sp_ulysses", "cp"} <= set(backends)
    assert backend_label("sp_ulysses", backends["sp_ulysses"]) == (
        "sp_ulysses (sequence parallel sp=2: processes a multiple of 2)"
    )
    assert backend_label("cp", backends["cp"]) == "cp (mesh cp=2: 2 processes)"
    assert default_processes(backends["sp_ulysses"]) == default_processes(backends["cp"]) == 2
    assert "--num_processes" in launch_argv(ws, "r.yaml", "sp_ulysses", 4)
    with pytest.raises(LaunchRefused, match="multiple of 2"):
        launch_argv(ws, "r.yaml", "sp_ulysses", 3)


def test_both_files_read_as_launched():
    ulysses, cp = read_backend(CONFIGS / "sp_ulysses.yaml"), read_backend(CONFIGS / "cp.yaml")
    assert (ulysses.kind, ulysses.sp_size, ulysses.mesh, ulysses.dp_size) == ("deepspeed", 2, "", 1)
    assert (cp.kind, cp.cp_size, cp.mesh, cp.dp_size) == ("fsdp", 2, "cp=2", 1)
