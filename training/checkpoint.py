"""Atomic, resumable checkpoints on top of `accelerator.save_state` / `load_state`.

The rule: a checkpoint is written into a temporary directory, completed with `trainer_state.json`
and a `COMPLETE` marker, then renamed to `checkpoints/step-N/`. Anything without the marker is
ignored, and old checkpoints are pruned only after the new one is complete, so a kill at any moment
leaves the previous good checkpoint intact. (Names: training/rundir.py; the rename: training/fs.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from training import faults
from training.fs import atomic_dir, sweep_temporaries, write_atomic
from training.rundir import CHECKPOINT_MARKER, CHECKPOINT_STATE, RunDir


def save_checkpoint(accelerator, run_dir: RunDir, step: int, state: dict, keep_last: int) -> Path:
    """Collective: every rank calls this. Returns the checkpoint's path."""
    final = run_dir.checkpoint(step)
    # Every rank writes its shard into the same temporary directory: its name must not depend on the rank.
    tmp = run_dir.checkpoints / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
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


def load_checkpoint(accelerator, path: Path) -> dict:
    accelerator.load_state(str(path))
    return json.loads((Path(path) / CHECKPOINT_STATE).read_text())
