"""Knowledge distillation end to end on tiny models: a teacher trained here on the bundled stories, a
smaller student built from config; one process is the reference, 2-process DDP (killed with SIGKILL in
step 5 and resumed) and FSDP2 give its losses, held-out losses and final weights; with the teacher the
student's held-out loss after a few steps is lower than with cross-entropy alone. The same with the
teacher's top-k log-probabilities precomputed once (distill.top_k): cached, the teacher not loaded again,
DDP through kill -9 and ZeRO-3 equal to one process, and the student's held-out loss, scored in a fresh
process with plain transformers, lower than with cross-entropy alone."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import launching
from conftest import ROOT, TINY_ARCH, deep_update, train_inprocess
from launching import STEPS, TWO_RANKS, assert_same_run, kill_and_resume, launch, rows
from training.objectives.distill import on_policy_step

STUDENT = {**TINY_ARCH, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}


def write_recipe(path, out, **extra):
    """The multi-process tests' recipe (launching.write_recipe) for the smaller student, without warm-up."""
    student = {"model": {"from_scratch": dict(STUDENT)}, "train": {"warmup_steps": 0}}
    return launching.write_recipe(path, out, **deep_update(student, extra))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("distill")


@pytest.fixture(scope="module")
def teacher(work):
    """A tiny model (bigger than the student) trained 40 steps on the stories: it knows them a little."""
    out = work / "teacher"
    recipe = write_recipe(
        work / "teacher.yaml",
        out,
        model={"from_scratch": dict(TINY_ARCH)},
        train={"max_steps": 40, "lr": 3e-3},
        checkpoint={"every_steps": None},
        eval={"every_steps": None},
    )
    assert train_inprocess(recipe) == 0
    return out / "final"


@pytest.fixture(scope="module")
def recipe(work, teacher):
    return write_recipe(
        work / "distill.yaml", work / "unused", distill={"teacher": str(teacher), "beta": 0.5}
    )


@pytest.fixture(scope="module")
def single(work, recipe):
    out = work / "single"
    assert train_inprocess(recipe, f"output_dir={out}") == 0
    return out


