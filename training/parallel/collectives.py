"""How long a collective waits for the other processes, and what a run says when one never answers.

A dead peer (SIGKILL, the OOM killer) usually shows at once: its sockets close and gloo or NCCL raise in
every other process. A peer that is alive but silent (stuck in I/O or a kernel, a node cut off from the
network) shows only when the collective's timeout expires: torch's default (30 min on gloo, 10 min on
NCCL) or `train.collective_timeout_s`. The recipe's timeout holds from the first step to the last
(`set_collective_timeout`, on every process group, as torchtitan's train_timeout_seconds): start-up
(rank 0 loading a model the others wait for) and the end (the final save and export on rank 0) keep
torch's default. Either way each surviving process ends the run with one line
(`lost_peer_message`, raised as TrainingAborted: exit 3, the last complete checkpoint kept), and under
`accelerate launch --max_restarts N` (SLURM: MAX_RESTARTS) torchrun's agent restarts the group, which
resumes from that checkpoint.
"""

from __future__ import annotations

import importlib
import os
from datetime import timedelta

import torch.distributed as dist
from accelerate.utils import gather_object
from torch.distributed import PrefixStore

# the module (torch.distributed's attribute of that name is its function)
_rendezvous = importlib.import_module("torch.distributed.rendezvous")

# what gloo and NCCL put in the RuntimeError of a collective whose peer died or timed out
_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "gloo/transport",
)


def isolate_restart_attempts() -> None:
    """Under torchrun's elastic agent, the store of each attempt's process group under a prefix of its own.

    The agent keeps one store for the whole job (the static rendezvous of accelerate's configs and the c10d
    rendezvous of our SLURM template alike), and torch 2.13's env:// rendezvous hands it to the workers
    without the `/worker/attempt_N` prefix earlier versions put on it (it assumes a new store per retry).
    A group restarted after a lost rank then reads the addresses its predecessors published: gloo connects
    to a dead process ("connectFullMesh failed ... Connection refused") or waits for ever in
    init_process_group. This wraps the env:// handler so that every attempt's keys live under
    /worker/attempt_<TORCHELASTIC_RESTART_COUNT> again; call it before the process group is created. A
    no-op outside an elastic agent's workers (one process, Ray, a hand-set environment)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    handler = _rendezvous._rendezvous_handlers["env"]
    if getattr(handler, "per_attempt", False):
        return
    prefix = f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def per_attempt(url, timeout=dist.default_pg_timeout, **kwargs):
        for store, rank, world_size in handler(url, timeout, **kwargs):
            yield PrefixStore(prefix, store), rank, world_size

    per_attempt.per_attempt = True
    _rendezvous._rendezvous_handlers["env"] = per_attempt


def set_collective_timeout(seconds: float | None) -> None:
    """Every process group of this process (the world's, and the mesh's or DeepSpeed's subgroups) waits at
    most `seconds` from now on; None: torch's default for the group's backend again. A no-op without
    process groups. torch has no public call for this; `_set_pg_timeout` is the one torchtitan uses."""
    if not dist.is_initialized():
        return
    c10d = dist.distributed_c10d
    for group in list(c10d._world.pg_map):
        timeout = (
            timedelta(seconds=seconds)
            if seconds is not None
            else c10d._get_default_timeout(dist.get_backend(group))
        )
        c10d._set_pg_timeout(timeout, group)


def effective_timeout_s(seconds: float | None) -> float:
    """The timeout this process group's collectives run under: the recipe's, else torch's default for the
    backend in use (gloo 1800 s, NCCL 600 s)."""
    if seconds is not None:
        return float(seconds)
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return dist.distributed_c10d._get_default_timeout(backend).total_seconds()


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective that lost another process (died, hung, unreachable)."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in _PEER_SIGNS)


def lost_peer_message(step: int, error: BaseException, timeout_s: float, last_checkpoint: str | None) -> str:
    """One line: where it happened, what the library said (its first line), the timeout, what resumes."""
    said = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    resume = (
        f"the last complete checkpoint is {last_checkpoint}"
        if last_checkpoint
        else "no checkpoint was written yet"
    )
    return (
        f"lost a peer in step {step}: a collective found another process dead or silent ({said[:200]}); "
        f"collectives wait at most {timeout_s:g} s (train.collective_timeout_s); {resume}; with restarts allowed "
        f"(accelerate launch --max_restarts N, SLURM MAX_RESTARTS) the group restarts from it, otherwise run "
        f"the same command again (resume: auto)"
    )


def gather_objects(objects: list) -> list:
    """Every process's `objects` (picklable), concatenated in rank order: accelerate's gather_object, the one
    collective over Python objects the layers below reach through the objective context."""
    return gather_object(objects)
