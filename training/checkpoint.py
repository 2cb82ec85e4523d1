"""Atomic, resumable checkpoints on top of `accelerator.save_state` / `load_state`.

A checkpoint is written into `checkpoints/.tmp-step-N/`, completed with `trainer_state.json` and a
`COMPLETE` marker, then renamed to `checkpoints/step-N/`. Anything without the marker is ignored,
and old checkpoints are pruned only after the new one is complete, so a kill at any moment leaves
the previous good checkpoint intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from training import faults

MARKER = "COMPLETE"
STATE = "trainer_state.json"
_STEP = re.compile(r"^step-(\d+)$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and (p / MARKER).is_file() and (p / STATE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / STATE).is_file()


def save_checkpoint(accelerator, run_dir: Path, step: int, state: dict, keep_last: int) -> Path:
    """Collective: every rank calls this. Returns the final checkpoint path."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    faults.point("mid_save", step)
    if accelerator.is_main_process:
        write_atomic(tmp / STATE, json.dumps(state, indent=2))
        write_atomic(tmp / MARKER, "")
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. stop right after a scheduled save)
            old = root / f".old-step-{step}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for junk in root.glob(".tmp-step-*"):  # leftovers of saves killed earlier
            shutil.rmtree(junk, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> dict:
    accelerator.load_state(str(path))
    return json.loads((Path(path) / STATE).read_text())
