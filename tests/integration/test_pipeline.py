"""Pipeline parallelism (training/parallel/pipeline.py) on CPU processes over gloo, launched exactly as a user
would (`accelerate launch --config_file accelerate_configs/pp.yaml ...`): 2 stages under 1F1B and GPipe,
and 2 stages x 2 data-parallel replicas, each give the loss trajectory, eval losses and final weights of
one process seeing the same global batch (4 rows); a kill -9 of both stages mid-run, then the same
command, resumes from the last checkpoint and ends with the same weights; final/ loads in plain
transformers; too many stages is refused before loading.

The model is the tiny Llama of the other distributed tests (2 layers, one per stage), whose output
head is tied to the embedding: the first stage uses it as the embedding, the last as the head, and the
two copies must take the same steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import ROOT, train_inprocess
from launching import (
    SINGLE_OVERRIDES,
    assert_same_run,
    generate_from_finals,
    kill_and_resume,
    launch,
    rows,
    write_recipe,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def recipe(work) -> Path:
    return write_recipe(work / "recipe.yaml", work / "unused")


@pytest.fixture(scope="module")
def single(work, recipe) -> Path:
    """The reference: one process, batch 4, no accumulation."""
    out = work / "single"
    assert train_inprocess(recipe, f"output_dir={out}", *SINGLE_OVERRIDES) == 0
    return out


def config_with(work: Path, name: str, **keys) -> Path:
    """pp.yaml with some parallelism_config_pp_* keys changed, as a file of its own."""
    raw = yaml.safe_load((ROOT / "accelerate_configs" / "pp.yaml").read_text())
    raw["parallelism_config"].update({f"parallelism_config_pp_{k}": v for k, v in keys.items()})
    path = work / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_two_stages_1f1b_match_one_process_and_resume_after_kill(work, recipe, single):
    """pp.yaml as shipped (1F1B, 4 micro-batches of 1 row). Both stages are SIGKILLed in step 5, after
    the step-3 checkpoint; the same command resumes from it. Steps 1-3 (before the kill) and 4-6 (after
    the resume), the eval losses and the final weights all equal the one-process run."""
    killed = work / "pp-killed"
    kill_and_resume("pp.yaml", recipe, killed, *SINGLE_OVERRIDES)
    assert_same_run(killed, single)
    first = rows(killed, "loss")[1]
    assert first["pp_schedule"] == "1F1B" and first["pp_bubble"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    assert (killed / "checkpoints" / "step-3" / "pipeline" / ".metadata").is_file()


def test_two_stages_gpipe_with_accumulation_match_one_process(work, recipe, single):
    """GPipe, batch 2 in 2 micro-batches, 2 accumulated schedule steps per optimizer step (global batch 4).
    A fresh `accelerate launch`, as from a shell: its ranks find the pipeline keys (which accelerate does
    not pass on) in their parent's command line, which forked ranks are told instead (tests/forked.py)."""
    out = work / "gpipe"
    config = config_with(work, "gpipe.yaml", schedule="GPipe")
    proc = launch(
        str(config), recipe, f"output_dir={out}", "train.batch_size=2", "train.grad_accum=2", fresh=True
    )
    assert (
        "pipeline 2 stages x 1 data-parallel, GPipe, 2 micro-batches of 1 rows, bubble 33.3%" in proc.stderr
    )
    assert_same_run(out, single)


def test_two_stages_x_two_replicas_match_one_process(work, recipe, single):
    """pp_dp.yaml: a (pp=2, dp=2) mesh on 4 processes; each replica trains on its own 2 rows per step."""
    out = work / "pp-dp"
    proc = launch("pp_dp.yaml", recipe, f"output_dir={out}", "train.batch_size=2", "train.grad_accum=1")
    assert "pipeline 2 stages x 2 data-parallel, 1F1B" in proc.stderr and "global batch 4" in proc.stderr
    assert_same_run(out, single)


def test_pipeline_finals_load_in_plain_transformers(work):
    """final/ of the pipeline runs above is one whole save_pretrained model, gathered from the stages."""
    finals = [work / run / "final" for run in ("pp-killed", "gpipe", "pp-dp")]
    assert all((f / "model.safetensors").is_file() for f in finals), "needs the pipeline runs above"
    assert generate_from_finals(finals).count("generated 2 layers") == len(finals)


def test_more_stages_than_layers_is_refused_before_loading(work, recipe, monkeypatch, capsys):
    """In the training process of a pp.yaml launch (its environment, in-process): a 1-layer model cannot
    be cut into 2 stages; exit code 2 and the key named, before any weight is built."""
    for key, value in {
        "LLM_FORGE_ACCELERATE_CONFIG": str(ROOT / "accelerate_configs" / "pp.yaml"),
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
        "WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("training.loop.setup.build_model", lambda *a, **k: pytest.fail("the model was built"))
    out = work / "too-many-stages"
    args = (f"output_dir={out}", "model.from_scratch.num_hidden_layers=1")
    with pytest.raises(SystemExit) as exit_:
        train_inprocess(recipe, *args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        "parallelism_config_pp_size=2 (the accelerate config) asks for more pipeline stages than the " in err
    )
    assert "model's 1 decoder layers (num_hidden_layers)" in err


def test_planner_counts_the_largest_stage_and_the_micro_batches_in_flight(make_recipe, tmp_path):
    """A 4-layer model in 2 stages: each device holds about half the parameters (the larger end: the
    embedding or the head); GPipe keeps all 8 micro-batches' activations, 1F1B only 2 (= stages)."""
    from transformers import LlamaConfig

    from training.planning.memory import estimate
    from training.planning.report import format_plan

    folder = tmp_path / "configs"
    folder.mkdir()
    for name, schedule in (("pp_gpipe", "GPipe"), ("pp_1f1b", "1F1B")):
        raw = yaml.safe_load((ROOT / "accelerate_configs" / "pp.yaml").read_text())
        raw["parallelism_config"]["parallelism_config_pp_schedule"] = schedule
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    (folder / "single.yaml").write_text(yaml.safe_dump({"distributed_type": "NO", "num_processes": 1}))
    recipe_path = make_recipe(train={"batch_size": 8})
    from training.config import load_recipe

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=1000
    )
    plans = {
        p.backend: p for p in estimate(load_recipe(recipe_path), 2, 80, configs_dir=folder, config=config)
    }
    single, gpipe, one_f = plans["single"], plans["pp_gpipe"], plans["pp_1f1b"]
    share = gpipe.params_gib / single.params_gib
    ends, layer = 1000 * 64, 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # embedding (or head); one decoder layer
    assert share == pytest.approx((ends + 2 * layer) / (2 * ends + 4 * layer + 64), rel=0.02)
    assert gpipe.optimizer_gib == pytest.approx(single.optimizer_gib * share, rel=0.02)
    assert one_f.activations_gib < gpipe.activations_gib < single.activations_gib
    text = format_plan(list(plans.values()))
    assert (
        "pp_gpipe: 2 stages" in text and "8 micro-batches of 1 rows, 8 in flight on stage 0 (GPipe)" in text
    )
    assert "2 in flight on stage 0 (1F1B); bubble 11%" in text
