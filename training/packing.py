"""Sequence packing without cross-contamination.

Examples are placed into rows of at most `max_length` tokens by best-fit-decreasing (each example,
longest first, goes into the fullest row that still has room). A packed row stores its examples
back to back with `position_ids` that restart at 0 for every example, and the first token of
every example carries no label, so no loss ever flows from one example's last token into the next.

How attention is kept inside each example:
- flash_attention_2 (GPU): the batch is flattened padding-free into one [1, total] row by
  transformers' DataCollatorWithFlattening, with the varlen kwargs (cu_seq_lens_*, max_length_*).
- sdpa / eager: rows are [batch, longest row] with NO attention_mask: transformers (>= 5.x,
  masking_utils.find_packed_sequence_indices) then reads the example boundaries from the restarting
  position_ids and builds a block-diagonal causal mask; this detection is skipped when a KV cache is
  passed, so packed batches carry use_cache=False. Padding at the end of a row gets position
  id 0 on every token, so each padding token is a sequence of its own that nothing else attends to.
  tests/test_data_packing.py checks both give the same logits as unpacked examples.

The packing is hand-written (about 40 lines): TRL has an equivalent (`pack_dataset`, "bfd") but it
would be a large dependency for this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import torch

IGNORE = -100


def pad_batch(rows: list[dict], fills: dict[str, int], length: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad each key of `fills` in every row to `length` (default: the longest row) with its fill value."""
    n = length or max(len(r["input_ids"]) for r in rows)
    out = {k: torch.full((len(rows), n), fill, dtype=torch.long) for k, fill in fills.items()}
    for i, r in enumerate(rows):
        for k in fills:
            out[k][i, : len(r[k])] = torch.tensor(r[k])
    return out


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins whose lengths sum to at most `capacity`.

    O(n log capacity): a segment tree over "free space left" finds the smallest free space that
    still fits an item (best fit); bins with the same free space are kept on a stack.
    """
    if any(n > capacity or n <= 0 for n in lengths):
        raise ValueError("every length must be in 1..capacity")
    size = 1
    while size < capacity + 1:
        size *= 2
    count = [0] * (2 * size)  # count[node] = bins whose free space lies in the node's range
    stacks: list[list[int]] = [[] for _ in range(capacity + 1)]
    bins: list[list[int]] = []

    def add(free: int, delta: int) -> None:
        node = free + size
        while node:
            count[node] += delta
            node //= 2

    def smallest_free_at_least(need: int) -> int | None:
        # leftmost leaf >= need with a non-zero count
        node, lo, hi = 1, 0, size - 1
        if count[1] == 0:
            return None
        return _descend(node, lo, hi, need)

    def _descend(node: int, lo: int, hi: int, need: int) -> int | None:
        if hi < need or count[node] == 0:
            return None
        if lo == hi:
            return lo
        mid = (lo + hi) // 2
        found = _descend(2 * node, lo, mid, need)
        return found if found is not None else _descend(2 * node + 1, mid + 1, hi, need)

    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        free = smallest_free_at_least(n)
        if free is None:
            bins.append([i])
            b, left = len(bins) - 1, capacity - n
        else:
            b = stacks[free].pop()
            add(free, -1)
            bins[b].append(i)
            left = free - n
        if left > 0:
            stacks[left].append(b)
            add(left, +1)
    return bins


def pack_dataset(ds: datasets.Dataset, max_length: int, desc: str = "packing") -> datasets.Dataset:
    """Rows of several examples: input_ids, labels (first label of each example ignored), position_ids."""
    lengths = [len(x) for x in ds["input_ids"]]
    bins = best_fit_decreasing(lengths, max_length)
    bins.sort(key=min)  # keep the rows roughly in data order (the training order is shuffled anyway)

    def gather(batch):
        out = {"input_ids": [], "labels": [], "position_ids": []}
        for idxs in batch["examples"]:
            rows = ds[idxs]
            ids, labels, pos = [], [], []
            for x, y in zip(rows["input_ids"], rows["labels"]):
                ids += x
                labels += [IGNORE] + y[1:]  # nothing predicts an example's first token from the one before
                pos += range(len(x))
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["position_ids"].append(pos)
        return out

    index = datasets.Dataset.from_dict({"examples": bins})
    return index.map(gather, batched=True, batch_size=256, remove_columns=["examples"], desc=desc)


def packing_efficiency(ds: datasets.Dataset, max_length: int) -> float:
    """Real tokens / token slots (rows x max_length)."""
    return sum(len(x) for x in ds["input_ids"]) / max(1, len(ds) * max_length)


def real_tokens(batch: dict) -> torch.Tensor:
    """Non-padding tokens in a batch (padded, packed or flattened).

    Packed batches have no attention_mask: every example is at least 2 tokens long (a 1-token example
    has no label after packing, so it is never packed), hence a real token has position > 0 or sits at
    the start of a sequence whose next position is 1; padding tokens all have position 0.
    """
    if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
        return batch["attention_mask"].sum()
    if "position_ids" in batch:
        pos = batch["position_ids"]
        return pos.gt(0).sum() + pos.eq(1).sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)


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
        # and would silently let examples attend to each other (checked in tests/test_data_packing.py).
        return {**batch, "use_cache": False}

    @staticmethod
    def _flatten(rows: list[dict]) -> dict:
        from transformers import DataCollatorWithFlattening

        examples = []
        for r in rows:
            starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["position_ids"])]
            for a, b in zip(starts, starts[1:]):
                examples.append({"input_ids": r["input_ids"][a:b], "labels": r["labels"][a:b]})
        flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, separator_id=IGNORE)
        return {**flat(examples, return_tensors="pt"), "use_cache": False}
