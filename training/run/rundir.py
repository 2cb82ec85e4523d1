"""The run directory and every name in it; and what any path a user gives us points at.

A run directory (`output_dir` in the recipe) holds:

    config.yaml             the resolved recipe
    metrics.jsonl           one JSON object per logged step (eval rows carry eval_loss)
    status.json             state/step/pid for the app
    loss.png                the loss plot
    checkpoints/step-<N>/   resumable state; complete only with its COMPLETE marker and trainer_state.json
    final/                  save_pretrained output (full model or adapter) + tokenizer
    tensorboard/<name>/     TensorBoard event files (report_to: [tensorboard]; <name> = the run dir's name)
    mlruns/                 the MLflow local file store (report_to: [mlflow], without MLFLOW_TRACKING_URI)
    wandb/                  Weights & Biases run files (report_to: [wandb]; offline without an API key)
    eval_results.json       lm-evaluation-harness results, one entry per task (python -m training.evaluate)
    reference_logps.pt      preference tuning: the reference model's log-probabilities, computed once
    samples.jsonl           online RL: a few prompt/completion/reward samples per step

This module is the only place those names are spelled. `resolve_source` is the only place that
decides whether a path is a run, a `final/`, a checkpoint, an adapter or a model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from training.core.errors import UserError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
STATUS = "status.json"
LOSS_PLOT = "loss.png"
FINAL = "final"
MERGED = "merged"  # python -m training.export --merge writes the merged model here
GGUF_DIR = "gguf"  # ... and --gguf the GGUF file (GGUF_FILE) and its Ollama Modelfile here
GGUF_FILE = "model.gguf"
CHECKPOINTS = "checkpoints"
CHECKPOINT_MARKER = "COMPLETE"
CHECKPOINT_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
# beside an adapter: its base model's config as the run changed it (model.rope_scaling); loaders pass it
BASE_CONFIG = "base_config.json"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_STORE = "mlruns"
WANDB_DIR = "wandb"
EVAL_RESULTS = "eval_results.json"
LOCK = "run.lock"  # held by the live run (training.run.lock)
REFERENCE_LOGPS = "reference_logps.pt"
SAMPLES = "samples.jsonl"
SERVED_ADAPTERS = "served_adapters"  # rl.server_push=adapter: the adapter versions a rollout server loads
_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_state(path: Path) -> dict:
    """What checkpoint `path` records of its run (trainer_state.json: step, schedule, recipe, ...)."""
    return json.loads((Path(path) / CHECKPOINT_STATE).read_text())


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint directory: its marker and trainer state are both there."""
    path = Path(path)
    return (path / CHECKPOINT_MARKER).is_file() and (path / CHECKPOINT_STATE).is_file()


def checkpoint_step(path: Path) -> int | None:
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_adapter(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def is_model(path: Path) -> bool:
    return (Path(path) / MODEL_CONFIG).is_file()


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory. Cheap to make; touches the disk only when asked."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def status(self) -> Path:
        return self.root / STATUS

    @property
    def loss_plot(self) -> Path:
        return self.root / LOSS_PLOT

    @property
    def merged(self) -> Path:
        return self.root / MERGED

    @property
    def gguf(self) -> Path:
        return self.root / GGUF_DIR / GGUF_FILE

    @property
    def eval_results(self) -> Path:
        return self.root / EVAL_RESULTS

    @property
    def reference_logps(self) -> Path:
        return self.root / REFERENCE_LOGPS

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES

    @property
    def served_adapters(self) -> Path:
        return self.root / SERVED_ADAPTERS

    @property
    def final(self) -> Path:
        return self.root / FINAL

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    def is_run(self) -> bool:
        """A run directory: has the recipe it was started with (and is not itself a model directory)."""
        return self.config.is_file() and not is_model(self.root)

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [(checkpoint_step(p), p) for p in self.checkpoints.iterdir()]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None) if is_checkpoint(p)]

    def latest_checkpoint(self) -> Path | None:
        ckpts = self.complete_checkpoints()
        return ckpts[-1] if ckpts else None

    def has_final(self) -> bool:
        return self.final.is_dir() and (is_model(self.final) or is_adapter(self.final))

    def read_status(self) -> dict | None:
        try:
            return json.loads(self.status.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    @classmethod
    def of_checkpoint(cls, ckpt: Path) -> RunDir:
        """The run a checkpoint belongs to (RUN/checkpoints/step-N)."""
        return cls(Path(ckpt).parents[1])


SourceKind = Literal["model", "adapter", "checkpoint"]


@dataclass(frozen=True)
class Source:
    """What a user-given path or name points at.

    kind: `model` (a model directory, a .gguf file, or a hub/bundled name), `adapter` (a peft adapter
    directory) or `checkpoint` (a complete checkpoints/step-N). `path` is the directory, file or name
    to load from, and `run` the run directory it belongs to, if any (its config.yaml rebuilds the
    model of a checkpoint and names the base of an adapter).
    """

    kind: SourceKind
    path: Path | str
    run: RunDir | None = None


def _run_of(path: Path, parent: Path) -> RunDir | None:
    run = RunDir(parent)
    return run if parent != path and run.is_run() else None


def _is_hub_name(text: str) -> bool:
    """'bundled:NAME' or 'org/name'; never a path spelled relative to here, absolute or home."""
    return text.startswith("bundled:") or (text.count("/") == 1 and not text.startswith((".", "/", "~")))


def resolve_source(source: str | Path, *, what: str = "", hub: bool = True) -> Source:
    """Decide what `source` is: a run directory, a `final/`, a checkpoint, an adapter or model
    directory, a .gguf file, or (with `hub`) a hub or bundled model name.

    A run directory resolves to its final/, or, while training has not finished, to its newest
    complete checkpoint. A name that does not exist on disk is a hub/bundled name if it looks like
    one ('org/name', 'bundled:NAME') and `hub` is true. Anything else is a UserError that names
    `what` (the option or key, e.g. "method.lora.init_from") and the path.
    """
    text = str(source)
    said = f"{what}: {text}" if what else text
    p = Path(text).expanduser()
    if not p.exists():
        if hub and _is_hub_name(text):
            return Source("model", text)
        raise UserError(f"{said}: no such run or adapter directory, checkpoint or model")
    if p.is_file():
        if p.suffix == ".gguf":
            return Source("model", p)
        raise UserError(f"{said}: a file; give a run directory, checkpoint, adapter or model directory")
    run = RunDir(p)
    if run.is_run():
        if run.has_final():
            return resolve_source(run.final, what=what, hub=hub)
        ckpt = run.latest_checkpoint()
        if ckpt is None:
            raise UserError(f"{said}: the run has neither {FINAL}/ nor a complete checkpoint yet")
        return Source("checkpoint", ckpt, run)
    if is_checkpoint(p):
        return Source("checkpoint", p, _run_of(p, p.parent.parent))
    if is_adapter(p):
        return Source("adapter", p, _run_of(p, p.parent))
    if is_model(p):
        return Source("model", p, _run_of(p, p.parent))
    if checkpoint_step(p) is not None:
        raise UserError(f"{said}: an incomplete checkpoint (saving it was interrupted); use an earlier one")
    raise UserError(f"{said}: not a run directory, checkpoint, adapter or model directory")