def test_the_teacher_lowers_the_students_held_out_loss(work, teacher, single):
    """Same student, same data and steps: cross-entropy alone against cross-entropy + divergence to the
    teacher (ce_weight 0.5, forward KL); the held-out cross-entropy is lower with the teacher."""
    alone = work / "ce-alone"
    plain = write_recipe(work / "plain.yaml", alone, train={"max_steps": 12}, eval={"every_steps": None})
    assert train_inprocess(plain) == 0
    taught = work / "taught"
    kd = write_recipe(
        work / "kd.yaml",
        taught,
        train={"max_steps": 12},
        eval={"every_steps": None},
        distill={"teacher": str(teacher)},
    )
    assert train_inprocess(kd) == 0
    with_teacher, without = (
        rows(taught, "eval_loss")[12]["eval_loss"],
        rows(alone, "eval_loss")[12]["eval_loss"],
    )
    assert with_teacher < without, (with_teacher, without)
    train = rows(taught, "ce_loss")
    assert all(r["distill_divergence"] > 0 for r in train.values())
    assert (
        train[12]["distill_divergence"] < train[1]["distill_divergence"]
    )  # the student moves to the teacher
    assert rows(single, "eval_distill_divergence")[STEPS]["eval_distill_divergence"] > 0


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_through_kill_and_resume(work, recipe, single):
    out = work / "ddp"
    proc = kill_and_resume("ddp.yaml", recipe, out, *TWO_RANKS)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_same_run(out, single)
    got, want = rows(out, "ce_loss"), rows(single, "ce_loss")
    for s in got:
        assert got[s]["distill_divergence"] == pytest.approx(want[s]["distill_divergence"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, kind, teacher_held",
    [
        ("fsdp.yaml", "FSDP", "sharded by FSDP2 over 2 processes"),
        ("zero3_offload.yaml", "DEEPSPEED", "partitioned by ZeRO-3 over 2 processes"),
    ],
)
def test_sharded_two_processes_equal_one_process(work, recipe, single, config, kind, teacher_held):
    """The student sharded (FSDP2; ZeRO-3 with CPU offload) and the teacher sharded like it (its head's
    weights gathered for the loss): the one process's losses, held-out losses and final weights."""
    out = work / config.removesuffix(".yaml")
    proc = launch(config, recipe, f"output_dir={out}", *TWO_RANKS)
    assert f"2 process(es), {kind}" in proc.stderr
    said = re.search(
        rf"distill.teacher: {teacher_held}: ([\d,]+) of ([\d,]+) parameters on this process", proc.stderr
    )
    here, total = (int(g.replace(",", "")) for g in said.groups())
    assert here <= total / 2 + 64  # half of the teacher on each of the two processes (shards are padded)
    assert "never trained, no optimizer state" in proc.stderr
    assert_same_run(out, single)


def test_a_teacher_with_another_vocabulary_is_refused_before_training(work, tiny_model_dir, tmp_path, capsys):
    other = tmp_path / "other-teacher"
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<extra_tool_token>"])
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(other)
    tok.save_pretrained(other)
    bad = write_recipe(tmp_path / "bad.yaml", tmp_path / "run", distill={"teacher": str(other)})
    with pytest.raises(SystemExit) as e:
        train_inprocess(bad)
    assert e.value.code == 2
    assert (
        f"distill.teacher: {other} has another vocabulary than the student's tokenizer"
        in capsys.readouterr().err
    )


# ----------------------------------------------------------------------------- precomputed top-k

TOP_K = 64


@pytest.fixture(scope="module")
def topk_recipe(work, teacher):
    return write_recipe(
        work / "topk.yaml",
        work / "unused",
        distill={"teacher": str(teacher), "beta": 0.5, "top_k": TOP_K},
        data={"cache_dir": str(work / "cache")},
    )


@pytest.fixture(scope="module")
def topk_single(work, topk_recipe):
    out = work / "topk-single"
    assert train_inprocess(topk_recipe, f"output_dir={out}") == 0
    return out


SCORE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
text = " ".join(open(sys.argv[1]).read().splitlines()[600:])  # lines no run here trains on
for final in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok(text[:20000], return_tensors="pt").input_ids[0]
    blocks = ids[: len(ids) // 32 * 32].view(-1, 32)
    with torch.no_grad():
        print(model(blocks, labels=blocks).loss.item())
"""


def held_out_losses(*runs) -> list[float]:
    """Each final model's cross-entropy on stories the runs never see (data/tiny_stories.txt from line 600;
    they read its first 200) in blocks of 32 tokens, in one fresh process with plain transformers (one
    interpreter's start-up for all of them)."""
    finals = [str(run / "final") for run in runs]
    proc = subprocess.run(
        [sys.executable, "-c", SCORE, str(ROOT / "data/tiny_stories.txt"), *finals],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line) for line in proc.stdout.split()[-len(runs) :]]
    assert len(losses) == len(runs), proc.stdout
    return losses


def test_top_k_is_computed_once_and_teaches_the_student(work, teacher, topk_single):
    """The teacher's top-k is written once into the data cache; the student moves towards it, and after 30
    steps its held-out loss (plain transformers, a fresh process) is lower than cross-entropy alone's."""
    entries = [p for p in (work / "cache" / "teacher-topk").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / "stats.json").is_file()
    train = rows(topk_single, "ce_loss")
    assert all(r["distill_divergence"] > 0 for r in train.values())
    assert train[STEPS]["distill_divergence"] < train[1]["distill_divergence"]
    assert rows(topk_single, "eval_distill_divergence")[STEPS]["eval_distill_divergence"] > 0
    runs = {}
    for name, extra in (("alone", {}), ("taught", {"distill": {"teacher": str(teacher), "top_k": TOP_K}})):
        runs[name] = work / f"topk-{name}"
        recipe = write_recipe(
            work / f"topk-{name}.yaml",
            runs[name],
            train={"max_steps": 30},
            eval={"every_steps": None},
            checkpoint={"every_steps": None},
            data={"cache_dir": str(work / "cache")},
            **extra,
        )
        assert train_inprocess(recipe) == 0
    alone, taught = held_out_losses(runs["alone"], runs["taught"])
    print(f"held-out loss after 30 steps: cross-entropy alone {alone:.4f}, with the top-{TOP_K} {taught:.4f}")
    assert taught < alone, (taught, alone)


@pytest.mark.slow
def test_top_k_ddp_through_kill_and_resume_equals_one_process_without_the_teacher(
    work, topk_recipe, topk_single
):
    out = work / "topk-ddp"
    proc = kill_and_resume("ddp.yaml", topk_recipe, out, *TWO_RANKS)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert f"distill.top_k: teacher's top-{TOP_K} cached, the teacher is not loaded" in proc.stderr
    assert_same_run(out, topk_single)
    got, want = rows(out, "ce_loss"), rows(topk_single, "ce_loss")
    for s in got:
        assert got[s]["distill_divergence"] == pytest.approx(want[s]["distill_divergence"], rel=1e-4)


@pytest.mark.slow
def test_top_k_zero3_offload_equals_one_process(work, topk_recipe, topk_single):
    out = work / "topk-zero3"
    proc = launch("zero3_offload.yaml", topk_recipe, f"output_dir={out}", *TWO_RANKS)
    assert "2 process(es), DEEPSPEED" in proc.stderr
    assert_same_run(out, topk_single)


# ----------------------------------------------------------------------------- on-policy (GKD's lambda)

LMBDA = 0.5


@pytest.fixture(scope="module")
def on_policy_recipe(work, teacher):
    """Instruction data (prompts to complete); half the steps, drawn by (seed, step), on the student's own
    completions of up to 8 tokens."""
    return write_recipe(
        work / "on-policy.yaml",
        work / "unused",
        data={"train": str(ROOT / "data/alpaca_tiny.jsonl"), "format": "instruction", "max_length": 64},
        distill={"teacher": str(teacher), "lmbda": LMBDA, "max_new_tokens": 8},
    )


@pytest.fixture(scope="module")
def on_policy_single(work, on_policy_recipe):
    out = work / "on-policy-single"
    assert train_inprocess(on_policy_recipe, f"output_dir={out}") == 0
    return out


def test_on_policy_steps_train_on_the_students_own_completions(on_policy_single):
    """The steps the (seed, step) coin picks train on completions the student generated (at most
    max_new_tokens, each labelled whole), the others on the data's answers; the divergence is the
    teacher's on either."""
    train = rows(on_policy_single, "ce_loss")
    picked = {s for s, r in train.items() if r["on_policy"] == 1.0}
    assert picked == {s for s in train if on_policy_step(0, s, LMBDA)} and 0 < len(picked) < STEPS
    for s, r in train.items():
        assert r["distill_divergence"] > 0
        assert ("completion_length" in r) == (s in picked)
        if s in picked:
            assert 1 <= r["completion_length"] <= 8


@pytest.mark.slow
def test_on_policy_ddp_through_kill_and_resume_equals_one_process(work, on_policy_recipe, on_policy_single):
    """Each completion is keyed by (seed, step, prompt): two ranks, and a run resumed after SIGKILL, draw
    the one process's completions, so losses and weights are equal."""
    out = work / "on-policy-ddp"
    proc = kill_and_resume("ddp.yaml", on_policy_recipe, out, *TWO_RANKS)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_same_run(out, on_policy_single)
    got, want = rows(out, "ce_loss"), rows(on_policy_single, "ce_loss")
    for s in got:
        assert got[s]["on_policy"] == want[s]["on_policy"]
        assert got[s].get("completion_length") == pytest.approx(want[s].get("completion_length"))


@pytest.mark.slow
def test_on_policy_zero3_equals_one_process(work, on_policy_recipe, on_policy_single):
    """The student sharded by ZeRO-3: its weights gathered whole for each generation call, both ranks entering
    together (training.parallel.frozen.whole_for_generation)."""
    out = work / "on-policy-zero3"
    proc = launch("zero3_offload.yaml", on_policy_recipe, f"output_dir={out}", *TWO_RANKS)
    assert "2 process(es), DEEPSPEED" in proc.stderr
    assert_same_run(out, on_policy_single)
