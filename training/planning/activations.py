"""The planner's activation memory: what one micro-batch's forward keeps for the backward and the loss's
transient peak, per token and decoder layer, calibrated on CPU against the tensors autograd really saves
(benchmarks/planner_accuracy.py); and what gradient checkpointing, the tiled MLP and activation offloading
(training.model.tiled_mlp, training.model.offload) change in it."""

from __future__ import annotations

from dataclasses import dataclass

from training.config import Recipe
from training.core.dtypes import DTYPES
from training.launch.backend import Backend
from training.model.layer_config import largest
from training.model.tiled_mlp import tile_count
from training.objectives.next_token import CHUNK_ELEMENTS, logit_postprocessing
from training.planning.inventory import ModelInventory

# ----------------------------------------------------------------------------- activations

# Bytes saved for backward per token and decoder layer: c_h*hidden + c_f*intermediate + c_kv*kv_dim
# + 4*heads (attention logsumexp) + 8 (RMSNorm statistics). Modes: fp32 (weights and compute),
# half (bf16/fp16 weights, incl. DeepSpeed's cast), autocast (fp32 weights, bf16/fp16 compute).
# Calibrated against torch.autograd saved tensors on CPU (benchmarks/planner_accuracy.py); the bf16
# copies autocast makes of fp32 weights are not per token and are counted under buffers.
_LAYER = {"fp32": (32, 16, 8), "half": (20, 8, 4), "autocast": (30, 8, 4)}
# LoRA: the frozen base keeps fewer inputs, fp32 adapters cast theirs: c_h changes; + c_rank per adapter
# rank unit, + dropout masks/outputs per adapted input feature when lora.dropout > 0. "half" (bf16 weights) was
# 40 until 2026-11-28, when two measurements without dropout put it at 24: SmolLM2-135M's saved tensors at
# 2 x 512 tokens (996 MiB measured, 1,264 planned with 40, 994 with 24) and a LoRA step of the Llama-3-8B shape
# at 16,384 tokens (7.82 GiB measured, 8.96 planned with 40; docs/long-context.md).
_LORA_H = {"fp32": 24, "half": 24, "autocast": 24}
_LORA_RANK = {"fp32": 4, "half": 4, "autocast": 2}
_LORA_DROPOUT = {"fp32": 6, "half": 4, "autocast": 4}
# LoRA/QLoRA under gradient checkpointing: the one recomputed layer's backward holds, beyond what that layer
# saves, the gradients of its MLP intermediates, in bytes per intermediate feature and token. Measured on
# CPU (2026-11-27, SmolLM2-135M, 8 x 1024 tokens, the peak between two layers' backward hooks less the
# stored inputs): 8.7 under bf16 autocast, 6.5 in fp32; it also closes most of the 15% the one-layer QLoRA
# step at the 8B shape was under (docs/benchmarks.md). Full fine-tuning's is under 5 and its peak lies in
# the forward (autocast's cached weight copies) or the optimizer step, so it is not added there.
_LORA_CKPT_WORK = {"fp32": 7, "half": 9, "autocast": 9}
# The tiled MLP (model.tiled_mlp) keeps, beyond the MLP intermediates (c_f), none of the MLP's own copies of
# its input: autocast's bf16 casts of it for the gate and up projections, in bytes per hidden feature and token.
# Measured on CPU (2026-11-28, SmolLM2-135M, 2 x 512 tokens, saved tensors with and without 4 tiles): 0 in fp32,
# 2-2.5 in bf16 weights, 9-9.5 under autocast (the smaller of full fine-tuning's and LoRA's here).
_TILED_H = {"fp32": 0, "half": 2, "autocast": 9}
# The tiled MLP also tiles the layer's norms (training.model.tiled_mlp), whose fp32 working copies and backward
# temporaries (18 bytes per hidden feature and token in bf16 weights) made the post-attention norm's backward
# the recomputed layer's peak past ~12K tokens when only the MLP was tiled. With them tiled, the layer's peak is
# its last MLP tile's backward, and the backward phase of a LoRA step at the Llama-3-8B shape (1 layer, bf16
# weights, checkpointing, tiles of 256) grew by 26.8 bytes per hidden feature and token from 4K to 8K tokens,
# where these terms say 27.6 (measured on CPU, 2026-11-28). In fp32, 2K to 4K tokens: 34.5 measured, 35.2 here.
# Under autocast: 35.5 measured, 21.9 here; its forward (the weights' bf16 copies) is the peak up to ~35K tokens
# at that shape, past which these terms under-count (not recalibrated yet; docs/long-context.md).
# Outside the layers, per token: embeddings, final norm, LM-head input (c*hidden) and the fp32
# log-softmax of the logits (c*vocab) that the cross-entropy keeps.
_REST = {
    ("full", "fp32"): (13.3, 4),
    ("full", "half"): (8.8, 4),
    ("full", "autocast"): (11.3, 4),
    ("lora", "fp32"): (1.1, 4),
    ("lora", "half"): (0.6, 4),
    ("lora", "autocast"): (-2.25, 4),
}


