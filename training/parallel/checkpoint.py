"""Atomic, resumable checkpoints on top of `accelerator.save_state` / `load_state`.

The rule: a checkpoint is written into a temporary directory, completed with `trainer_state.json`
and a `COMPLETE` marker, then renamed to `checkpoints/step-N/`. Anything without the marker is
ignored, and old checkpoints are pruned only after the new one is complete, so a kill at any moment
leaves the previous good checkpoint intact. (Names: training/run/rundir.py; the rename: training/core/fs.py.)

Tensor parallelism outside FSDP (accelerate_configs/tp.yaml): accelerate 1.15's save_state cannot
write DTensor weights unless FSDP saves them (it hands them to safetensors, which fails with
"Attempted to access the data pointer on an invalid python storage"), and it would pickle the
optimizer's DTensor state whole. There the model and optimizer state go through torch distributed
checkpoint instead (every rank writes its own shards into `tensor_parallel/`, loaded back in place,
resharded if the mesh changed), and accelerate saves the rest as usual (RNG states, dataloader
positions, the scheduler).

Pipeline stages (training/parallel/pipeline.py) are not accelerate's models either: each process holds other
parameters under their whole-model names. The caller passes them as `pairs`; they are written the
same way into `pipeline/` (DCP writes every name once, so the directory holds the whole model and its
optimizer state; the optimizer state is flattened to per-parameter keys, as each stage has its own
param_groups).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp
from accelerate import DistributedType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from training.core import faults
from training.core.errors import TrainingAborted, UserError
from training.core.fs import atomic_dir, sweep_temporaries, write_atomic
from training.run.rundir import CHECKPOINT_MARKER, CHECKPOINT_STATE, RunDir

TENSOR_PARALLEL_DIR = "tensor_parallel"  # the DCP shards of the model and optimizer under tp.yaml
PIPELINE_DIR = "pipeline"  # the DCP files of every pipeline stage's model and optimizer


def _tensor_parallel_outside_fsdp(accelerator) -> bool:
    return accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED) and any(
        isinstance(p, DTensor) for model in accelerator._models for p in model.parameters()
    )


@contextlib.contextmanager
def _models_and_optimizers_left_to_us(accelerator):
    """While accelerate saves/loads everything else: it sees no model and no optimizer."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield list(zip(models, optimizers, strict=True))
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def _dcp_state(pairs, options=None) -> dict:
    """The sharded (DTensor) model and optimizer state dicts, keyed as they are written."""
    state = {}
    for i, (model, optimizer) in enumerate(pairs):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper, or a plain one
        state[f"model_{i}"], state[f"optimizer_{i}"] = get_state_dict(model, optimizer, options=options)
    return state


_PIPELINE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save_state(accelerator, directory: Path, pairs=None) -> None:
    """Collective: accelerate's save_state, with DTensor models outside FSDP saved by DCP, and the
    pipeline stages `pairs` ([(module, optimizer)], not accelerate's) too."""
    if pairs is not None:
        dcp.save(_dcp_state(pairs, _PIPELINE_OPTIONS), checkpoint_id=str(directory / PIPELINE_DIR))
        accelerator.save_state(str(directory))
        return
    if not _tensor_parallel_outside_fsdp(accelerator):
        accelerator.save_state(str(directory))
        return
    with _models_and_optimizers_left_to_us(accelerator) as pairs:
        dcp.save(_dcp_state(pairs), checkpoint_id=str(directory / TENSOR_PARALLEL_DIR))
        accelerator.save_state(str(directory))


def _load_pipeline(pairs, directory: Path) -> None:
    state = _dcp_state(pairs, _PIPELINE_OPTIONS)
    dcp.load(state, checkpoint_id=str(directory / PIPELINE_DIR))  # each stage reads its own names
    for i, (model, optimizer) in enumerate(pairs):
        set_state_dict(
            model,
            getattr(optimizer, "optimizer", optimizer),
            model_state_dict=state[f"model_{i}"],
            optim_state_dict=state[f"optimizer_{i}"],
            options=_PIPELINE_OPTIONS,
        )


