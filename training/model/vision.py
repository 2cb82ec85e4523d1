"""Image-text models composed LLaVA-style (model.vision): a SigLIP vision encoder built from the recipe's
sizes, transformers' two-layer projector, and the recipe's language model (new from model.from_scratch,
or a pretrained causal LM, whose weights are copied in: "bring your own language model").

The whole is transformers' LlavaForConditionalGeneration, so `final/` loads in plain transformers
(AutoModelForImageTextToText + AutoProcessor) and the LLaVA processor saved beside it expands the image
placeholder into as many tokens as training did.
"""

from __future__ import annotations

import logging

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipVisionConfig,
)
from transformers.initialization import no_init_weights

from training.config import Recipe, VisionSection
from training.core.dtypes import DTYPES
from training.core.errors import RecipeError
from training.run.sources import pretrained_source

log = logging.getLogger(__name__)


def encoder_config(v: VisionSection) -> SiglipVisionConfig:
    return SiglipVisionConfig(
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_hidden_layers,
        num_attention_heads=v.num_attention_heads,
        image_size=v.image_size,
        patch_size=v.patch_size,
        vision_use_head=False,  # SigLIP's pooling head: LLaVA takes the patches, never the pooled vector
    )


def image_text_config(v: VisionSection, text_config, tokenizer) -> LlavaConfig:
    """LLaVA's config: every patch of the last encoder layer is an image token (SigLIP has no CLS token)."""
    return LlavaConfig(
        vision_config=encoder_config(v),
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(v.image_token),
        image_seq_length=v.tokens_per_image,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=getattr(text_config, "tie_word_embeddings", False),
        pad_token_id=tokenizer.pad_token_id,
    )


def new_image_text_model(recipe: Recipe, tokenizer, text_config, attn: str):
    """The composed model, initialised; a pretrained language model's weights copied into its part."""
    v, dtype = recipe.model.vision, DTYPES[recipe.model.dtype]
    config = image_text_config(v, text_config, tokenizer)
    with no_init_weights():
        model = LlavaForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation=attn)
    model.init_weights()
    if recipe.model.from_scratch is None:
        copy_language_model(model, recipe)
    tower = model.model.vision_tower
    # LLaVA reads the encoder's last hidden states before SigLIP's final LayerNorm, which therefore gets no
    # gradient: frozen, so that DDP does not wait for it (it is saved as built, as transformers expects)
    tower.post_layernorm.requires_grad_(False)
    if v.tower == "frozen":
        tower.requires_grad_(False)
    # the blocks FSDP wraps one by one (accelerate's transformer-based policy): transformers lists every
    # class SigLIP may have (its text tower, pooling head); accelerate refuses a listed class it cannot find
    present = {type(m).__name__ for m in model.modules()}
    model._no_split_modules = {name for name in model._no_split_modules if name in present}
    return model


def pretrained_text_config(recipe: Recipe):
    cfg = recipe.model
    src = pretrained_source(cfg.name_or_path)
    try:
        config = AutoConfig.from_pretrained(
            src, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise RecipeError(f"model.name_or_path: cannot load {src!r} ({str(e).splitlines()[0]})") from None
    if hasattr(config, "vision_config"):
        raise RecipeError(
            f"model.name_or_path: {cfg.name_or_path} is already an image-text model ({config.model_type}); "
            f"model.vision composes a new one around a language model"
        )
    return config


def copy_language_model(model, recipe: Recipe) -> None:
    """The pretrained causal LM's weights into the composed model's language model and head."""
    cfg = recipe.model
    lm = AutoModelForCausalLM.from_pretrained(
        pretrained_source(cfg.name_or_path), dtype=DTYPES[cfg.dtype], revision=cfg.revision
    )
    with torch.no_grad():
        model.model.language_model.load_state_dict(lm.model.state_dict())
        model.lm_head.load_state_dict(lm.lm_head.state_dict())
    log.info("language model: %s's weights, with a new vision encoder and projector", cfg.name_or_path)


def processor_for(recipe: Recipe, tokenizer, image_processor) -> LlavaProcessor:
    """The processor saved with final/: the run's tokenizer (and chat template) and image processor, set to
    expand each placeholder into the number of tokens the model was trained with."""
    v = recipe.model.vision
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=v.patch_size,
        vision_feature_select_strategy="full",
        image_token=v.image_token,
        num_additional_image_tokens=0,
        chat_template=with_image_parts(tokenizer.chat_template, v.image_token),
    )


# Runs before the language model's own template: each message whose content is a list of parts (as
# transformers' processors take them) becomes {"role", "content": string}, the string being what training
# rendered (training.data.images.normalize): the image token for each image part, text parts as they are,
# joined with nothing. Messages with string contents pass unchanged.
IMAGE_PARTS = """{%- set image_parts = namespace(messages=[]) -%}
{%- for message in messages -%}
{%- if message['content'] is string -%}
{%- set image_parts.messages = image_parts.messages + [message] -%}
{%- else -%}
{%- set text = namespace(s='') -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}{%- set text.s = text.s + IMAGE_TOKEN -%}
{%- elif part['type'] == 'text' -%}{%- set text.s = text.s + part['text'] -%}{%- endif -%}
{%- endfor -%}
{%- set image_parts.messages = image_parts.messages + [{'role': message['role'], 'content': text.s}] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = image_parts.messages -%}
"""


def with_image_parts(template: str | None, image_token: str) -> str | None:
    """The processor's chat template: the language model's, taking image and text parts (IMAGE_PARTS)."""
    if template is None:
        return None
    return IMAGE_PARTS.replace("IMAGE_TOKEN", repr(image_token)) + template
