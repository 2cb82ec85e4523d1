"""Varlen attention without flash-attn: packed (padding-free) batches on CPU and on GPUs without flash-attn.

Packed rows used to reach SDPA as padded rows with a dense block-diagonal mask that transformers builds
from the restarting position ids: every query scores every key of its row (rows of 1024 tokens holding
four 250-token examples do 4x the attention work needed), and a masked SDPA call cannot use the causal
kernel. "sdpa_varlen" is the exact alternative: the batch is flattened padding-free into one [1, total]
row (transformers' DataCollatorWithFlattening, as for flash_attention_2), and attention runs as one plain
causal SDPA call per example, over the example's own tokens, from the `cu_seq_lens_q` boundaries that the
collator adds and the model forwards to its attention function. Without those boundaries (eval batches,
generation) it is transformers' own SDPA, with the same masks. tests/unit/data/test_data_packing.py checks packed
logits equal unpacked ones.

Registered with transformers' AttentionInterface (its documented extension point) under
VARLEN_SDPA; the mask interface gets SDPA's mask function, so padded batches are masked as for "sdpa".
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

VARLEN_SDPA = "sdpa_varlen"
VARLEN = ("flash_attention_2", "flash_attention_3", VARLEN_SDPA)  # take padding-free [1, total] batches


def sdpa_varlen_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, heads, total, dim], key/value [1, kv_heads, total, dim] -> ([1, total, heads, dim], None)."""
    cu = kwargs.pop("cu_seq_lens_q", None)
    if cu is None or kwargs.get("sliding_window") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(
            f"{VARLEN_SDPA}: cu_seq_lens_q needs a flattened batch of one row, got {query.shape[0]}"
        )
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(k, None)
    bounds = cu.tolist()
    outs = [
        sdpa_attention_forward(
            module,
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            None,
            dropout,
            scaling,
            is_causal=True,
            **kwargs,
        )[0]
        for a, b in zip(bounds, bounds[1:])
        if b > a
    ]
    return torch.cat(outs, dim=1), None


AttentionInterface.register(VARLEN_SDPA, sdpa_varlen_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, sdpa_mask)


# Layer classes that carry state along the sequence (state-space, linear-attention, recurrent, convolutional):
# in a packed row the state of one sequence flows into the next, whatever the attention mask says.
SEQUENCE_STATE = (
    "mamba",
    "mixer",
    "gateddeltanet",
    "lightningattention",
    "rwkv",
    "recurrent",
    "rglru",
    "shortconv",
)


def sequence_state_layer(model) -> str:
    """'' or the class name of the model's first layer that carries state along the sequence (any torch
    Conv1d, or a class named as in SEQUENCE_STATE)."""
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or any(k in name.lower() for k in SEQUENCE_STATE):
            return name
    return ""


def packing_refusal(model) -> str:
    """'' where data.packing keeps a packed row's sequences apart on this model, else why not."""
    if layer := sequence_state_layer(model):
        return (
            f"{model.config.model_type}'s {layer} layers carry state along the sequence, so the sequences of a "
            "packed row would leak into each other (no padding-free kernel keeps them apart here); set "
            "data.packing: false"
        )
    return ""


def use_varlen_sdpa(model) -> bool:
    """Switch a model loaded with "sdpa" to VARLEN_SDPA (for packed data); False where the model's class
    does not take registered attention functions or uses sliding windows (it then keeps "sdpa" and the
    block-diagonal mask)."""
    config = model.config
    if config._attn_implementation != "sdpa" or getattr(config, "sliding_window", None):
        return False
    try:
        model.set_attn_implementation(VARLEN_SDPA)
    except (ValueError, KeyError):
        return False
    return model.config._attn_implementation == VARLEN_SDPA
