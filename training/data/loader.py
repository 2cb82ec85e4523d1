"""Batching: tokenized (or packed) rows -> tensors, in an order that a resumed run repeats.

Unpacked examples are right-padded to the longest in the batch, with an attention_mask. Packed rows
keep attention inside each example:
- flash_attention_2 (GPU): the batch is flattened padding-free into one [1, total] row by
  transformers' DataCollatorWithFlattening, with the varlen kwargs (cu_seq_lens_*, max_length_*).
- sdpa_varlen (training/model/attention.py; CPU, or a GPU without flash-attn): flattened the same way, with
  one causal SDPA call per example; the default for packed data wherever the model takes it.
- sdpa / eager: rows are [batch, longest row] with NO attention_mask: transformers (>= 5.x,
  masking_utils.find_packed_sequence_indices) then reads the example boundaries from the restarting
  position_ids and builds a block-diagonal causal mask; this detection is skipped when a KV cache is
  passed, so packed batches carry use_cache=False. Padding at the end of a row gets position
  id 0 on every token, so each padding token is a sequence of its own that nothing else attends to.
  tests/unit/data/test_data_packing.py checks every path gives the same logits as unpacked examples.
The order: a shuffle that depends only on (seed, epoch), optionally length-grouped
(train.group_by_length, transformers' own grouping), so a resumed run skips exactly the batches it saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DataCollatorWithFlattening
from transformers.trainer_pt_utils import get_length_grouped_indices

from training.config import ImageTokens
from training.core.batch import IGNORE, TEACHER_TOPK
from training.data.images import ImageBatcher


def pad_batch(rows: list[dict], fills: dict[str, int], length: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad each key of `fills` in every row with its fill value, to `length` (default: the longest)."""
    n = length or max(len(r["input_ids"]) for r in rows)
    out = {k: torch.full((len(rows), n), fill, dtype=torch.long) for k, fill in fills.items()}
    for i, r in enumerate(rows):
        for k in fills:
            out[k][i, : len(r[k])] = torch.tensor(r[k])
    return out


def pad_vectors(rows: list[dict], key: str, length: int) -> torch.Tensor:
    """[rows, length, k] of a per-token vector column (k values per token, flattened in each row), zeros
    after each row's end."""
    first = rows[0]
    k = len(first[key]) // max(len(first["input_ids"]), 1)
    values = [torch.tensor(r[key]).view(len(r["input_ids"]), k) for r in rows]
    out = values[0].new_zeros((len(rows), length, k))
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


@dataclass
class Collator:
    """Batches of examples, right-padded to the longest one, with an attention_mask; the rows' images
    (an image-text run's) decoded into one pixel_values tensor, in the order their tokens come; per-token
    vectors (a distillation teacher's top-k) as [rows, length, k]."""

    pad_token_id: int
    images: ImageBatcher | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = pad_batch(
            [{**r, "attention_mask": [1] * len(r["input_ids"])} for r in rows],
            {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE},
        )
        for key in TEACHER_TOPK:  # a distillation run's precomputed teacher, per token
            if key in rows[0]:
                batch[key] = pad_vectors(rows, key, batch["input_ids"].shape[1])
        files = [f for r in rows for f in r.get("images") or ()]
        if self.images is not None and files:
            batch.update(self.images(files, batch["input_ids"]))
        return batch


@dataclass
class PackedCollator:
    """Batches of packed rows: padded rows for sdpa/eager, one flattened row for flash_attention_2."""

    pad_token_id: int
    padding_free: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.padding_free:
            return self._flatten(rows)
        batch = pad_batch(rows, {"input_ids": self.pad_token_id, "labels": IGNORE, "position_ids": 0})
        # use_cache=False: with a KV cache object present transformers skips the packed-sequence detection
        # and would silently let examples attend to each other (checked in tests/unit/data/test_data_packing.py).
        return {**batch, "use_cache": False}

    @staticmethod
    def _flatten(rows: list[dict]) -> dict:
        examples = []
        for r in rows:
            starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["position_ids"])]
            for a, b in zip(starts, starts[1:]):
                examples.append({"input_ids": r["input_ids"][a:b], "labels": r["labels"][a:b]})
        flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, separator_id=IGNORE)
        return {**flat(examples, return_tensors="pt"), "use_cache": False}


class EpochSampler(torch.utils.data.Sampler):
    """A shuffle that depends only on (seed, epoch), so a resumed run sees the same order.

    With `lengths` (and the group size: the global window of a step in training), the shuffle is
    length-grouped as transformers' Trainer does it (`get_length_grouped_indices`: shuffled mega-batches of
    50 groups, each sorted by length, the longest group first), from the same (seed, epoch) generator:
    every rank computes the same order and accelerate hands each its share of the batches, as for the
    plain shuffle. Grouped by the global window, a step's examples are the same whether it runs as one
    batch of 4 or as 2 ranks x 2 accumulated batches of 1.
    """

    def __init__(
        self, n: int, seed: int, shuffle: bool = True, lengths: list[int] | None = None, batch_size: int = 1
    ):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0
        self.lengths, self.batch_size = lengths, batch_size  # batch_size: the size of a length group

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.lengths is not None:
            return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=g))
        return iter(torch.randperm(self.n, generator=g).tolist())


def make_loader(
    ds,
    batch_size: int,
    tokenizer,
    seed: int,
    shuffle: bool,
    padding_free: bool = False,
    group_by_length: bool = False,
    images: ImageTokens | None = None,
    group_size: int | None = None,
) -> torch.utils.data.DataLoader:
    """Batches of examples (padded, with attention_mask) or of packed rows (position_ids, no mask;
    with padding_free=True, for varlen attention, flattened into one row with varlen kwargs).
    group_by_length: batches of similar lengths (less padding), in a shuffled order (image tokens counted),
    grouped in `group_size` examples (default batch_size; training passes the global window, batch x
    data-parallel ranks x accumulation, so that every backend's step sees the same examples).
    images: an image-text run's image tokens (its rows' image files become the batch's pixel_values)."""
    packed = "position_ids" in ds.column_names
    pad = tokenizer.pad_token_id
    collate = PackedCollator(pad, padding_free) if packed else Collator(pad, images and ImageBatcher(images))
    lengths = [len(x) for x in ds["input_ids"]] if group_by_length and shuffle else None
    return torch.utils.data.DataLoader(
        ds.with_format(None),
        batch_size=batch_size,
        sampler=EpochSampler(len(ds), seed, shuffle, lengths, group_size or batch_size),
        collate_fn=collate,
        drop_last=shuffle,
        generator=torch.Generator().manual_seed(seed),  # keeps the global RNG untouched by loader iteration
    )
