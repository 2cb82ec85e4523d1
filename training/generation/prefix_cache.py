"""Prefix reuse for the transformers engine: keys and values computed once, not again at every turn.

Two prefixes repeat in rollouts. The `num_generations` requests of a group share their prompt, and an
episode's next turn extends its last turn (its prompt, its reply, the tool results). Without reuse each
`generate` call computes every row's whole context again: on a 2-core CPU, 16 agent prompts of 300 tokens
cost SmolLM2-135M about 9 s a turn before the first new token (measured), as much as drawing 40 tokens.

With reuse, a batch is drawn in three moves:
1. `prefill`: the distinct contexts that have no stored prefix are run once (one left-padded `generate` of
   one token; its token is dropped), and every row then holds the keys and values of all its context but
   the last token (transformers' own position and mask handling, so any model with a plain cache works);
   a prefix they all share (a system prompt and its tools) is run once before them;
2. `layout`: the rows are left-padded so that each feeds only its last `width` tokens (the longest row's
   new part); what comes before is given to `generate` as a cache (kv_cache.RoomyCache) assembled from the
   rows' stored keys and values. Every row is padded on the left only, as in a batch without reuse;
3. `keep`: after the call, each row's keys and values (its context and its reply, but the reply's last
   token, which was never fed) are kept in the `PrefixStore` the caller passed, for its next turn.

What a row draws is its key's noise over its own logits, as without reuse: only the order of the floating-
point sums differs (computed in one pass or in two), which the tests check leaves every token the same in
fp32. Models whose cache is not one plain key/value layer per decoder layer (sliding windows, recurrent
states, shared layers) and ranks that generate in step (ZeRO-3/FSDP with their weights left sharded: every rank
must make as many forward passes) are drawn without reuse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: keys, values [kv heads, tokens, head dim]


@dataclass
class PrefixStore:
    """The keys and values one caller keeps between its calls (an episode run: each turn's rows for the next
    turn), by the token ids they are of. Each call replaces what the previous kept."""

    entries: dict[tuple[int, ...], KV] = field(default_factory=dict)

    def longest(self, ids: list[int]) -> tuple[int, KV | None]:
        """(length, keys and values) of the longest stored prefix of `ids` that leaves at least one token."""
        best, kv = 0, None
        for key, value in self.entries.items():
            n = len(key)
            if best < n < len(ids) and tuple(ids[:n]) == key:
                best, kv = n, value
        return best, kv


# a prefix all of a call's new contexts share is computed once when it is at least this long (shorter, a call of its
# own costs about what it saves)
SHARED_PREFIX_TOKENS = 16


def shared_prefix(contexts: list[list[int]]) -> list[int]:
    """The longest prefix two or more contexts all share that leaves each at least one token ([] for one context)."""
    if len(contexts) < 2:
        return []
    # os.path.commonprefix compares element by element: any sequences, not only strings
    return os.path.commonprefix(contexts)[: min(len(x) for x in contexts) - 1]


def reusable(model) -> bool:
    """Whether the model's cache is one plain (full-attention, dynamic) key/value layer per decoder layer."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a config transformers cannot lay a cache out for: no reuse
        return False
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def reuse_refusal(model, in_step: bool) -> str | None:
    """Why `model`'s contexts are computed again at every call instead of reused (None: they are reused);
    `in_step`: the ranks run each forward pass together (the engine's `in_step`)."""
    if in_step:
        return "ZeRO-3/FSDP ranks generate in step (rl.gather_for_generation: false)"
    if not reusable(model):
        return "its cache is not one plain key/value layer per decoder layer"
    return None


def rows_of(places, spans: list[tuple[int, int]]) -> list[KV]:
    """Each row's keys and values over its own span [start, end) of the positions, from its place (thinning.py:
    the layers of keys and values it is in, and its index there)."""
    return [[(k[i, :, a:b], v[i, :, a:b]) for k, v in layers] for (layers, i), (a, b) in zip(places, spans)]


@dataclass
class Layout:
    """A batch laid out for reuse: ids and attention mask [N, width + cached] (left-padded) and, per decoder layer,
    the keys and values of the first `cached` positions [N, kv heads, cached, dim] (None when no row uses any)."""

    ids: torch.Tensor
    mask: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None
    cached: int


def layout(contexts: list[list[int]], stored: list[tuple[int, KV]], pad: int, device) -> Layout:
    """The rows of `contexts` given their stored prefixes: each row feeds its last `width` tokens (the longest
    new part of any row), the rest of its context coming from its stored keys and values."""
    width = max(len(ids) - n for ids, (n, _) in zip(contexts, stored))
    used = [max(0, len(ids) - width) for ids in contexts]  # stored positions each row uses (<= its stored n)
    cached = max(used)
    ids, mask = left_padded(contexts, pad, device, cached + width)
    return Layout(ids, mask, stack_layers(stored, used, cached) if cached else None, cached)


def left_padded(contexts: list[list[int]], pad: int, device, width: int | None = None):
    """(ids, attention mask) [N, width] of the contexts padded on the left (to the longest by default)."""
    width = width or max(len(x) for x in contexts)
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in contexts], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in contexts], device=device)
    return ids, mask


def stack_layers(stored: list[tuple[int, KV]], used: list[int], cached: int):
    """Per layer, the rows' first `used[i]` stored positions, right-aligned in [N, kv heads, cached, dim]."""
    some = next(kv for _, kv in stored if kv is not None)
    out = []
    for layer, (k0, v0) in enumerate(some):
        keys = k0.new_zeros((len(stored), k0.shape[0], cached, k0.shape[2]))
        values = v0.new_zeros((len(stored), v0.shape[0], cached, v0.shape[2]))
        for i, ((_, kv), n) in enumerate(zip(stored, used)):
            if n:
                keys[i, :, cached - n :] = kv[layer][0][:, :n]
                values[i, :, cached - n :] = kv[layer][1][:, :n]
        out.append((keys, values))
    return out
