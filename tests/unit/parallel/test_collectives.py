"""What a run says when a collective loses another process: which errors count as a lost peer, and the
one line (the 2-process run that produces it is in tests/integration/test_distributed.py)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from training.parallel.collectives import (
    collective_timeout,
    effective_timeout_s,
    lost_peer,
    lost_peer_message,
)

GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv"
)


def test_lost_peer_errors_are_told_from_other_failures():
    assert lost_peer(RuntimeError(GLOO_TIMEOUT))
    assert lost_peer(
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4000")
    )
    assert lost_peer(dist.DistBackendError("NCCL watchdog: collective operation timeout"))
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    assert not lost_peer(ValueError("Timed out waiting"))  # only the errors collectives raise


def test_the_line_names_step_cause_timeout_and_checkpoint():
    line = lost_peer_message(5, RuntimeError(GLOO_TIMEOUT + "\nmore\n"), 5.0, "runs/x/checkpoints/step-3")
    assert "\n" not in line
    assert line.startswith("lost a peer in step 5: ") and "Timed out waiting 5000ms" in line
    assert "at most 5 s (train.collective_timeout_s)" in line
    assert "the last complete checkpoint is runs/x/checkpoints/step-3" in line and "--max_restarts" in line
    assert "no checkpoint was written yet" in lost_peer_message(1, RuntimeError(GLOO_TIMEOUT), 5.0, None)


def test_timeouts_are_the_recipes_or_torchs_default():
    assert collective_timeout(None) is None
    assert collective_timeout(7.5) == timedelta(seconds=7.5)
    assert effective_timeout_s(7.5) == 7.5
    assert effective_timeout_s(None) == 1800.0  # no process group here: gloo's default, 30 min
