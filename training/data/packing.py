"""Sequence packing without cross-contamination: several tokenized examples to a row.

Examples are placed into rows of at most `max_length` tokens by best-fit-decreasing (each example,
longest first, goes into the fullest row that still has room). A packed row stores its examples
back to back with `position_ids` that restart at 0 for every example, and the first token of
every example carries no label, so no loss ever flows from one example's last token into the next.
How attention is then kept inside each example is the batching's job (PackedCollator in
training/data/loader.py).

The packing is hand-written (about 40 lines): TRL has an equivalent (`pack_dataset`, "bfd") but it
would be a large dependency for this one function.
"""

from __future__ import annotations

import datasets

from training.core.batch import IGNORE


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
