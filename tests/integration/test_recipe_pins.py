"""Pinned losses of the bundled recipes (training/recipes/): the first optimizer steps of demo, dpo, grpo,
agent_sft and distill_tiny, each run from its own file, with the recipe's model, data, objective and method,
made short by dotted overrides (a few steps, smaller batches, no held-out set, no checkpoints) and in fp32.
If one of these changes, something on that recipe's path changed (data, chat template, model loading,
adapters, the objective, generation, rewards, optimizer or schedule): check that it was meant to before
updating the numbers."""

from __future__ import annotations

import pytest

import launching
from conftest import ROOT, TINY_ARCH, train_inprocess
from training.run.metrics import read_metrics
from training.run.sources import pretrained_source

pytestmark = pytest.mark.slow  # the bundled SmolLM2-135M-Instruct (distill_tiny: tiny models)

RECIPES = ROOT / "training/recipes"
# every run: a loss row per step, fp32 (`precision: auto` would mean bf16 on CPUs with native bf16), no
# held-out set (it does not change the training steps) and no checkpoint
SHORT = ("train.log_every=1", 'precision="no"', "data.eval=null", "checkpoint.every_steps=null")

# Measured 2026-11-29 on this code, before the refactor of training/ (AMD EPYC family 25 model 17, AVX512-BF16).
# The same runs with ATEN_CPU_CAPABILITY=avx2 (AVX2 kernels) differ from these by at most 1.8e-6.
PINNED = {
    "demo": [0.37772, 0.72599, 0.49951],
    "dpo": [0.69315, 0.61234, 0.5753],
    "grpo": [0.15231, 0.22793],
    "agent_sft": [1.19419, 0.49183, 0.21472],
    # re-measured 2026-12-02 (Xeon, AVX512; the same with AVX2 kernels) over the tiny tokenizer (tests/small_vocab.py)
    "distill_tiny": [5.6895, 5.66563, 5.6367],
}


def run_losses(recipe: str, out, *overrides: str) -> list[float]:
    argv = (RECIPES / f"{recipe}.yaml", f"output_dir={out}", *SHORT, *overrides)
    assert train_inprocess(*argv) == 0
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def assert_pinned(recipe: str, got: list[float]) -> None:
    assert got == pytest.approx(PINNED[recipe], abs=2e-4), [round(x, 5) for x in got]


@pytest.fixture(scope="module", autouse=True)
def bundled_model_converted():
    """The bundled GGUF converted before any pinned run, so that its conversion's time is not any one run's.
    (Converting once drew from torch's generator after the run had set its seed, so a run on a fresh cache
    started its adapters from other weights; training.run.sources.convert_gguf now draws nothing from it:
    tests/unit/run/test_sources.py.)"""
    pretrained_source("bundled:smollm2-135m-instruct")


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes name their data (grpo its reward file) from the repository root


def test_demo(tmp_path):
    """LoRA SFT on the date chats. The first update has lr 0 (10 warm-up steps from 0): step 3 is the first
    loss after a real one."""
    got = run_losses("demo", tmp_path / "run", "train.max_steps=3", "train.batch_size=2")
    assert_pinned("demo", got)


def test_dpo(tmp_path):
    """LoRA DPO on the sign-off pairs (step 1 is log 2: the policy still is the reference)."""
    got = run_losses("dpo", tmp_path / "run", "train.max_steps=3", "train.batch_size=2")
    assert_pinned("dpo", got)


def test_grpo(tmp_path):
    """LoRA GRPO with DAPO's loss on the short-answer task: 6 sampled completions of up to 16 tokens per
    prompt (the recipe's), both rewards (concise from data/rl/rewards.py), group advantages. Two prompts a
    step: with one, its group's rewards were all equal at steps 2 and 3, a loss of exactly 0."""
    got = run_losses("grpo", tmp_path / "run", "train.max_steps=2", "train.batch_size=2")
    assert_pinned("grpo", got)


def test_agent_sft(tmp_path):
    """LoRA SFT on the tool-calling chats, through the recipe's own chat template."""
    got = run_losses("agent_sft", tmp_path / "run", "train.max_steps=3", "train.batch_size=2")
    assert_pinned("agent_sft", got)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The teacher of the distillation tests (test_distillation_runs.py): the tiny model trained 40 steps on
    the stories, in place of the recipe's runs/pretrain_tiny/final (which the user pretrains first)."""
    work = tmp_path_factory.mktemp("teacher")
    recipe = launching.write_recipe(
        work / "teacher.yaml",
        work / "teacher",
        model={"from_scratch": dict(TINY_ARCH)},
        train={"max_steps": 40, "lr": 3e-3, "warmup_steps": 0},
        checkpoint={"every_steps": None},
        eval={"every_steps": None},
    )
    assert train_inprocess(recipe) == 0
    return work / "teacher" / "final"


def test_distill_tiny(tmp_path, teacher):
    """The recipe's student built from config, its stories and its loss (half cross-entropy, half forward KL
    to the teacher), with the teacher's tokenizer; the recipe's batch of 16."""
    teacher_at = (f"distill.teacher={teacher}", f"model.tokenizer={teacher}")
    got = run_losses("distill_tiny", tmp_path / "run", "train.max_steps=3", *teacher_at)
    assert_pinned("distill_tiny", got)
