"""Rows dropped from a batch as they finish: `generate` keeps every row of a batch until the last one ends.

A batched `generate` runs each decoding step over all its rows, finished or not, until every row has ended (or
the longest budget is spent). In the bundled agent task most replies of a turn end within a few tokens of each
other, but now and then one row runs on to its budget: 47 rows of 48 done after 9 tokens and the batch still
stepping all 48 to the 32nd (docs/rl.md). Here `generate` is stopped as soon as half the rows it runs are done
(their end token drawn, or their own budget spent), the finished rows are set aside, and the rest go on from
the same cache with only their own rows (`Cache.batch_select_indices`): each `generate` call after the first feeds
the one token its rows drew last and goes on stepping, as the single call would have.

A row draws what it draws in the single call: its noise comes from its own generator (the sampler keeps each
row's), its positions and mask are its own, and a row's logits do not depend on which other rows share the step
(tests/unit/generation/test_batching.py checks it token for token in fp32 against each row drawn alone).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import StoppingCriteria

from training.generation.keyed import KeyedSampler

# per decoder layer: the keys and values [N, kv heads, positions, head dim] of a batch at one moment
Layers = list[tuple[torch.Tensor, torch.Tensor]]
# each row's place: the layers its keys and values are in, and its index there
Places = list[tuple[Layers, int]]
# (ids, attention mask, cache, sampler, max new tokens, stopping criterion) -> (the new tokens, the cache)
Generate = Callable[..., tuple[torch.Tensor, object]]


class HalfDone(StoppingCriteria):
    """Stops `generate` once at least half its rows are done: an end token drawn after `start` (the width of its
    input), or their own remaining budget spent. Until then it stops nothing (`generate` pads an ended row)."""

    def __init__(self, start: int, budgets: torch.Tensor, eos: torch.Tensor):
        self.start, self.budgets, self.eos = start, budgets, eos

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = self.done(input_ids[:, self.start :])
        stop = 2 * int(done.sum()) >= len(done)
        return torch.full_like(done, stop)

    def done(self, new: torch.Tensor) -> torch.Tensor:
        """Which rows are done after drawing `new` [rows, tokens]."""
        return torch.isin(new, self.eos).any(-1) | (new.shape[1] >= self.budgets)


def layers_of(cache) -> Layers:
    """The keys and values each decoder layer of `cache` holds now."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def places_of(cache) -> Places:
    """Every row's place in `cache` as it is now."""
    layers = layers_of(cache)
    return [(layers, i) for i in range(layers[0][0].shape[0])]


def thinned(
    generate: Generate, ids, mask, cache, sampler: KeyedSampler, budgets: list[int], eos: list[int], pad: int
) -> tuple[torch.Tensor, Places]:
    """(the new tokens [N, steps drawn], padded after each row's end; each row's place in the cache) of `ids`
    drawn by `generate` with `cache` (a `RoomyCache` holding the positions before `ids`' last), each row's
    finished keys and values left where they are when the row is set aside."""
    n, device = ids.shape[0], ids.device
    budget, end = torch.tensor(budgets, device=device), torch.tensor(eos, device=device)
    out = ids.new_full((n, max(budgets)), pad)
    places: Places = [None] * n  # type: ignore[list-item]
    alive, drawn = torch.arange(n, device=device), 0
    while True:
        stop = HalfDone(ids.shape[1], budget[alive] - drawn, end)
        new, cache = generate(ids, mask, cache, sampler, int(budget[alive].max()) - drawn, stop)
        out[alive, drawn : drawn + new.shape[1]] = new
        drawn += new.shape[1]
        done = stop.done(new)
        layers = layers_of(cache)
        for j in done.nonzero().flatten().tolist():
            places[int(alive[j])] = (layers, j)
        if bool(done.all()):
            return out[:, :drawn], places
        keep = (~done).nonzero().flatten()
        cache.batch_select_indices(keep)
        ids = torch.cat([ids, new], 1)[keep]
        mask = torch.cat([mask, torch.ones_like(new)], 1)[keep]
        sampler, alive = sampler.rows(keep.tolist()), alive[keep]
