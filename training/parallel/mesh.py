"""The one answer to every parallel-degree question of a run, built once at set-up.

`Mesh.build(backend, accelerator)` reads the launched backend (training.launch: the accelerate config's
sizes) and the Accelerator (accelerate's ParallelismConfig and its torch DeviceMesh), and every other
place asks the Mesh: how many processes see different rows (dp), which of them this process is, how
each sequence is split (cp: torch context parallelism; sp: DeepSpeed Ulysses), the tensor-parallel
degree (tp), pipeline stages (pp) and expert parallelism (ep).

Data parallelism: the ranks of one tensor- or context-parallel group share a batch, so they are one
data-parallel rank (as accelerate's loaders shard the data); the ranks of a Ulysses group each load
their own batch (DeepSpeed's adapter exchanges them), so they stay data-parallel ranks; a pipeline's
stages of one replica share rows, so dp is the number of replicas (rank = stage x dp + replica).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from training.launch.backend import Backend


@dataclass(frozen=True)
class Mesh:
    world: int  # processes
    rank: int  # this process's global rank
    dp_rank: int  # this process's data-parallel rank: ranks with the same dp_rank see the same rows
    dp_size: int  # data-parallel ranks (distinct row streams)
    tp: int = 1  # tensor parallel
    cp: int = 1  # torch context parallel (ring attention)
    cp_rank: int = 0  # this process's rank in its context-parallel group
    sp: int = 1  # DeepSpeed Ulysses sequence parallel
    pp: int = 1  # pipeline stages
    pp_rank: int = 0  # this process's stage
    ep: int = 1  # expert parallel
    device_mesh: DeviceMesh | None = None  # accelerate's (tp, cp, dp...) mesh; the pipeline builds its own

    @classmethod
    def build(cls, backend: Backend, accelerator) -> Mesh:
        world, rank = accelerator.num_processes, accelerator.process_index
        if backend.pp_size > 1:  # rank = stage x dp + replica (training.parallel.pipeline builds that mesh)
            pp = backend.pp_size
            dp = max(1, world // pp)  # a launch that does not divide is refused before anything is built
            return cls(
                world, rank, dp_rank=rank % dp, dp_size=dp, pp=pp, pp_rank=rank // dp, ep=backend.ep_size
            )
        pc = accelerator.parallelism_config
        tp = pc.tp_size if pc is not None and pc.tp_enabled else 1
        cp = pc.cp_size if pc is not None and pc.cp_enabled else 1
        sp = pc.sp_size if pc is not None and pc.sp_enabled and pc.sp_backend == "deepspeed" else 1
        device_mesh = accelerator.torch_device_mesh if pc is not None else None
        cp_rank = device_mesh["cp"].get_local_rank() if cp > 1 else 0
        group = tp * cp
        return cls(
            world,
            rank,
            dp_rank=rank // group,
            dp_size=world // group,
            tp=tp,
            cp=cp,
            cp_rank=cp_rank,
            sp=sp,
            ep=backend.ep_size,
            device_mesh=device_mesh,
        )

    @property
    def batch_replicas(self) -> int:
        """Row streams in the global batch: a Ulysses group trains on its ranks' batches together."""
        return self.dp_size // self.sp

    def describe(self) -> str:
        """e.g. "mesh dp_shard=2 x tp=2", "DeepSpeed Ulysses sp=2", or "" (for the start-up log); the
        pipeline describes itself (training.parallel.pipeline.Pipeline.describe)."""
        if self.pp > 1:
            return ""
        if self.device_mesh is None:  # DeepSpeed Ulysses builds its own groups, no torch mesh
            return f"DeepSpeed Ulysses sp={self.sp}" if self.sp > 1 else ""
        mesh = self.device_mesh
        return "mesh " + " x ".join(f"{n}={mesh[n].size()}" for n in mesh.mesh_dim_names)
