"""Knowledge distillation end to end on tiny models: a teacher trained here on the bundled stories, a
smaller student built from config; one process is the reference, 2-process DDP (killed with SIGKILL in
step 5 and resumed) and FSDP2 give its losses, held-out losses and final weights; with the teacher the
student's held-out loss after a few steps is lower than with cross-entropy alone."""

from __future__ import annotations

import pytest

import launching
from conftest import TINY_ARCH, deep_update, train_inprocess
from launching import STEPS, assert_same_run, kill_and_resume, launch, rows

STUDENT = {**TINY_ARCH, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
TWO = ["train.batch_size=1", "train.grad_accum=2"]


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
    proc = kill_and_resume("ddp.yaml", recipe, out, *TWO)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_same_run(out, single)
    got, want = rows(out, "ce_loss"), rows(single, "ce_loss")
    for s in got:
        assert got[s]["distill_divergence"] == pytest.approx(want[s]["distill_divergence"], rel=1e-4)


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process(work, recipe, single):
    out = work / "fsdp"
    proc = launch("fsdp.yaml", recipe, f"output_dir={out}", *TWO)
    assert "2 process(es), FSDP" in proc.stderr
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
