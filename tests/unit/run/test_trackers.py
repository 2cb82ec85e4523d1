"""Experiment trackers (`report_to`): a tiny run's TensorBoard event files and MLflow local store, read
back with those libraries' own readers, hold the same losses as metrics.jsonl and the recipe as
hyper-parameters; a tracker that is not installed, or an unknown one, is refused before training."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from conftest import run_cli, train_inprocess
from training.config import load_recipe, resolve_precision
from training.core.errors import RecipeError
from training.core.machine import auto_precision
from training.run.rundir import MLFLOW_STORE, TENSORBOARD_DIR
from training.run.trackers import flatten

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="mlflow not installed (pip install mlflow-skinny)"
)


def metrics_rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run, key="loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics_rows(run) if r.get(key) is not None}


@pytest.fixture
def tracked_run(make_recipe, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    # set, then deleted: recorded, so that what the trainer sets is undone after (a bare delenv of an unset
    # variable records nothing)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    trackers = ["tensorboard", "mlflow"] if importlib.util.find_spec("mlflow") else ["tensorboard"]
    recipe = make_recipe(
        report_to=trackers,
        output_dir=str(tmp_path / "my-run"),
        data={"eval_fraction": 0.1},
        eval={"every_steps": 3},
        train={"log_every": 1},
    )
    assert train_inprocess(recipe) == 0
    return tmp_path / "my-run", resolve_precision(load_recipe(recipe), *auto_precision())  # as trained


def test_tensorboard_events_hold_the_metrics_and_the_recipe(tracked_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run, recipe = tracked_run
    logdir = run / TENSORBOARD_DIR / "my-run"  # run name = output_dir's name
    assert logdir.is_dir()
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    for key in ("loss", "eval_loss", "lr"):
        got = {e.step: e.value for e in acc.Scalars(key)}
        want = losses(run, key)
        assert got.keys() == want.keys() and want
        assert got == pytest.approx(want, rel=1e-6), key
    # the hyper-parameters: add_hparams writes them in a sub-run of its own
    params = {}
    for sub in filter(Path.is_dir, logdir.iterdir()):
        hp = EventAccumulator(str(sub))
        hp.Reload()
        with contextlib.suppress(KeyError):  # the other sub-directory holds hparams.yml only
            content = hp.PluginTagToContent("hparams")["_hparams_/session_start_info"]
            info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
            params = {k: v.string_value or v.number_value or v.bool_value for k, v in info.hparams.items()}
    assert params["train.lr"] == pytest.approx(recipe.train.lr)
    assert params["output_dir"] == str(run)
    assert params["model.from_scratch.hidden_size"] == 64
    assert not list(tmp_path.glob("mlruns")) and not list(tmp_path.glob("runs"))


@needs_mlflow
def test_mlflow_local_store_holds_the_metrics_and_the_recipe(tracked_run):
    from mlflow.tracking import MlflowClient

    run, recipe = tracked_run
    store = run / MLFLOW_STORE
    assert store.is_dir()
    client = MlflowClient(tracking_uri=store.as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "my-run"]
    (mlrun,) = client.search_runs([exp.experiment_id])
    assert mlrun.info.run_name == "my-run" and mlrun.info.status == "FINISHED"
    for key in ("loss", "eval_loss", "tokens_per_s"):
        got = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)}
        want = losses(run, key)
        assert got == pytest.approx(want, rel=1e-6) and want, key
    want_params = {k: str(v) for k, v in flatten(recipe.model_dump(mode="json")).items()}
    assert mlrun.data.params == want_params
    assert mlrun.data.params["train.lr"] == str(recipe.train.lr)


def test_flatten_gives_dotted_scalar_keys():
    flat = flatten({"a": {"b": 1, "c": [1, "x"], "d": None}, "e": "s", "f": True})
    assert flat == {"a.b": 1, "a.c": '[1, "x"]', "a.d": "null", "e": "s", "f": True}


def test_unknown_tracker_is_refused_by_the_schema(make_recipe):
    with pytest.raises(RecipeError, match=r"report_to\.0: Input should be 'tensorboard'"):
        load_recipe(make_recipe(report_to=["tensorbored"]))


def test_tracker_not_installed_is_refused_before_training_with_its_pip_command(make_recipe, tmp_path):
    """wandb/trackio are not installed here; a shadowing empty path makes any name look absent otherwise."""
    missing = next((n for n in ("wandb", "trackio") if importlib.util.find_spec(n) is None), None)
    if missing is None:
        pytest.skip("wandb and trackio are both installed")
    recipe = make_recipe(report_to=["tensorboard", missing])
    proc = run_cli("training.train", recipe, env={"PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"report_to: {missing} not installed here; install with {missing}: `pip install {missing}`" in (
        proc.stderr
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_report_to_defaults_to_no_tracker(make_recipe):
    assert yaml.safe_load(make_recipe().read_text()).get("report_to") is None
    assert load_recipe(make_recipe()).report_to == []
    assert load_recipe(make_recipe(report_to=None)).report_to == []  # `report_to:` left empty
    assert load_recipe(make_recipe(report_to="tensorboard")).report_to == ["tensorboard"]
