"""Checks of a model's config against the launched layout, before any weight loads (tensor-parallel
plans and divisible heads, sequence splits, experts, pipeline stages), and the pipeline layout's formulas."""

from __future__ import annotations

import math

from training.config.architectures import router_shape
from training.core.errors import RecipeError
from training.launch.backend import EP_KEY, Backend
from training.launch.refusals import WHERE


def check_tensor_parallel(config, backend: Backend) -> None:
    """Refuse tensor parallelism the model cannot have, before any weight loads (RecipeError, exit 2):
    a model type without a tensor-parallel plan in transformers (`config.base_model_tp_plan` empty, as
    for GPT-2), or a tp_size that does not divide the attention heads or the key/value heads (each rank
    holds whole heads). Nothing to check without tensor parallelism."""
    tp = backend.tp_size
    if tp <= 1:
        return

    model_type = getattr(config, "model_type", type(config).__name__)
    if not getattr(config, "base_model_tp_plan", None):
        raise RecipeError(
            f"parallelism_config_tp_size={tp} ({WHERE}): the model type {model_type!r} has no tensor-parallel "
            f"plan in transformers, so it cannot be split across processes. Choose a model (model.name_or_path) "
            f"or a model.from_scratch type whose transformers config has a plan (llama, qwen2, qwen3, mistral, "
            f"mixtral, gemma, phi3, ...), or a config without tensor parallelism (fsdp.yaml, ddp.yaml)"
        )
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for key, count, what in (
        ("num_attention_heads", heads, "attention heads"),
        ("num_key_value_heads", kv, "key/value heads"),
    ):
        if count and count % tp:
            both = math.gcd(heads, kv)
            divisors = [d for d in range(2, both + 1) if both % d == 0]
            raise RecipeError(
                f"parallelism_config_tp_size={tp} ({WHERE}) does not divide the model's {count} {what} "
                f"({key}; each process holds whole heads): use a tp_size among {divisors or [1]}, or, for a model "
                f"built from scratch, change model.from_scratch.{key}"
            )


def check_sequence_parallel(config, backend: Backend) -> None:
    """DeepSpeed Ulysses trades the sequence split for a head split inside attention (all-to-all): each of
    the sp_size processes then holds num_attention_heads / sp_size heads of the whole sequence, so sp_size
    must divide the attention heads, and divide or be a multiple of the key/value heads (DeepSpeed repeats
    grouped key/value heads when there are fewer than processes). RecipeError (exit 2) before any weight
    loads; nothing to check otherwise (context parallelism splits no heads)."""
    sp = backend.sp_size
    if sp <= 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not heads:
        return
    divisors = [d for d in range(2, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    fix = (
        f"use a parallelism_config_sp_size among {divisors or [1]} (with --num_processes a multiple of it), or, "
        f"for a model built from scratch, change model.from_scratch.num_attention_heads / num_key_value_heads"
    )
    if heads % sp:
        raise RecipeError(
            f"parallelism_config_sp_size={sp} ({WHERE}) does not divide the model's {heads} attention heads "
            f"(num_attention_heads; DeepSpeed Ulysses gives each process whole heads of the full sequence): {fix}"
        )
    if kv % sp and sp % kv:
        raise RecipeError(
            f"parallelism_config_sp_size={sp} ({WHERE}) neither divides nor is a multiple of the model's {kv} "
            f"key/value heads (num_key_value_heads): {fix}"
        )


def check_expert_parallel(config, backend: Backend) -> None:
    """Refuse expert parallelism the model cannot have, before any weight loads (RecipeError, exit 2): a
    dense model, an MoE type without an expert-parallel plan in transformers, experts not divisible."""
    ep = backend.ep_size
    if ep <= 1:
        return

    model_type = getattr(config, "model_type", type(config).__name__)
    shape = router_shape(config)
    if shape is None:
        raise RecipeError(
            f"{EP_KEY}={ep} ({WHERE}): the model ({model_type!r}) is dense, it has no experts to shard; "
            f"use a Mixture-of-Experts model (mixtral, qwen3_moe, olmoe, ...) or ddp.yaml"
        )
    if not getattr(config, "base_model_ep_plan", None):
        raise RecipeError(
            f"{EP_KEY}={ep} ({WHERE}): the MoE type {model_type!r} has no expert-parallel plan in transformers; "
            f"use mixtral, qwen3_moe, olmoe, ... or ddp.yaml"
        )
    if shape[0] % ep:
        raise RecipeError(
            f"{EP_KEY}={ep} ({WHERE}) does not divide the model's {shape[0]} experts (each rank holds whole "
            f"experts): use an ep_size among {[d for d in range(2, shape[0] + 1) if shape[0] % d == 0]}"
        )


def check_pipeline(config, backend: Backend) -> None:
    """Refuse pipeline stages the model cannot be split into, before any weight loads (RecipeError, exit 2):
    more stages than decoder layers."""
    pp = backend.pp_size
    if pp <= 1:
        return
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and pp > layers:
        raise RecipeError(
            f"parallelism_config_pp_size={pp} ({WHERE}) asks for more pipeline stages than the model's {layers} "
            f"decoder layers (num_hidden_layers); use at most {layers} stages, or for a model built from scratch "
            f"raise model.from_scratch.num_hidden_layers"
        )


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe / 1F1B step: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers of `stage`: contiguous, the first stages take one more when L % p != 0."""
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))
