"""Experiment trackers (recipe key `report_to`), through accelerate's own trackers.

`report_to: [tensorboard, mlflow, wandb, trackio]` builds the Accelerator with `log_with=` those
names; `start` opens one tracker run named after the run directory (`output_dir`'s name) with the
resolved recipe as its hyper-parameters (flattened to dotted keys), and every metrics.jsonl row is
forwarded to `accelerator.log` at its step (training.run.metrics.MetricsWriter). accelerate logs on the
main process only. Where each one writes (names in training.run.rundir):

    tensorboard   OUTPUT_DIR/tensorboard/<run name>/   (`tensorboard --logdir OUTPUT_DIR/tensorboard`)
    mlflow        MLFLOW_TRACKING_URI if set, else a local file store OUTPUT_DIR/mlruns
                  (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri OUTPUT_DIR/mlruns`)
    wandb         OUTPUT_DIR/wandb/; offline (mode="offline") unless WANDB_API_KEY or WANDB_MODE
                  is set; `wandb sync OUTPUT_DIR/wandb/offline-run-*` uploads it later
    trackio       trackio's local store (TRACKIO_DIR), project = run name (`trackio show`)

A tracker that is not installed is refused before anything loads, with the pip command to install it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from training.core.errors import UserError
from training.run.rundir import MLFLOW_STORE, TENSORBOARD_DIR, WANDB_DIR, RunDir

# name in report_to -> (module that must import, pip command that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "mlflow": ("mlflow", "pip install mlflow-skinny"),
    "wandb": ("wandb", "pip install wandb"),
    "trackio": ("trackio", "pip install trackio"),
}


def check_installed(report_to: list[str]) -> None:
    """UserError naming `report_to`, the tracker and its pip command for each one not installed."""
    missing = [name for name in report_to if importlib.util.find_spec(TRACKERS[name][0]) is None]
    if missing:
        how = "; ".join(f"{name}: `{TRACKERS[name][1]}`" for name in missing)
        raise UserError(f"report_to: {', '.join(missing)} not installed here; install with {how}")


def log_with(recipe) -> list[str]:
    """The `log_with` list for the Accelerator (checked installed), empty without report_to."""
    check_installed(recipe.report_to)
    return list(recipe.report_to)


def run_name(recipe) -> str:
    return Path(recipe.output_dir).resolve().name


def flatten(value: Any, prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested recipe dict -> {"train.lr": 0.001, ...}; lists and None as JSON text."""
    if isinstance(value, dict):
        out: dict = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    key = prefix[:-1]
    if isinstance(value, (str, int, float, bool)):
        return {key: value}
    return {key: json.dumps(value)}


def numeric(row: dict) -> dict[str, int | float]:
    """The numeric fields of a metrics row, as tracker metrics (the step is the step, not a metric)."""
    return {
        k: v
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _local_stores(recipe, run: RunDir) -> dict[str, dict]:
    """Local, offline-safe defaults for the trackers that would otherwise reach a server; the extra
    init kwargs they need."""
    extra: dict[str, dict] = {}
    if "mlflow" in recipe.report_to and not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow

        # MLflow 3 keeps the file store in maintenance mode behind this switch; it needs no database.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri((run.root / MLFLOW_STORE).resolve().as_uri())
    if "wandb" in recipe.report_to:
        (run.root / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        extra["wandb"] = {"dir": str((run.root / WANDB_DIR).resolve())}
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            extra["wandb"]["mode"] = "offline"
    return extra


def start(accelerator, recipe) -> None:
    """Open the tracker runs (main process only; no-op without report_to), the recipe as hyper-parameters."""
    if not recipe.report_to:
        return
    run = RunDir(recipe.output_dir)
    name = run_name(recipe)
    extra = _local_stores(recipe, run) if accelerator.is_main_process else {}
    init_kwargs = {
        "mlflow": {"run_name": name},
        "wandb": {"name": name, **extra.get("wandb", {})},
        "trackio": {"name": name},
    }
    accelerator.init_trackers(
        name,
        config=flatten(recipe.model_dump(mode="json")),
        init_kwargs={k: v for k, v in init_kwargs.items() if k in recipe.report_to},
    )


def project_config(recipe):
    """accelerate's ProjectConfiguration: TensorBoard writes under OUTPUT_DIR/tensorboard/."""
    from accelerate.utils import ProjectConfiguration

    root = Path(recipe.output_dir)
    return ProjectConfiguration(project_dir=str(root), logging_dir=str(root / TENSORBOARD_DIR))


__all__ = ["TRACKERS", "check_installed", "flatten", "log_with", "numeric", "project_config", "start"]
