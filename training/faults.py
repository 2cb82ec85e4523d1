"""Fault injection for the reliability tests (and for anyone who wants to see recovery happen).

Set LLM_FORGE_FAULT to a comma-separated list of ACTION@POINT:STEP, for example
    LLM_FORGE_FAULT=kill@mid_step:3       SIGKILL this process in the middle of optimizer step 3
    LLM_FORGE_FAULT=kill@mid_save:4       SIGKILL while checkpoint step-4 is half written
    LLM_FORGE_FAULT=term@mid_step:3       SIGTERM this process in the middle of step 3 (graceful stop)
    LLM_FORGE_FAULT=nan@loss:2            make the loss of step 2 NaN
Points: mid_step (after the first micro-batch's backward), mid_save (after the state files are
written, before the completion marker), loss (the training loss). Unset: every call is a no-op.
"""

from __future__ import annotations

import os
import signal

import torch


def _faults() -> list[tuple[str, str, int]]:
    spec = os.environ.get("LLM_FORGE_FAULT", "")
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, _, rest = item.partition("@")
        point, _, step = rest.partition(":")
        out.append((action, point, int(step)))
    return out


def point(name: str, step: int) -> None:
    """Send this process SIGKILL/SIGTERM here if that was requested for this point and step."""
    faults = _faults()
    if ("kill", name, step) in faults:
        os.kill(os.getpid(), signal.SIGKILL)
    if ("term", name, step) in faults:
        os.kill(os.getpid(), signal.SIGTERM)


def corrupt(name: str, step: int, value: torch.Tensor) -> torch.Tensor:
    """Return NaN instead of `value` if requested for this point and step."""
    if ("nan", name, step) in _faults():
        return value * float("nan")
    return value
