"""What a run says when a collective loses another process: which errors count as a lost peer, and the
one line (the 2-process run that produces it is in tests/integration/test_distributed.py)."""

from __future__ import annotations

import subprocess
import sys

import torch.distributed as dist

from conftest import ROOT
from training.parallel.collectives import (
    effective_timeout_s,
    lost_peer,
    lost_peer_message,
    set_collective_timeout,
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


def test_the_recipes_timeout_reaches_every_process_group_and_torchs_default_comes_back():
    """set_collective_timeout applies to the world's group and to subgroups (a mesh's, DeepSpeed's), and
    None restores torch's default (gloo: 30 min). In a fresh process: one gloo group of one rank."""
    code = (
        "import tempfile, torch, torch.distributed as dist\n"
        "from training.parallel.collectives import effective_timeout_s, set_collective_timeout\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
        "groups = [dist.distributed_c10d._get_default_group(), dist.new_group([0])]\n"
        "get = lambda: [g._get_backend(torch.device('cpu')).options._timeout.total_seconds() for g in groups]\n"
        "set_collective_timeout(7.5); print(get())\n"
        "set_collective_timeout(None); print(get(), effective_timeout_s(None))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["[7.5, 7.5]", "[1800.0, 1800.0] 1800.0"]
    set_collective_timeout(3.0)  # no process group in this process: nothing to do
    assert effective_timeout_s(7.5) == 7.5 and effective_timeout_s(None) == 1800.0
