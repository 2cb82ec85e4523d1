"""Fault injection for the reliability tests (and for anyone who wants to see recovery happen).

Set LLM_FORGE_FAULT to a comma-separated list of ACTION@POINT:STEP[:RANK], for example
    LLM_FORGE_FAULT=kill@mid_step:3       SIGKILL this process in the middle of optimizer step 3
    LLM_FORGE_FAULT=kill@mid_save:4       SIGKILL while checkpoint step-4 is half written
    LLM_FORGE_FAULT=term@mid_step:3       SIGTERM this process in the middle of step 3 (graceful stop)
    LLM_FORGE_FAULT=nan@loss:2            make the loss of step 2 NaN
    LLM_FORGE_FAULT=zero@loss:2           keep step 2's loss value but give it zero gradients (as a fused loss
                                          kernel that returned none would)
    LLM_FORGE_FAULT=enospc@mid_save:4     the disk is full while checkpoint step-4 is half written
    LLM_FORGE_FAULT=erofs@mid_save:4      the storage turns read-only while checkpoint step-4 is half written
                                          (a remount after an error; chmod would not stop root)
    LLM_FORGE_FAULT=kill@mid_step:5:1     SIGKILL global rank 1 alone in step 5, in the first attempt of an
                                          elastic job only (one worker dies once; the restarted group lives)
    LLM_FORGE_FAULT=hang@mid_step:3:1     global rank 1 stops in step 3 and never reaches the next collective
                                          (alive but silent: the others' collective timeout ends the run)
Two hooks: `inject` inside the training step (points `loss` and `mid_step`: after a micro-batch's
loss is computed, before its backward) and `point` inside a checkpoint save (`mid_save`: after the
state files are written, before the completion marker; with checkpoint.async_save, in global rank 0's
background thread once the files are copied, while the loop trains on). Unset: every call is a no-op.
"""

from __future__ import annotations

import errno
import os
import signal
import time

import torch

ENV = "LLM_FORGE_FAULT"


def _faults() -> list[tuple[str, str, int]]:
    """The faults meant for this process: (action, point, step)."""
    spec = os.environ.get(ENV, "")
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, _, rest = item.partition("@")
        point_name, _, where = rest.partition(":")
        step, _, rank = where.partition(":")
        if rank and (
            rank != os.environ.get("RANK", "0") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        ):
            continue  # another rank's fault, or an elastic restart after it fired
        out.append((action, point_name, int(step)))
    return out


def point(name: str, step: int) -> None:
    """Send this process SIGKILL/SIGTERM here, stop it for good (hang) or fail the write (enospc, erofs), if that was
    requested for this point and step."""
    faults = _faults()
    if ("kill", name, step) in faults:
        os.kill(os.getpid(), signal.SIGKILL)
    if ("term", name, step) in faults:
        os.kill(os.getpid(), signal.SIGTERM)
    if ("hang", name, step) in faults:
        # Silent, but ended by the launcher's SIGTERM (not taken as a graceful stop): a rank stuck in a
        # collective's C++ wait would outlive it, and torchrun's SIGKILL 30 s later would end it instead.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(60)
    for action, code in (("enospc", errno.ENOSPC), ("erofs", errno.EROFS)):
        if (action, name, step) in faults:
            raise OSError(code, os.strerror(code))


def inject(step: int, loss: torch.Tensor) -> torch.Tensor:
    """The training step's one hook: a NaN loss (`nan@loss`), a loss without gradients (`zero@loss`),
    SIGKILL or SIGTERM (`mid_step`) if requested."""
    if not os.environ.get(ENV):
        return loss
    point("mid_step", step)
    if ("zero", "loss", step) in _faults():
        return loss + (loss.detach() - loss)  # the same value; its gradient g - g is exactly zero
    return loss * float("nan") if ("nan", "loss", step) in _faults() else loss
