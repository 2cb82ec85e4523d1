"""The engine's cache (training/generation/kv_cache.py) holds what transformers' DynamicCache holds, in a buffer
grown once per call and, under a bf16 autocast, in bf16: `generate` draws the same tokens with the same scores as
with its own cache, in fp32 and under autocast."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_ARCH
from training.generation.kv_cache import RoomyCache, autocast_dtype

NEW = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH)).eval()


def draw(model, cache, autocast: bool):
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = (ids != 0).long()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), context:
        own = RoomyCache(model.config, NEW, autocast_dtype("cpu")) if cache else None
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            cache=own,
        )
    return out, own


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_generate_draws_the_same_with_the_roomy_cache(model, autocast):
    theirs, _ = draw(model, False, autocast)
    ours, cache = draw(model, True, autocast)
    assert torch.equal(theirs.sequences, ours.sequences)
    assert all(torch.equal(a, b) for a, b in zip(theirs.scores, ours.scores))
    layer = cache.layers[0]
    # the keys the attention read: stored once, in the autocast's dtype
    assert layer.keys.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert layer.keys.shape[-2] == 5 + NEW - 1  # the last token drawn is never fed
    assert layer._buffers[0].shape[-2] == 5 + NEW  # one buffer for the whole call: it never grew
    for (k, v), theirs_layer in zip(((x.keys, x.values) for x in cache.layers), theirs.cache.layers):
        assert torch.equal(k, theirs_layer.keys.to(k.dtype)) and torch.equal(
            v, theirs_layer.values.to(v.dtype)
        )


def test_a_cache_holding_a_prefix_grows_past_its_room_and_keeps_it():
    torch.manual_seed(1)
    keys, values = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    cache = RoomyCache(LlamaConfig(**TINY_ARCH), room=1, kv=[(keys, values)] * TINY_ARCH["num_hidden_layers"])
    layer = cache.layers[0]
    more_k, more_v = torch.randn(2, 3, 3, 8), torch.randn(2, 3, 3, 8)
    k, v = layer.update(more_k, more_v)
    assert torch.equal(k, torch.cat([keys, more_k], -2)) and torch.equal(v, torch.cat([values, more_v], -2))
    assert cache.get_seq_length() == 7
    layer.crop(-2)
    k, _ = layer.update(more_k[..., :1, :], more_v[..., :1, :])
    assert torch.equal(k, torch.cat([keys, more_k[..., :1, :], more_k[..., :1, :]], -2))


def test_rows_selected_keep_their_keys_and_the_room_and_leave_the_rows_set_aside_as_they_were():
    torch.manual_seed(2)
    keys, values = torch.randn(3, 3, 4, 8), torch.randn(3, 3, 4, 8)
    cache = RoomyCache(LlamaConfig(**TINY_ARCH), room=2, kv=[(keys, values)] * TINY_ARCH["num_hidden_layers"])
    layer = cache.layers[0]
    aside = layer.keys[1]  # a view of a row set aside (thinning.py keeps such views for the prefix store)
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert torch.equal(layer.keys, keys[[0, 2]]) and torch.equal(layer.values, values[[0, 2]])
    assert torch.equal(aside, keys[1])
    buffer = layer._buffers[0]
    more = torch.randn(2, 3, 2, 8)
    k, _ = layer.update(more, more)  # within the room: written into the same buffer, not grown
    assert layer._buffers[0] is buffer and torch.equal(k, torch.cat([keys[[0, 2]], more], -2))
