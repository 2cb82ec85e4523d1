"""The engine's key/value cache: transformers' `DynamicCache`, its layers keeping their keys and values in a buffer
with room for the call's new tokens, in the dtype attention reads them in.

transformers' `DynamicLayer` grows by `torch.cat`: every decoding step copies each layer's whole cache. Under a
bf16 autocast it also keeps the keys in fp32 (the rotary embedding computes in fp32), and autocast casts the whole
cache to bf16 again for attention at every step and layer. On a 2-core CPU the two took about a third of the
bundled agent task's generation (docs/rl.md). A `RoomyLayer` writes each step's keys and values into its buffer
(grown once per call, by the call's budget) and stores them cast to the autocast's dtype: attention reads the
same bf16 values it read before, so the draws are the same token for token (tests/unit/generation/test_kv_cache.py).

Only for models whose cache is one plain layer per decoder layer (prefix_cache.reusable: `cache_for`); others keep
the cache `generate` makes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from training.generation.prefix_cache import reusable


class RoomyLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with `room` more positions, stored in `dtype`
    (None: as they come)."""

    def __init__(self, room: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.room, self.dtype = room, dtype
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def length(self) -> int:
        """The positions held: `keys` is a view of the first `length` of the buffer's (a crop shortens it)."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.device, self.is_initialized = key_states.device, True
        end = self.length + key_states.shape[-2]
        if self._buffers is None or end > self._buffers[0].shape[-2]:
            self._buffers = (
                self._grown(self.keys, key_states, end),
                self._grown(self.values, value_states, end),
            )
        keys, values = self._buffers
        keys[..., self.length : end, :] = key_states  # cast to the buffer's dtype
        values[..., self.length : end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def _grown(self, old: torch.Tensor | None, new: torch.Tensor, end: int) -> torch.Tensor:
        """A buffer for `end + room` positions holding the `length` positions of `old`."""
        shape = (*new.shape[:-2], end + self.room, new.shape[-1])
        buffer = new.new_empty(shape, dtype=self.dtype or new.dtype)
        if self.length:
            buffer[..., : self.length, :] = old
        return buffer

    def _rebased(self) -> None:
        """After transformers' own edits that replace `keys`/`values` (reorder, select, repeat, reset): they are the
        buffers. (A crop leaves them views of the buffers, shorter: the next update writes over what it cut.)"""
        self._buffers = None if self.keys is None else (self.keys, self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rebased()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rebased()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """The rows `indices` kept, in new buffers with the room the old ones had (the old ones, which views of
        rows set aside may still hold, are left as they are)."""
        if self._buffers is None:  # nothing held yet, or transformers' own tensors
            super().batch_select_indices(indices)
            self._rebased()
            return
        n = self.length
        fresh = [old.new_empty((len(indices), *old.shape[1:])) for old in self._buffers]
        for new, old in zip(fresh, self._buffers):
            new[..., :n, :] = old[indices, ..., :n, :]
        self._buffers = (fresh[0], fresh[1])
        self.keys, self.values = fresh[0][..., :n, :], fresh[1][..., :n, :]

    def reset(self) -> None:
        super().reset()
        self._rebased()


class RoomyCache(DynamicCache):
    """A `DynamicCache` of `RoomyLayer`s, one per decoder layer of `config`, holding `kv` (per layer: keys and values
    [N, kv heads, positions, head dim]) where given."""

    def __init__(self, config, room: int, dtype: torch.dtype | None = None, kv=None):
        layers = config.get_text_config(decoder=True).num_hidden_layers
        Cache.__init__(self, layers=[RoomyLayer(room, dtype) for _ in range(layers)])
        for layer, (keys, values) in zip(self.layers, kv or []):
            layer.update(keys, values)


def cache_for(model, ids, max_new_tokens: int, kv=None) -> RoomyCache | None:
    """The cache `generate` fills for `ids`, holding `kv` (per decoder layer, the keys and values of the first
    positions of `ids`) where given: room for the positions of `ids` after `kv`'s and the call's new tokens, in the
    dtype the autocast entered here computes in (attention reads the keys and values in it). None (the cache
    `generate` makes) for a model whose cache is not one plain layer per decoder layer."""
    if kv is None and not reusable(model):
        return None
    # room past the first positions the cache is given: `kv`'s, or the prefill of all of `ids`
    room = max_new_tokens + (ids.shape[1] - kv[0][0].shape[-2] if kv else 0)
    return RoomyCache(model.config, room, autocast_dtype(ids.device.type), kv)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype the autocast entered here computes in (None: no autocast)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
