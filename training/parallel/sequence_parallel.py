"""Sequence and context parallelism: each sequence split over a group of processes, so sequences longer
than one device's activation memory still train, with the loss of one process seeing them whole.

Two backends, each chosen by its accelerate config file (the recipe does not change):

- DeepSpeed Ulysses (accelerate_configs/sp_ulysses.yaml: DEEPSPEED + `parallelism_config_sp_size`).
  accelerate's `prepare` registers DeepSpeed's UlyssesSPAttentionHF in place of the model's attention
  kernel and wraps the train loader in UlyssesSPDataLoaderAdapter: the sp_size processes of a group each
  load a batch, and then process every one of those batches together, each holding 1/sp_size of the
  sequence; inside attention an all-to-all swaps the sequence split for a head split (each process
  attends over the whole sequence with heads/sp_size heads) and back. The adapter shifts the labels
  before it splits the sequence (`shift_labels`: the target of a shard's last token is the next shard's
  first token) and keeps the global position ids with each shard (rotary embeddings). Runs on CPU over
  gloo: it is what `make test` proves.
- torch context parallelism (accelerate_configs/cp.yaml: FSDP2 + `parallelism_config_cp_size`): ring
  attention inside `accelerator.maybe_context_parallel`, which shards the batch's tensors along the
  sequence (load-balanced for causal attention) for the forward and backward of each micro-batch. The
  labels are shifted here first (SplitCollator). torch implements ring attention only for the CUDA SDPA
  kernels, so it is refused on CPU (training.launch) and tested on GPUs only.

What the training loop needs from this module (the degrees themselves: training.parallel.mesh):
  SplitCollator / split_ready(loader)   rows padded to a multiple of the split, position ids (and for
                                        CP shifted labels) added before the sequence is split
  resumable(loader)                     Ulysses' loader adapter with set_epoch and skip (exact resume)
  counted_once(mesh, counts)            this rank's window counts, each token counted once over the group
  sequence_shards(mesh, acc, batch)     the context-parallel context around forward + backward
The loss (training.objectives.next_token.token_loss) uses `shift_labels` against every logit when a batch carries them.
Evaluation is not split: under Ulysses accelerate disables the split in eval mode and the eval loader is
plain data-parallel over all processes; under CP every rank of a group evaluates the same full batch
(numerator and denominator of the eval loss both carry the factor cp).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from training.config import Recipe
from training.core.batch import IGNORE
from training.launch.backend import Backend
from training.model.build import pick_attention
from training.parallel.mesh import Mesh

log = logging.getLogger(__name__)

SP_ATTENTION_ENV = "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"


# ----------------------------------------------------------------------------- degrees


def use_recipe_attention(backend: Backend, recipe: Recipe) -> None:
    """Before the Accelerator exists: Ulysses wraps one attention kernel, and DeepSpeed refuses any other
    than the model's. `accelerate launch` always exports the file's parallelism_config_sp_attn_implementation
    (default sdpa); the recipe's model.attn_implementation (resolved as the model will be: sdpa on CPU,
    flash_attention_2 on GPUs with flash-attn under auto) decides instead, as for every other backend."""
    if backend.sp_size > 1:
        device = torch.device("cuda" if torch.cuda.is_available() and not backend.cpu else "cpu")
        os.environ[SP_ATTENTION_ENV] = pick_attention(recipe.model.attn_implementation, device)


# ----------------------------------------------------------------------------- batches


@dataclass
class SplitCollator:
    """The train loader's collator under sequence/context parallelism: rows right-padded to a multiple of
    the split (padding has attention_mask 0 and no label; causal attention never lets a real token see
    it), global position ids 0..L-1, and for context parallelism labels shifted to `shift_labels` before
    the context shards the sequence (DeepSpeed's loader adapter shifts them itself under Ulysses)."""

    inner: object
    multiple: int
    shift: bool
    length: int | None = None  # pad every row to this length (Ulysses over gloo, see split_ready)

    def __call__(self, rows):
        batch = dict(self.inner(rows))
        length = batch["input_ids"].shape[1]
        pad = (self.length - length) if self.length else -length % self.multiple
        if pad:
            fills = {"input_ids": getattr(self.inner, "pad_token_id", 0) or 0, "labels": IGNORE}
            for key, value in batch.items():
                if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == length:
                    batch[key] = F.pad(value, (0, pad), value=fills.get(key, 0))
        if "position_ids" not in batch:
            rows_, cols = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(cols).expand(rows_, cols).clone()
        if self.shift:
            labels = batch.pop("labels")
            batch["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        return batch


def split_ready(loader, mesh: Mesh, max_length: int):
    """The train DataLoader, its collator wrapped in SplitCollator when sequences are split (before
    `accelerator.prepare`, which copies the collator into the prepared loader).

    DeepSpeed's loader adapter all-gathers each rank's batch to the group with the batch's own length;
    gloo (CPU) refuses an all-gather of tensors of different sizes, so over gloo every row is padded to
    data.max_length (text blocks already are; chat/instruction rows pay padding). NCCL takes the
    different lengths, and rows are padded only to a multiple of the degree."""
    sp, cp = mesh.sp, mesh.cp
    if sp > 1 or cp > 1:
        gloo = sp > 1 and torch.distributed.get_backend() == "gloo"
        multiple = sp if sp > 1 else 2 * cp
        loader.collate_fn = SplitCollator(
            loader.collate_fn, multiple, shift=cp > 1, length=max_length if gloo else None
        )
    return loader


def counted_once(mesh: Mesh, counts: torch.Tensor) -> torch.Tensor:
    """This rank's window counts, such that their sum over all processes counts each token of the global
    window once: Ulysses shards are disjoint pieces of the sequences; under context parallelism every rank
    of a group holds the group's whole batch (sharded later, inside `sequence_shards`), so only the
    group's first rank counts it."""
    return torch.zeros_like(counts) if mesh.cp > 1 and mesh.cp_rank != 0 else counts


def sequence_shards(mesh: Mesh, accelerator: Accelerator, batch: dict):
    """Context parallelism: shard every [batch, sequence] tensor of `batch` over the cp group for the
    forward and backward run inside (accelerate's maybe_context_parallel; ring attention replaces SDPA).
    They stay sharded afterwards: the counts were taken before. A no-op otherwise."""
    if mesh.cp <= 1:
        return contextlib.nullcontext()
    length = batch["input_ids"].shape[1]
    buffers = [v for v in batch.values() if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == length]
    return accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    )


# ----------------------------------------------------------------------------- Ulysses' loader, resumable


class ResumableUlyssesLoader:
    """DeepSpeed's UlyssesSPDataLoaderAdapter (what accelerate's `prepare` returns under Ulysses), with what
    the training loop needs from a loader: `len`, `set_epoch`, and skipping the micro-batches a resumed
    run has already trained on.

    The adapter draws one batch per rank of the group and then yields, on every rank, its shard of each of
    those sp_size batches in rank order: its micro-batch k is the shard of the underlying batch k // sp
    of group rank k % sp. Skipping k micro-batches is therefore skipping k // sp batches of the prepared
    loader (accelerate's skip_first_batches) and k % sp micro-batches of the new adapter. Each pass builds
    a fresh adapter, after set_epoch, so every epoch reshuffles as without sequence parallelism."""

    def __init__(self, adapter, accelerator: Accelerator, skip: int = 0, loader=None):
        self.adapter, self.accelerator, self.skip = adapter, accelerator, skip
        self.loader = loader if loader is not None else adapter.dl

    def __len__(self) -> int:
        return len(self.adapter.dl) * self.adapter.sp_world_size

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def skip_first_batches(self, n: int) -> ResumableUlyssesLoader:
        size = self.adapter.sp_world_size
        skipped = self.accelerator.skip_first_batches(self.adapter.dl, n // size) if n >= size else None
        return ResumableUlyssesLoader(self.adapter, self.accelerator, n % size, skipped)

    def __iter__(self):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        a = self.adapter
        fresh = UlyssesSPDataLoaderAdapter(
            self.loader,
            sp_rank=a.sp_rank,
            sp_group=a.sp_group,
            sp_world_size=a.sp_world_size,
            device=a.device,
        )
        for i, batch in enumerate(fresh):
            if i >= self.skip:
                yield batch


def resumable(loader, mesh: Mesh, accelerator: Accelerator):
    """The prepared train loader, made resumable when accelerate wrapped it for Ulysses."""
    if mesh.sp > 1 and type(loader).__name__ == "UlyssesSPDataLoaderAdapter":
        return ResumableUlyssesLoader(loader, accelerator)
    return loader


def skip_first_batches(accelerator: Accelerator, loader, n: int):
    """accelerate's skip_first_batches, for any train loader the run may hold."""
    if isinstance(loader, ResumableUlyssesLoader):
        return loader.skip_first_batches(n)
    return accelerator.skip_first_batches(loader, n)
