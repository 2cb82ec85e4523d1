"""The planner's activation memory: what one micro-batch's forward keeps for the backward and the loss's
transient peak, per token and decoder layer, calibrated on CPU against the tensors autograd really saves
(benchmarks/planner_accuracy.py); and what gradient checkpointing, the tiled MLP and activation offloading
(training.model.tiled_mlp, training.model.offload) change in it."""

from __future__ import annotations

from training.config import Recipe
from training.core.dtypes import DTYPES
from training.launch.backend import Backend
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
# rank unit, + dropout masks/outputs per adapted input feature when lora.dropout > 0.
_LORA_H = {"fp32": 24, "half": 40, "autocast": 24}
_LORA_RANK = {"fp32": 4, "half": 4, "autocast": 2}
_LORA_DROPOUT = {"fp32": 6, "half": 4, "autocast": 4}
# LoRA/QLoRA under gradient checkpointing: the one recomputed layer's backward holds, beyond what that layer
# saves, the gradients of its MLP intermediates, in bytes per intermediate feature and token. Measured on
# CPU (2026-11-27, SmolLM2-135M, 8 x 1024 tokens, the peak between two layers' backward hooks less the
# stored inputs): 8.7 under bf16 autocast, 6.5 in fp32; it also closes most of the 15% the one-layer QLoRA
# step at the 8B shape was under (docs/benchmarks.md). Full fine-tuning's is under 5 and its peak lies in
# the forward (autocast's cached weight copies) or the optimizer step, so it is not added there.
_LORA_CKPT_WORK = {"fp32": 7, "half": 9, "autocast": 9}
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
    if recipe.method.type == "qlora" and recipe.method.quantization.compute_dtype != "float32":
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
        # RL's token log-probabilities come from the whole logits (objectives/grpo.py)
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
        and q.compute_dtype != "float32"
    )


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

    chunked_loss: the loss never holds the logits (training.objectives.next_token); no fp32 log-softmax is kept, and its
    transient peak, at the end of the forward, comes before the one layer that gradient checkpointing
    recomputes in backward (the two never coexist: only the larger counts)."""
    c = inv.config
    h, L, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    # MLP width: Llama-style intermediate_size, GPT-2's n_inner (None there means 4 x hidden)
    f = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * h
    head_dim = getattr(c, "head_dim", None) or h // heads
    kv = (getattr(c, "num_key_value_heads", None) or heads) * head_dim
    s, b = recipe.data.max_length, recipe.train.batch_size
    if recipe.preference is not None and recipe.preference.objective != "kto":
        b *= 2  # chosen and rejected sequences go through the policy in one batch
    rollout_cache = 0
    # RL: each prompt (up to max_length) + num_generations completions of max_new_tokens
    if recipe.rl is not None:
        s, g = s + recipe.rl.max_new_tokens, recipe.rl.num_generations
        b *= g
        # the KV cache of one group's generation (keys and values of every layer, no grad), before the forward
        rollout_cache = 2 * L * kv * s * g * (4 if mode == "fp32" else 2)
    tokens = s * b
    e = 4 if mode == "fp32" else 2
    r = 2 if mode == "half" else 4
    lora = recipe.method.type in ("lora", "qlora")
    c_h, c_f, c_kv = _LAYER[mode]
    if lora:
        c_h = _LORA_H[mode]
    if attn == "eager":  # scores + fp32 softmax kept; grouped k/v expanded to all heads
        kv = heads * head_dim
    split = c_f * f + c_kv * kv + (heads * s * (4 + (e if e == 2 else 0)) if attn == "eager" else 4 * heads)
    layer = c_h * h + 8 + split / tp
    if lora:
        layer += _LORA_RANK[mode] * inv.lora_ranks + (
            _LORA_DROPOUT[mode] * inv.lora_inputs if recipe.method.lora.dropout else 0
        )
    # what the recomputed layer's backward holds beyond its saved tensors (per token), and QLoRA's
    # dequantised copy of its largest 4-bit weight (intermediate x hidden) for each backward matmul (bytes)
    work = _LORA_CKPT_WORK[mode] * f / tp if lora and checkpointing else 0
    dequant = 0
    if recipe.method.type == "qlora":
        dequant = f * h * DTYPES[recipe.method.quantization.compute_dtype].itemsize / tp
    rest_h, rest_v = _REST[("lora" if lora else "full", mode)]
    rest = rest_h * h + (0 if chunked_loss else rest_v * c.vocab_size * (s - 1) / s)
    tokens /= cp
    if chunked_loss:
        kept, transient = chunked_loss_bytes(recipe, inv, mode, tokens)
        if checkpointing:
            saved = tokens * (L * r * h + rest) + kept + max(tokens * (layer + work) + dequant, transient)
            return int(saved), 0
        return int(tokens * (L * layer + rest) + kept + dequant), transient
    if checkpointing:  # each layer keeps its input; one layer is recomputed at a time in backward
        saved = tokens * (L * r * h + layer + work + rest) + dequant
    else:
        saved = tokens * (L * layer + rest) + dequant
    if recipe.rl is not None and recipe.rl.num_iterations > 1:
        saved += 4 * tokens * recipe.train.grad_accum  # the window's kept sampling log-probabilities (fp32)
    saved += tower_activation_bytes(recipe, inv, mode, checkpointing)
    loss_peak = (
        tokens * c.vocab_size * (8 + e)
    )  # gradient of the fp32 log-softmax + its cast, at the start of backward (logits gathered under TP)
    if recipe.rl is not None:  # + the entropy's exp of the log-softmax; the rollouts' KV cache comes before
        loss_peak = max(tokens * c.vocab_size * (12 + e), rollout_cache)
    return int(saved), int(loss_peak)


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