def load_state(accelerator, directory: Path, pairs=None) -> None:
    """Collective. A tensor-parallel checkpoint (it has `tensor_parallel/`) loads by DCP, which reshards:
    under tp.yaml again or in one plain process (tested); FSDP and DeepSpeed runs read only their own.
    A pipeline checkpoint (`pipeline/`) loads into the pipeline stages `pairs`."""
    if pairs is not None or (directory / PIPELINE_DIR).is_dir():
        if pairs is None or not (directory / PIPELINE_DIR).is_dir():
            raise UserError(
                f"resume: {directory} was written {'without' if pairs else 'with'} pipeline stages; it resumes "
                f"only under a launch config {'without' if pairs else 'with'} them (parallelism_config_pp_size); "
                f"set resume: none (or another output_dir) to start afresh"
            )
        _load_pipeline(pairs, directory)
        accelerator.load_state(str(directory))
        return
    if not (directory / TENSOR_PARALLEL_DIR).is_dir():
        accelerator.load_state(str(directory))
        return
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UserError(
            f"resume: {directory} was written under tensor parallelism alone (tp.yaml); it resumes under "
            f"tp.yaml or in one process, not under {accelerator.distributed_type.value}; "
            f"set resume: none (or another output_dir) to start afresh"
        )
    with _models_and_optimizers_left_to_us(accelerator) as pairs:
        state = _dcp_state(pairs)
        # in place, into this rank's shards (or the whole tensors in one plain process, which DCP warns of)
        dcp.load(state, checkpoint_id=str(directory / TENSOR_PARALLEL_DIR))
        for i, (model, optimizer) in enumerate(pairs):
            set_state_dict(
                model,
                optimizer.optimizer,
                model_state_dict=state[f"model_{i}"],
                optim_state_dict=state[f"optimizer_{i}"],
            )
        accelerator.load_state(str(directory))


def save_checkpoint(accelerator, run_dir: RunDir, step: int, state: dict, keep_last: int, pairs=None) -> Path:
    """Collective: every rank calls this. Returns the checkpoint's path. `pairs`: pipeline stages.

    Storage that fails during the save (a full disk, a read-only or vanished output_dir) ends the run
    with TrainingAborted (exit 3): the half-written directory is removed and the previous complete
    checkpoint stays the newest, so the same command resumes from it once the storage is back."""
    try:
        return _save_checkpoint(accelerator, run_dir, step, state, keep_last, pairs)
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not _is_write_failure(e):
            raise
        shutil.rmtree(_staging(run_dir, step), ignore_errors=True)
        latest = run_dir.latest_checkpoint()
        kept = (
            f"the last complete checkpoint, {latest}, is kept" if latest else "no earlier checkpoint exists"
        )
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise TrainingAborted(
            f"checkpoint step-{step}: cannot write to {run_dir.checkpoints} ({why}); {kept}. Free space "
            f"(or make output_dir writable) and run the same command to resume"
        ) from None


def _staging(run_dir: RunDir, step: int) -> Path:
    """Where checkpoint step-N is written before its rename. Every rank writes its shard into it, so its
    name must not depend on the rank."""
    return run_dir.checkpoints / f".tmp-step-{step}"


def _is_write_failure(e: RuntimeError) -> bool:
    """torch.save reports a failed write (e.g. a full disk) as a RuntimeError of its stream writer."""
    text = str(e)
    return "PytorchStreamWriter" in text or "file write failed" in text


def _save_checkpoint(
    accelerator, run_dir: RunDir, step: int, state: dict, keep_last: int, pairs=None
) -> Path:
    final = run_dir.checkpoint(step)
    tmp = _staging(run_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_state(accelerator, tmp, pairs)
    accelerator.wait_for_everyone()
    faults.point("mid_save", step)
    if accelerator.is_main_process:
        write_atomic(tmp / CHECKPOINT_STATE, json.dumps(state, indent=2))
        write_atomic(tmp / CHECKPOINT_MARKER, "")
        with atomic_dir(final) as staged:  # a re-save of the same step (stop right after a save) replaces it
            staged.rmdir()
            tmp.rename(staged)
        for old in run_dir.complete_checkpoints()[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        sweep_temporaries(run_dir.checkpoints)  # leftovers of saves killed earlier
    accelerator.wait_for_everyone()
    return final


def check_kept_states(accelerator, path: Path) -> None:
    """UserError (exit 2) before loading, where accelerate would raise a bare RuntimeError: the checkpoint
    keeps another number of registered states (`custom_checkpoint_<i>.pkl`) than this run registers, i.e.
    the recipe changed what a checkpoint keeps (rl.num_iterations between 1 and more, data.streaming)."""
    found = len(list(path.glob("custom_checkpoint_*.pkl")))
    objects = accelerator._custom_objects  # what register_for_checkpointing collected, in order
    if found != len(objects):
        ours = ", ".join(getattr(o, "checkpoint_label", type(o).__name__) for o in objects) or "none"
        raise UserError(
            f"resume: {path} keeps {found} registered state(s) (custom_checkpoint_*.pkl) but this run keeps "
            f"{len(objects)} ({ours}): the recipe changed what a checkpoint keeps (rl.num_iterations between 1 "
            f"and more, data.streaming on or off). Resume with the settings that wrote it, or set resume: none "
            f"(or another output_dir) to start afresh"
        )


def load_checkpoint(accelerator, path: Path, pairs=None) -> dict:
    check_kept_states(accelerator, Path(path))
    load_state(accelerator, Path(path), pairs)
    return json.loads((Path(path) / CHECKPOINT_STATE).read_text())
