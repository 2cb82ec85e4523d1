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

Asynchronous saves (`checkpoint.async_save`, class `Checkpointer`): the loop's thread writes the checkpoint
into a staging directory on fast node-local storage (/dev/shm by default: memory speed) and goes on
training; a background thread on each node's first process copies the node's files into the same
`.tmp-step-N` directory a synchronous save uses (at the lowest CPU priority), and global rank 0's thread, once
every node has copied, writes the marker and renames, exactly as above. At most one save is in flight:
the next save (and the end of the run) first waits for it. A kill at any moment leaves a `.tmp-` directory
without a marker, so the previous checkpoint stays the newest; a failed copy ends the run at the next
step boundary with the same message and exit code 3 as a failed synchronous save.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from accelerate import DistributedType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from training.core import faults
from training.core.errors import TrainingAborted, UserError
from training.core.fs import atomic_dir, sweep_temporaries, write_atomic
from training.run.rundir import CHECKPOINT_MARKER, CHECKPOINT_STATE, RunDir, checkpoint_state

log = logging.getLogger("training")

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
        _raise_storage_failure(e, run_dir, step, run_dir.checkpoints)


def _raise_storage_failure(e: Exception, run_dir: RunDir, step: int, where: Path):
    """TrainingAborted (exit 3) for a write that failed, after removing the half-written checkpoint;
    anything that is not a failed write is raised as it is."""
    if isinstance(e, RuntimeError) and not _is_write_failure(e):
        raise e
    shutil.rmtree(_staging(run_dir, step), ignore_errors=True)
    latest = run_dir.latest_checkpoint()
    kept = f"the last complete checkpoint, {latest}, is kept" if latest else "no earlier checkpoint exists"
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
    raise TrainingAborted(
        f"checkpoint step-{step}: cannot write to {where} ({why}); {kept}. Free space "
        f"(or make {'checkpoint.staging_dir' if where != run_dir.checkpoints else 'output_dir'} writable) "
        f"and run the same command to resume"
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
    began = time.perf_counter()
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_state(accelerator, tmp, pairs)
    accelerator.wait_for_everyone()
    faults.point("mid_save", step)
    if accelerator.is_main_process:
        _complete(run_dir, step, state, keep_last)
        log.info("checkpoint step-%d saved in %.2f s: %s", step, time.perf_counter() - began, final)
    accelerator.wait_for_everyone()
    return final


def _complete(run_dir: RunDir, step: int, state: dict, keep_last: int) -> None:
    """Global rank 0, once every file of checkpoint step-N is in its staging directory: the trainer state,
    the marker, the rename, then the pruning of older checkpoints."""
    tmp = _staging(run_dir, step)
    write_atomic(tmp / CHECKPOINT_STATE, json.dumps(state, indent=2))
    write_atomic(tmp / CHECKPOINT_MARKER, "")
    with atomic_dir(
        run_dir.checkpoint(step)
    ) as staged:  # a re-save of the same step (stop right after a save)
        staged.rmdir()
        tmp.rename(staged)
    for old in run_dir.complete_checkpoints()[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    sweep_temporaries(run_dir.checkpoints)  # leftovers of saves killed earlier


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
    return checkpoint_state(path)


# ----------------------------------------------------------------------------- asynchronous saves


def staging_root(run_dir: RunDir, staging_dir: str | None) -> Path:
    """Where this run's asynchronous saves are staged: under checkpoint.staging_dir, else /dev/shm where it
    is writable, else the system's temporary directory; named by the run directory, so that two runs never
    share one and a resumed run finds (and removes) what its killed predecessor left."""
    if staging_dir:
        base = Path(staging_dir)
    elif os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm")
    else:
        base = Path(tempfile.gettempdir())
    key = hashlib.sha256(str(run_dir.root.resolve()).encode()).hexdigest()[:12]
    return base / f"llm-forge-staging-{key}"


class Checkpointer:
    """Saves the run's checkpoints: in the loop's thread (`save_checkpoint`), or with checkpoint.async_save
    staged in the loop's thread and copied and completed by a background thread (module docstring).

    save(step, state, pairs, wait=)   collective; returns the checkpoint's path (complete once waited for)
    poll()                            at every step: a background save that failed ends the run (exit 3)
    wait()                            the save in flight, if any, is complete (or has failed: exit 3)
    """

    def __init__(self, accelerator, run_dir: RunDir, keep_last: int, async_save=False, staging_dir=None):
        self.acc, self.run_dir, self.keep_last, self.async_save = accelerator, run_dir, keep_last, async_save
        local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        self.node, self.nodes = accelerator.process_index // local, max(1, accelerator.num_processes // local)
        self.root = staging_root(run_dir, staging_dir)
        self._thread: threading.Thread | None = None
        self._failed: tuple[BaseException, int] | None = None
        if async_save and accelerator.is_local_main_process and self.root.is_dir():
            for stale in self.root.glob(f"step-*.node-{self.node}"):  # a killed run's staged copies
                shutil.rmtree(stale, ignore_errors=True)

    def save(self, step: int, state: dict, pairs=None, *, wait: bool = False) -> Path:
        if not self.async_save:
            return save_checkpoint(self.acc, self.run_dir, step, state, self.keep_last, pairs)
        self.wait()  # at most one save in flight
        acc, tmp, stage = self.acc, _staging(self.run_dir, step), self.root / f"step-{step}.node-{self.node}"
        began = time.perf_counter()
        try:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
        except OSError as e:
            _raise_storage_failure(e, self.run_dir, step, self.run_dir.checkpoints)
        try:
            if acc.is_local_main_process:
                shutil.rmtree(stage, ignore_errors=True)
                stage.mkdir(parents=True)
            acc.wait_for_everyone()
            save_state(acc, stage, pairs)
        except (OSError, RuntimeError) as e:
            shutil.rmtree(stage, ignore_errors=True)
            _raise_storage_failure(e, self.run_dir, step, self.root)
        acc.wait_for_everyone()
        if acc.is_local_main_process:
            staged_s = time.perf_counter() - began
            self._thread = threading.Thread(
                target=self._copy,
                args=(step, state, stage, tmp, staged_s),
                name=f"checkpoint-{step}",
                daemon=True,
            )
            self._thread.start()
        if wait:
            self.wait()
            acc.wait_for_everyone()
        return self.run_dir.checkpoint(step)

    def _copy(self, step: int, state: dict, stage: Path, tmp: Path, staged_s: float) -> None:
        """The background thread of each node's first process: copy the node's staged files into the
        checkpoint's temporary directory; on global rank 0, once every node has, complete it."""
        began = time.perf_counter()
        # the training threads come first where cores are few (Linux: a priority per thread)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            shutil.copytree(stage, tmp, copy_function=shutil.copyfile, dirs_exist_ok=True)
            shutil.rmtree(stage, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.root.rmdir()  # empty once no node stages anything
            write_atomic(tmp / f".node-{self.node}.copied", "")
            if not self.acc.is_main_process:
                return
            copied = [tmp / f".node-{n}.copied" for n in range(self.nodes)]
            while not all(p.exists() for p in copied):
                if failed := next(tmp.glob(".node-*.failed"), None):  # another node could not copy its part
                    raise OSError(errno.EIO, f"{failed.name[1:-7]}: {failed.read_text()}")
                time.sleep(0.05)
            faults.point("mid_save", step)
            for p in copied:
                p.unlink()
            _complete(self.run_dir, step, state, self.keep_last)
            log.info(
                "checkpoint step-%d: the loop waited %.2f s (staged in %s), completed in the background in %.2f s",
                step,
                staged_s,
                self.root,
                time.perf_counter() - began,
            )
        except BaseException as e:  # reported by the loop's thread (poll/wait)
            self._failed = (e, step)
            if not self.acc.is_main_process:  # rank 0's thread stops waiting for this node
                with contextlib.suppress(OSError):
                    write_atomic(tmp / f".node-{self.node}.failed", str(e))

    def poll(self) -> None:
        if self._failed is None:
            return
        (e, step), self._failed, self._thread = self._failed, None, None
        if isinstance(e, (OSError, RuntimeError)):
            _raise_storage_failure(e, self.run_dir, step, self.run_dir.checkpoints)
        raise e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.poll()
