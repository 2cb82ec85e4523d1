"""Reliability: a SIGKILL at any point + resume reaches the same weights as an uninterrupted run,
checkpoints are atomic, SIGTERM stops gracefully with a resumable checkpoint, non-finite losses are
skipped or stop the run as configured, and a run that cannot save refuses to start."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_cli, train_inprocess
from training.run.metrics import read_metrics
from training.run.rundir import LOCK, RunDir


def weights(run_dir):
    final = run_dir / "final"
    f = final / (
        "adapter_model.safetensors" if (final / "adapter_model.safetensors").exists() else "model.safetensors"
    )
    return load_file(f)


def assert_bit_identical(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def train_losses(run_dir):
    return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def run_train(recipe, *overrides, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`python -m training.train RECIPE ...` to its end, forked from the worker's fork server (LLM_FORGE_FAULT
    is read when a step runs, not at import), so a fault run pays no interpreter start-up; a SIGKILLed run's
    return code is -SIGKILL, as a Popen's."""
    return run_cli("training.train", recipe, *overrides, env=env, timeout=timeout, fresh=False)


def launch(recipe, *overrides, env=None):
    """The same command in a fresh interpreter, started and left running (a test signals or polls it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "training.train", str(recipe), *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def lora_recipe(make_recipe, tiny_model_dir):
    """LoRA with dropout (so RNG state matters), accumulation, and epochs that end mid-run (12 examples,
    3 optimizer steps per epoch): everything exact resume must restore."""

    def _make(name, checkpoint=None, **extra):
        return make_recipe(
            f"{name}.yaml",
            output_dir=str(tiny_model_dir.parent / f"rel-{name}-{os.getpid()}"),
            model={"name_or_path": str(tiny_model_dir)},
            method={"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.2}},
            data={
                "train": str(ROOT / "data/alpaca_tiny.jsonl"),
                "format": "instruction",
                "max_length": 48,
                "max_examples": 12,
            },
            train={
                "max_steps": 8,
                "batch_size": 2,
                "grad_accum": 2,
                "lr": 5e-3,
                "warmup_steps": 2,
                "scheduler": "cosine",
            },
            checkpoint={"every_steps": 2, "keep_last": 2, **(checkpoint or {})},
            **extra,
        )

    return _make


def run_dir_of(recipe):
    import yaml

    return Path(yaml.safe_load(recipe.read_text())["output_dir"])


def async_saves(run):
    """checkpoint.async_save, staged beside the run (not in /dev/shm) so that the test sees what is left."""
    return {"async_save": True, "staging_dir": str(run.parent / f"{run.name}-staging")}


@pytest.mark.parametrize(
    "fault", ["kill@mid_step:1", "kill@mid_step:5", "kill@mid_save:6", "async kill@mid_save:6"]
)
def test_sigkill_then_resume_is_bit_identical(lora_recipe, fault):
    """A kill at any point, then the same command: the run equals an uninterrupted one (synchronous saves).
    `async`: the checkpoints are saved in the background (checkpoint.async_save) and the kill comes from
    the background thread after it copied step-6 and before the marker, while the loop trains on."""
    reference = lora_recipe("ref")
    assert train_inprocess(reference) == 0
    ref_dir = run_dir_of(reference)

    is_async, fault = fault.startswith("async "), fault.removeprefix("async ")
    name = ("async-" if is_async else "") + "killed-" + fault.replace("@", "-").replace(":", "-")
    run = run_dir_of(lora_recipe(name))
    recipe = lora_recipe(name, checkpoint=async_saves(run) if is_async else None)
    shutil.rmtree(run, ignore_errors=True)
    proc = run_train(recipe, env={"LLM_FORGE_FAULT": fault})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    step = int(fault.rsplit(":", 1)[1])
    if fault.startswith("kill@mid_save"):
        # the half-written checkpoint has no marker and is ignored; the previous one is intact
        assert (run / f"checkpoints/.tmp-step-{step}").is_dir()
        assert RunDir(run).latest_checkpoint().name == f"step-{step - 2}"
    assert not (run / "final").exists()
    killed = {r["step"]: r["elapsed_s"] for r in read_metrics(RunDir(run).metrics) if "loss" in r}
    if fault == "kill@mid_step:5":  # status.json follows every step with the trainer's own clock
        status = json.loads((run / "status.json").read_text())
        assert status["step"] == 4 and status["elapsed_s"] >= killed[4] and status["remaining_s"] > 0

    assert train_inprocess(recipe) == 0  # resume: auto
    assert train_losses(run) == train_losses(ref_dir)
    if fault == "kill@mid_step:5":  # the resumed run's clock goes on from its checkpoint's rows
        resumed = {r["step"]: r["elapsed_s"] for r in read_metrics(RunDir(run).metrics) if "loss" in r}
        assert resumed[5] > killed[4] and resumed[4] == killed[4]
    assert_bit_identical(run, ref_dir)
    assert not list((run / "checkpoints").glob(".tmp-*"))  # leftovers cleaned by the next save
    assert [p.name for p in RunDir(run).complete_checkpoints()] == ["step-6", "step-8"]  # keep_last=2
    if is_async:  # nothing staged is left behind
        assert not list(Path(async_saves(run)["staging_dir"]).rglob("step-*"))


def test_sigterm_saves_a_checkpoint_and_resume_matches(make_recipe, tmp_path):
    # SIGTERM arrives in the middle of step 3 (sent by the process itself, so the test is not a race):
    # the step finishes, a checkpoint is saved, the process exits 0; resuming reaches the same weights.
    extra = dict(train={"max_steps": 8, "batch_size": 2, "lr": 1e-3}, data={"max_examples": 100})
    reference = make_recipe("ref.yaml", output_dir=str(tmp_path / "ref"), **extra)
    recipe = make_recipe("stop.yaml", output_dir=str(tmp_path / "stop"), **extra)
    proc = run_train(recipe, env={"LLM_FORGE_FAULT": "term@mid_step:3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped at step 3; checkpoint saved. Resume with the same command" in proc.stdout
    assert RunDir(tmp_path / "stop").latest_checkpoint().name == "step-3"
    status = json.loads((tmp_path / "stop/status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == 3
    assert not (tmp_path / "stop/final").exists()

    assert train_inprocess(recipe) == 0 and train_inprocess(reference) == 0
    assert train_losses(tmp_path / "stop") == train_losses(tmp_path / "ref")
    assert_bit_identical(tmp_path / "stop", tmp_path / "ref")


def test_sigterm_from_outside_stops_gracefully(make_recipe, tmp_path):
    recipe = make_recipe(train={"max_steps": 100000, "batch_size": 2})
    proc = launch(recipe)
    metrics = tmp_path / "run/metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "checkpoint saved. Resume with the same command" in out
    assert RunDir(tmp_path / "run").latest_checkpoint() is not None


def test_nonfinite_loss_is_skipped_when_asked(make_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_FORGE_FAULT", "nan@loss:2")
    recipe = make_recipe(
        train={"max_steps": 4, "on_nonfinite": "skip", "warmup_steps": 2, "scheduler": "linear"}
    )
    assert train_inprocess(recipe) == 0
    rows = [r for r in read_metrics(tmp_path / "run/metrics.jsonl") if "loss" in r]
    assert rows[1]["loss"] is None and rows[1]["skipped_steps"] == 1
    assert rows[1]["lr"] == rows[0]["lr"]  # neither optimizer nor scheduler stepped
    assert all(torch.isfinite(w).all() for w in weights(tmp_path / "run").values())


def test_nonfinite_loss_stops_and_keeps_the_last_checkpoint(make_recipe, tmp_path, monkeypatch):
    from training.core.errors import TrainingAborted

    monkeypatch.setenv("LLM_FORGE_FAULT", "nan@loss:3")
    recipe = make_recipe(train={"max_steps": 6}, checkpoint={"every_steps": 2})
    with pytest.raises(TrainingAborted) as stopped:
        train_inprocess(recipe)
    said = str(stopped.value)
    assert re.search(r"non-finite loss \(nan\) .* at step 3 \(.*\); the last good checkpoint is kept", said)
    # a NaN loss poisons every gradient: the message counts them and names the first, nearest the input
    assert re.search(
        r"on this rank, \d+ parameters' gradients are not finite: model\.embed_tokens\.weight, ", said
    )
    assert [p.name for p in RunDir(tmp_path / "run").complete_checkpoints()] == ["step-2"]
    assert not (tmp_path / "run/final").exists()


def test_a_step_that_trains_nothing_stops_and_keeps_the_last_checkpoint(make_recipe, tmp_path, monkeypatch):
    """A finite loss whose gradients are all exactly zero (a fused loss that returned none) is an error at that
    step, not a quiet step; the checkpoint before it stays the last one."""
    from training.core.errors import TrainingAborted

    monkeypatch.setenv("LLM_FORGE_FAULT", "zero@loss:3")
    recipe = make_recipe(train={"max_steps": 6}, checkpoint={"every_steps": 2})
    with pytest.raises(TrainingAborted) as stopped:
        train_inprocess(recipe)
    assert re.fullmatch(
        r"step 3: every trained parameter's gradient is exactly zero, so the step would train nothing; its loss "
        r"\(\d+\.\d+\) does not reach any trained parameter: .*\. The last good checkpoint is kept",
        str(stopped.value),
    )
    assert [p.name for p in RunDir(tmp_path / "run").complete_checkpoints()] == ["step-2"]
    assert len([r for r in read_metrics(tmp_path / "run/metrics.jsonl") if "loss" in r]) == 2


def test_resuming_with_a_recipe_that_trains_differently_is_refused_unless_accepted(
    make_recipe, tmp_path, capsys
):
    """The checkpoint keeps the recipe that wrote it: a changed learning rate is refused naming the key
    and the override; the override accepts it; a change that leaves the steps as they were (eval cadence)
    is allowed and listed."""
    recipe = make_recipe(train={"max_steps": 4}, checkpoint={"every_steps": 2})
    assert train_inprocess(recipe, "train.max_steps=2") == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        train_inprocess(recipe, "train.max_steps=2", "train.lr=0.0005", "checkpoint.keep_last=9")
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert re.search(
        r"error: resume: .*checkpoints/step-2 was written by a recipe that trained differently: "
        r"train\.lr: [\d.e-]+ -> 0\.0005\. Resuming would not continue that run\. To resume with these changes "
        r"on purpose, add 'resume_changes=\[train\.lr\]' to the command",
        err,
    ), err
    assert train_inprocess(recipe, "train.lr=0.0005", "resume_changes=[train]", "eval.every_steps=3") == 0
    log = capsys.readouterr().err
    assert (
        "resume: train.lr " in log
        and "resume: train.max_steps 2 -> 4" in log
        and "resume: eval.every_steps" in log
    )
    assert [r["step"] for r in read_metrics(tmp_path / "run/metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]


def test_checkpoints_say_one_line_each_not_accelerates_chatter(make_recipe, capsys):
    """accelerate's INFO line per saved file and its tied-weights warning at every checkpoint give way to
    one line of ours per checkpoint (issue 41: `make demo` showed seven lines and an alarming warning)."""
    recipe = make_recipe(train={"max_steps": 4}, checkpoint={"every_steps": 2})
    assert train_inprocess(recipe) == 0
    err = capsys.readouterr().err
    assert "checkpoint step-2 saved in " in err and "checkpoint step-4 saved in " in err
    for chatter in (
        "Saving current state",
        "Model weights saved in",
        "Optimizer state saved in",
        "Removed shared tensor",
    ):
        assert chatter not in err, chatter
    assert err.count("checkpoints keep tied weights once") <= 1


def test_a_zero_gradient_is_no_error_where_no_signal_is_the_datas_answer():
    """Online RL whose every group scored alike has no advantage, so no gradient: a warning, not a stop; a
    window without a labelled token is named as the cause."""
    from training.core.errors import TrainingAborted
    from training.loop.run import StepStats
    from training.loop.step import check_some_gradient

    check_some_gradient(StepStats(0.0, 0.0, 10, False, metrics={"frac_reward_zero_std": 1.0}), 8, 4)
    check_some_gradient(StepStats(2.0, 0.5, 10, False), 8, 4)
    with pytest.raises(TrainingAborted, match="step 4: .*the step's batches hold no labelled token"):
        check_some_gradient(StepStats(0.0, 0.0, 10, False), 0, 4)


def test_a_nonfinite_step_names_the_parameters_whose_gradients_are_not_finite():
    """A finite loss with one NaN/inf gradient (what a deep bf16 model can produce) names that parameter."""
    from training.loop.step import nonfinite_grads

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    assert nonfinite_grads(model) == ""
    model[2].weight.grad[0, 1] = float("inf")
    model[0].bias.grad[2] = float("nan")
    assert (
        nonfinite_grads(model) == " (on this rank, 2 parameters' gradients are not finite: 0.bias, 2.weight)"
    )
    assert nonfinite_grads(model, shown=1).endswith(": 0.bias, ...)")


def test_nonfinite_stop_exits_3_from_the_cli(make_recipe):
    recipe = make_recipe(train={"max_steps": 3})
    proc = run_train(recipe, env={"LLM_FORGE_FAULT": "nan@loss:1"}, timeout=300)
    assert proc.returncode == 3
    assert "error: non-finite loss" in proc.stderr and "Traceback" not in proc.stderr


def test_refuses_to_start_without_disk_space_for_a_checkpoint(make_recipe, monkeypatch, capsys):
    import collections

    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 1000, 1000))
    recipe = make_recipe(checkpoint={"every_steps": 2})
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe)
    assert e.value.code == 2
    assert "GiB free but a checkpoint" in capsys.readouterr().err


def test_refuses_async_saves_without_room_to_stage_a_checkpoint(make_recipe, tmp_path, monkeypatch, capsys):
    import collections

    Usage = collections.namedtuple("Usage", "total used free")
    staging = tmp_path / "small"
    staging.mkdir()
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: Usage(10**12, 10**12 - 1000, 1000) if path == staging else real(path),
    )
    recipe = make_recipe(checkpoint={"every_steps": 2, "async": True, "staging_dir": str(staging)})
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"checkpoint.staging_dir: {staging} has 0.00 GiB free but an asynchronous save stages" in err
    assert "or checkpoint.async_save: false" in err


def test_unwritable_output_dir_is_refused(make_recipe, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        train_inprocess(make_recipe(output_dir=str(blocker / "run")))
    assert e.value.code == 2
    assert "output_dir: cannot write to" in capsys.readouterr().err


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_save_exits_3_and_the_previous_checkpoint_resumes_exactly(lora_recipe, is_async):
    """ENOSPC while checkpoint step-6 is half written (injected: LLM_FORGE_FAULT=enospc@mid_save:6). With
    checkpoint.async_save the background thread meets it and the loop ends the run at its next step."""
    reference = lora_recipe("ref")
    assert train_inprocess(reference) == 0
    name = "full-disk-async" if is_async else "full-disk"
    run = run_dir_of(lora_recipe(name))
    recipe = lora_recipe(name, checkpoint=async_saves(run) if is_async else None)
    shutil.rmtree(run, ignore_errors=True)
    proc = run_train(recipe, env={"LLM_FORGE_FAULT": "enospc@mid_save:6"})
    err = proc.stderr
    assert proc.returncode == 3, err[-3000:]
    assert f"checkpoint step-6: cannot write to {run / 'checkpoints'} (No space left on device)" in err
    assert f"the last complete checkpoint, {run / 'checkpoints' / 'step-4'}, is kept" in err
    assert "Traceback" not in err
    assert not (run / "checkpoints/.tmp-step-6").exists() and not (run / "final").exists()
    assert RunDir(run).latest_checkpoint().name == "step-4"

    assert train_inprocess(recipe) == 0  # resume: auto, once the disk has room again
    assert train_losses(run) == train_losses(run_dir_of(reference))
    assert_bit_identical(run, run_dir_of(reference))


def test_storage_turning_read_only_during_a_save_exits_3_keeping_the_previous_checkpoint(lora_recipe):
    """EROFS while checkpoint step-6 is half written (injected: erofs@mid_save:6; the tests run as root,
    whom chmod does not stop): the same one line and exit 3 as a full disk, step-4 the newest checkpoint
    (its exact resume is the full-disk test's)."""
    recipe = lora_recipe("read-only")
    run = run_dir_of(recipe)
    shutil.rmtree(run, ignore_errors=True)
    proc = run_train(recipe, env={"LLM_FORGE_FAULT": "erofs@mid_save:6"})
    err = proc.stderr
    assert proc.returncode == 3, err[-3000:]
    assert f"checkpoint step-6: cannot write to {run / 'checkpoints'} (Read-only file system)" in err
    assert "Traceback" not in err and not (run / "checkpoints/.tmp-step-6").exists()
    assert RunDir(run).latest_checkpoint().name == "step-4"


def test_a_second_run_on_a_held_directory_is_refused_until_the_holder_dies(lora_recipe, capsys):
    recipe = lora_recipe("held")
    run = run_dir_of(recipe)
    shutil.rmtree(run, ignore_errors=True)
    holder = launch(recipe, "train.max_steps=1000000", "checkpoint.every_steps=1000000")
    try:
        deadline = time.time() + 300
        while not (RunDir(run).status.is_file() and holder.poll() is None):  # it holds output_dir now
            assert time.time() < deadline and holder.poll() is None, holder.communicate()[1][-3000:]
            time.sleep(0.5)
        with pytest.raises(SystemExit) as refused:
            train_inprocess(recipe)
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert f"output_dir: {run} is in use by a live run (pid {holder.pid} " in err
        assert "training.train" in err and str(recipe) in err  # the holder's command
    finally:
        holder.kill()
        holder.communicate()
    assert train_inprocess(recipe) == 0  # a dead holder keeps nothing
    assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
