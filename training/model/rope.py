"""model.rope_scaling: a pretrained model's rotary position embeddings stretched to train at longer sequences,
written into its config (transformers' `rope_parameters`, which its rotary embedding reads) so that final/ and
every export carry it; and the start-up warning when data.max_length passes the model's context length."""

from __future__ import annotations

import logging

from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

from training.config import Recipe, RopeScaling
from training.core.errors import RecipeError
from training.run.rundir import BASE_CONFIG

log = logging.getLogger(__name__)


def rope_refusal(config) -> str | None:
    """Why this config's positions cannot be scaled from the recipe, or None."""
    text = config.get_text_config()
    params = getattr(text, "rope_parameters", None)
    if not isinstance(text, RotaryEmbeddingConfigMixin) or not params:
        return f"{text.model_type} has no rotary position embeddings to scale"
    if text.nested_rope_parameter_keys(params):
        return (
            f"{text.model_type} sets RoPE per layer type ({', '.join(params)}); set the scaling of each in "
            "the model's config.json (rope_parameters) instead"
        )
    if (kind := params.get("rope_type", "default")) != "default":
        return f"{text.model_type}'s RoPE is already scaled ({kind}, factor {params.get('factor')})"
    if getattr(text, "max_position_embeddings", None) is None:
        return f"{text.model_type}'s config has no max_position_embeddings to scale from"
    return None


def scale_rope(config, scaling: RopeScaling) -> None:
    """Set `scaling` in config's text config, in place; RecipeError naming model.rope_scaling when refused."""
    if why := rope_refusal(config):
        raise RecipeError(f"model.rope_scaling: {why}")
    text = config.get_text_config()
    original = scaling.original_max_position_embeddings or text.max_position_embeddings
    params = dict(text.rope_parameters, rope_type=scaling.type, factor=scaling.factor)
    if scaling.type == "yarn":
        params["original_max_position_embeddings"] = original
    text.rope_parameters = params
    if (
        scaling.type != "dynamic"
    ):  # dynamic reads max_position_embeddings as the length it starts stretching at
        text.max_position_embeddings = int(original * scaling.factor)
    text.validate_rope()
    log.info(
        "RoPE scaling: %s x%g, from %d to %d positions",
        scaling.type,
        scaling.factor,
        original,
        int(original * scaling.factor),
    )


def warn_past_context(config, max_length: int, scaling: RopeScaling | None) -> None:
    """Say so when the examples may be longer than the model's positions reach."""
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    if limit is None or max_length <= limit:
        return
    if scaling is not None and scaling.type == "dynamic":
        return
    log.warning(
        "data.max_length=%d is past %s's context length (max_position_embeddings=%d): positions beyond it "
        "were never trained; consider model.rope_scaling (linear, dynamic or yarn)%s",
        max_length,
        text.model_type,
        limit,
        "" if rope_refusal(config) is None else " where the model takes it",
    )


def keep_scaled_base_config(model, recipe: Recipe, out) -> None:
    """Beside an adapter trained with model.rope_scaling: its base's scaled config (BASE_CONFIG), which the
    base named in adapter_config.json lacks; chat and export load the base with it."""
    if recipe.model.rope_scaling is not None and hasattr(model, "get_base_model"):
        model.get_base_model().config.to_json_file(f"{out}/{BASE_CONFIG}")