def precision_mode(recipe: Recipe, backend: Backend | None) -> str:
    half = recipe.precision in ("bf16", "fp16")
    if recipe.model.dtype != "float32" or (half and backend is not None and backend.kind == "deepspeed"):
        return "half"
    if recipe.method.type == "qlora" and recipe.quantization_compute_dtype != "float32":
        return "autocast"
    return "autocast" if half else "fp32"


def loss_is_chunked(recipe: Recipe, b: Backend | None, config) -> bool:
    """Whether training.objectives.next_token computes this run's loss in chunks (see training.objectives.next_token.choose_loss): not
    when asked for full logits, under tensor parallelism or torch.compile, for models that post-process
    their logits, or with a LoRA adapter on the output head."""
    targets = recipe.method.lora.target_modules
    lora_head = recipe.method.type in ("lora", "qlora") and (
        "lm_head" in targets if isinstance(targets, (list, tuple)) else targets == "lm_head"
    )
    return not (
        recipe.train.loss_impl == "full"
        # RL's token log-probabilities come from the whole logits (rl/loss.py)
        or recipe.rl is not None
        or (b is not None and b.tp_size > 1)
        or recipe.train.torch_compile
        or logit_postprocessing(config)
        or lora_head
    )


def chunked_loss_bytes(recipe: Recipe, inv: ModelInventory, mode: str, tokens: float) -> tuple[int, int]:
    """(kept from the end of the forward to the loss's backward, transient peak) of the chunked loss
    (training.objectives.next_token.ChunkedLinearCrossEntropy): the input gradient it leaves (one hidden vector
    per token, fp32 under autocast and fp32) and, when the head trains, the head's weight gradient; and while it
    runs: one chunk of logits in the compute dtype and in fp32 plus the softmax's fp32 temporary and its cast
    (2e + 8 bytes per logit, measured 2026-11-22 with benchmarks/planner_accuracy.py), the inputs cast to the
    compute dtype, and a compute-dtype copy of the head when its weight is fp32 under autocast. (The head
    gradient's own matmul temporaries come after each chunk's logits are freed, and are about their size.)"""
    c = inv.config
    h, vocab = c.hidden_size, c.vocab_size
    e = 4 if mode == "fp32" else 2
    x = 2 if mode == "half" else 4  # the hidden states: bf16/fp16 weights, else fp32 (autocast's residual)
    kept = tokens * h * x
    rows = min(max(1, CHUNK_ELEMENTS // vocab), max(1, int(tokens)))
    head_copy = h * vocab * e if mode == "autocast" and not _head_in_half(recipe) else 0
    if recipe.method.type == "full":  # the head's weight gradient, accumulated over the chunks in its dtype
        kept += h * vocab * (2 if mode == "half" else 4)
    transient = rows * vocab * (2 * e + 8) + tokens * h * e + head_copy
    return int(kept), int(transient)


def _head_in_half(recipe: Recipe) -> bool:
    q = recipe.method.quantization
    return (
        recipe.method.type == "qlora"
        and q.quant_storage == "uint8"
        and q.embeddings_dtype == "compute"
        and recipe.quantization_compute_dtype != "float32"
    )


@dataclass(frozen=True)
class LayerTerms:
    """Per-token bytes of one decoder layer on one rank (see activation_bytes)."""

    kept: float  # what the layer saves for its backward (without checkpointing: every layer's)
    recomputed: float  # the one layer at work in the backward under checkpointing (its saves + its work)
    mlp_tile: float  # the tiled MLP: one tile's intermediates and their gradients (per token of the tile)
    tiles: int  # sequence tiles of the MLP (1: untiled)
    inputs: float  # under checkpointing, the input each layer keeps (r x hidden)


def micro_batch(recipe: Recipe) -> tuple[int, int]:
    """(tokens per sequence, sequences) of one micro-batch through the policy: preference pairs go through
    together; RL trains each prompt's num_generations completions of up to max_new_tokens."""
    s, b = recipe.data.max_length, recipe.train.batch_size
    if recipe.preference is not None and recipe.preference.objective != "kto":
        b *= 2  # chosen and rejected sequences go through the policy in one batch
    if recipe.rl is not None:
        s, b = s + recipe.rl.max_new_tokens, b * recipe.rl.num_generations
    return s, b


def layer_terms(
    recipe: Recipe, inv: ModelInventory, mode: str, checkpointing: bool, attn: str, tp: int, seq: int, cp: int
) -> LayerTerms:
    """The decoder layer's per-token terms: _LAYER's saved tensors (LoRA's own), the recomputed layer's
    working set under checkpointing, and what model.tiled_mlp takes out of both (the MLP intermediates,
    then held for one tile of a rank's seq / cp tokens of a sequence at a time)."""
    c = inv.config
    h, heads, f, kv = c.hidden_size, c.num_attention_heads, mlp_width(c), kv_dim(c)
    head_dim = head_size(c)
    e = 4 if mode == "fp32" else 2
    lora = recipe.method.type in ("lora", "qlora")
    c_h, c_f, c_kv = _LAYER[mode]
    if lora:
        c_h = _LORA_H[mode]
    if attn == "eager":  # scores + fp32 softmax kept; grouped k/v expanded to all heads
        kv = heads * head_dim
    attention = c_kv * kv + (heads * seq * (4 + (e if e == 2 else 0)) if attn == "eager" else 4 * heads)
    layer = c_h * h + 8 + (c_f * f + attention) / tp
    if lora:
        layer += _LORA_RANK[mode] * inv.lora_ranks + (
            _LORA_DROPOUT[mode] * inv.lora_inputs if recipe.method.lora.dropout else 0
        )
    # what the recomputed layer's backward holds beyond its saved tensors (per token)
    work = _LORA_CKPT_WORK[mode] * f / tp if lora and checkpointing else 0
    inputs = 2 if mode == "half" else 4
    tiles = tile_count(recipe.model.tiled_mlp, max(1, seq // cp), h) if recipe.model.tiled_mlp else 1
    if tiles == 1:
        return LayerTerms(layer, layer + work, 0, 1, inputs * h)
    # kept for one tile only, with the gradients of that tile's intermediates
    mlp = c_f * f / tp + _TILED_H[mode] * h
    tile = mlp + (_LORA_CKPT_WORK[mode] * f / tp if lora else mlp)
    return LayerTerms(layer - mlp, layer - mlp, tile, tiles, inputs * h)


def activation_bytes(
    recipe: Recipe,
    inv: ModelInventory,
    mode: str,
    checkpointing: bool,
    attn: str,
    tp: int = 1,
    cp: int = 1,
    chunked_loss: bool = False,
) -> tuple[int, int]:
    """(saved activations at the end of the forward, transient peak of the loss) for one micro-batch, on
    one rank: under tensor parallelism (tp) the terms inside the split layers (MLP intermediate, key/value,
    per-head attention) are divided by tp, the layer inputs and the logits stay whole; context
    parallelism (cp) splits the sequence, so every per-token term is divided by cp (an approximation).

    chunked_loss: the loss never holds the logits (training.objectives.next_token); no fp32 log-softmax is kept,
    and its transient peak, at the end of the forward, comes before the one layer that gradient checkpointing
    recomputes in backward (the two never coexist: only the larger counts). model.tiled_mlp: one tile's MLP
    intermediates instead of the whole sequence's; model.activation_offloading: the layers' saved tensors
    live on the host but for the two layers in flight (offloaded_bytes counts the host's share)."""
    c = inv.config
    L, e = c.num_hidden_layers, 4 if mode == "fp32" else 2
    s, b = micro_batch(recipe)
    t = layer_terms(recipe, inv, mode, checkpointing, attn, tp, s, cp)
    lora = recipe.method.type in ("lora", "qlora")
    # QLoRA's dequantised copy of its largest 4-bit weight (intermediate x hidden) for each backward matmul
    dequant = 0
    if recipe.method.type == "qlora":
        dequant = mlp_width(c) * c.hidden_size * DTYPES[recipe.quantization_compute_dtype].itemsize / tp
    rest_h, rest_v = _REST[("lora" if lora else "full", mode)]
    rest, head = rest_h * c.hidden_size, 0 if chunked_loss else rest_v * c.vocab_size
    tokens = s * b / cp
    # the positions the vocabulary head runs on: every one but the last, or RL's scored completions only (its losses
    # make logits from the first scored token on, training/model/logits.py: at most max_new_tokens a sequence)
    heads = (recipe.rl.max_new_tokens if recipe.rl is not None else s - 1) * b / cp
    on_device = min(L, 2) if recipe.model.activation_offloading else L  # layers whose saves stay
    stored = t.inputs if checkpointing else t.kept  # per layer, for the backward
    mlp_tile = tokens / t.tiles * t.mlp_tile  # the one tile at work (0 untiled)
    if chunked_loss:
        kept, transient = chunked_loss_bytes(recipe, inv, mode, tokens)
        if checkpointing:
            at_work = tokens * t.recomputed + dequant + mlp_tile
            return int(tokens * (on_device * stored + rest) + kept + max(at_work, transient)), 0
        return int(tokens * (on_device * stored + rest) + kept + dequant + mlp_tile), transient
    saved = tokens * (on_device * stored + rest) + heads * head + dequant + mlp_tile
    if checkpointing:  # each layer keeps its input; one layer is recomputed at a time in backward
        saved += tokens * t.recomputed
    if recipe.rl is not None and recipe.rl.num_iterations > 1:
        saved += 4 * tokens * recipe.train.grad_accum  # the window's kept sampling log-probabilities (fp32)
    saved += tower_activation_bytes(recipe, inv, mode, checkpointing)
    # gradient of the fp32 log-softmax + its cast, at the start of backward (logits gathered under TP)
    loss_peak = tokens * c.vocab_size * (8 + e)
    if recipe.rl is not None:  # + the entropy's exp of the log-softmax; the rollouts' KV cache comes before
        kv = rollout_kv_bytes(recipe, inv, mode)
        loss_peak = max(heads * c.vocab_size * (12 + e), kv)
        if recipe.rl.async_:  # rl.async: the copy's KV cache is drawn while the step trains
            saved += kv
    return int(saved), int(loss_peak)


def rollout_kv_bytes(recipe: Recipe, inv: ModelInventory, mode: str) -> int:
    """The KV cache of a step's rollouts on one device, drawn in one call (training/rl/rollouts.py: a window's
    groups together): num_generations sequences of max_length + max_new_tokens per prompt of each micro-batch."""
    c = inv.config
    s = recipe.data.max_length + recipe.rl.max_new_tokens
    rows = recipe.rl.num_generations * recipe.train.batch_size * recipe.train.grad_accum
    return 2 * c.num_hidden_layers * kv_dim(c) * s * rows * (4 if mode == "fp32" else 2)


def head_size(c) -> int:
    """One attention head's width: head_dim (the widest layer's where they differ, as Gemma 4's), else
    hidden_size / heads."""
    return largest(c, "head_dim") or c.hidden_size // c.num_attention_heads


def kv_dim(c) -> int:
    """Key (or value) features per token of one layer: kv heads x head size."""
    return (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_size(c)


def mlp_width(c) -> int:
    """MLP width: Llama-style intermediate_size, GPT-2's n_inner (None there means 4 x hidden)."""
    return largest(c, "intermediate_size") or getattr(c, "n_inner", None) or 4 * c.hidden_size


def offloaded_bytes(
    recipe: Recipe, inv: ModelInventory, mode: str, checkpointing: bool, attn: str, tp: int = 1, cp: int = 1
) -> int:
    """Host memory one process's model.activation_offloading holds at the end of the forward: the saved
    tensors of every layer but the two in flight (with checkpointing, each layer's input)."""
    if not recipe.model.activation_offloading:
        return 0
    s, b = micro_batch(recipe)
    t = layer_terms(recipe, inv, mode, checkpointing, attn, tp, s, cp)
    layers = max(0, inv.config.num_hidden_layers - 2)
    return int(s * b / cp * layers * (t.inputs if checkpointing else t.kept))


def tower_activation_bytes(recipe: Recipe, inv: ModelInventory, mode: str, checkpointing: bool) -> int:
    """What a trained vision encoder keeps for backward in one micro-batch: one picture per example, each
    (image_size / patch_size)^2 patches through its layers, a layer costing what a decoder layer of its
    widths does (_LAYER). A frozen encoder keeps nothing (no gradient flows into it); pictures a processor
    cuts into tiles (Idefics3's image splitting) count once (an under-estimate there)."""
    v = inv.vision
    sizes = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "image_size",
        "patch_size",
    )
    if v is None or not inv.tower_trains or not all(isinstance(getattr(v, k, None), int) for k in sizes):
        return 0
    c_h, c_f, c_kv = _LAYER[mode]
    layer = (
        c_h * v.hidden_size + 8 + c_f * v.intermediate_size + c_kv * v.hidden_size + 4 * v.num_attention_heads
    )
    patches = recipe.train.batch_size * (v.image_size // v.patch_size) ** 2
    if checkpointing:  # each layer's input kept, one layer recomputed at a time
        r = 2 if mode == "half" else 4
        return int(patches * (v.num_hidden_layers * r * v.hidden_size + layer))
    return int(patches * v.num_hidden_layers * layer)


# ----------------------------------------------------------------------------- one plan per backend
