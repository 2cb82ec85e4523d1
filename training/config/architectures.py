"""transformers' model types as the recipe sees them: which config class a model type has and what it takes
(model.from_scratch), and the shape of a Mixture-of-Experts router. Introspection only: nothing is built."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass

# The common size keys of model.from_scratch. Each transformers config class may call them otherwise
# (GPT-2: n_embd, n_layer, n_head, n_positions): its own `attribute_map` translates, and _ALIASES
# covers the names that map lacks (GPT-2's MLP width n_inner).
ARCH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
    "vocab_size",
)


_ALIASES = {"intermediate_size": ("n_inner",)}


# Mixture-of-Experts keys of model.from_scratch (set only for MoE types), under each class's own names
# (Mixtral: num_local_experts; its experts are intermediate_size wide, Qwen3-MoE's moe_intermediate_size).
MOE_KEYS = {
    "num_experts": ("num_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "expert_intermediate_size": ("moe_intermediate_size",),
}


MOE_EXAMPLES = "mixtral, qwen3_moe, olmoe"


# Config settings llm-forge decides itself, refused in model.from_scratch.extra.
_MANAGED = {
    "bos_token_id": "taken from the tokenizer",
    "eos_token_id": "taken from the tokenizer",
    "pad_token_id": "taken from the tokenizer",
    "use_cache": "training runs without a KV cache",
    "model_type": "set model.from_scratch.type",
}


# Shown when a type is refused (all of them are causal-LM decoders in transformers 5).
ARCH_EXAMPLES = ("llama", "mistral", "qwen3", "gpt2", "gemma", "phi3", "qwen3_moe", "mixtral")


# Types transformers lists as causal LMs that are not language models to train on their own (the reason).
_DRAFTER = (
    "a drafter for assisted generation: it reads the key/value states of its target model and does not run "
    "on its own; train the target model"
)
_AUDIO = "a text-to-audio model: its causal LM predicts audio codebooks from its decoder's config, not text"
# Image-text types whose pictures do not enter the text as tokens their processor expands from an image
# token, which is how the trainer places a record's pictures (training.data.images.ImageExpander)
_INSTEAD = (
    "; train an image-text model whose processor expands an image token in the text (LLaVA, Qwen2.5-VL, "
    "SmolVLM, PaliGemma, BLIP-2)"
)
_ENCODER_DECODER = (
    "the picture is its encoder's input and the text its decoder's, with no image token" + _INSTEAD
)
UNTRAINABLE = {
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "musicgen": _AUDIO,
    "musicgen_melody": _AUDIO,
}
# Image-text types the trainer cannot train as image-text models (their text classes, where transformers has
# one, train as any causal LM)
IMAGE_TEXT_UNTRAINABLE = {
    "blip": "a captioning model: its text decoder reads the picture through cross-attention" + _INSTEAD,
    "git": "a captioning model: it puts the picture's embeddings before the text itself" + _INSTEAD,
    "idefics": "an image-text model whose language model reads the pictures through gated cross-attention "
    "(image_attention_mask), not as image tokens in the text" + _INSTEAD,
    "instructblip": "BLIP-2 with an instruction-aware Q-Former: it reads each example's instruction again "
    "(qformer_input_ids, from its processor's Q-Former tokenizer), which the trainer does not give; train a "
    "BLIP-2 checkpoint (blip-2), whose Q-Former reads the picture alone",
    "pix2struct": "an encoder-decoder (screenshots and documents): " + _ENCODER_DECODER,
    "pp_formulanet": "an encoder-decoder formula recogniser: " + _ENCODER_DECODER,
    "florence2": "an encoder-decoder (a DaViT encoder and BART): its processor puts the picture's tokens before "
    "the encoder's text itself, and the answer is its decoder's" + _INSTEAD,
    "udop": "an encoder-decoder document model: the picture and the words with their boxes are its encoder's "
    "input and the text its decoder's, with no image token" + _INSTEAD,
    "pp_chart2table": "a GOT-OCR2 model whose processor expands no image token: its chat template writes each "
    "picture's image_seq_length tokens itself" + _INSTEAD,
    "vision-encoder-decoder": "a generic encoder-decoder (a vision encoder and a text decoder, as TrOCR and Donut): "
    + _ENCODER_DECODER,
    "t5gemma2": "an encoder-decoder (T5Gemma 2): the picture and the prompt are its encoder's input and the answer "
    "its decoder's" + _INSTEAD,
    "mistral4": "Mistral 4's language model, which transformers lists among image-text models but which has no "
    "vision part and no processor: there are no pictures to train it on" + _INSTEAD,
    "pi0": "a robot policy (vision-language-action): a flow-matching action expert reads its PaliGemma's states "
    "and predicts actions, not text" + _INSTEAD,
    "diffusion_gemma": "a block-diffusion language model: it learns to denoise masked blocks of tokens, not the "
    "next-token loss the trainer computes" + _INSTEAD,
    "evolla": "a protein-text model: its inputs are protein sequences and structures (a SaProt encoder), not "
    "pictures" + _INSTEAD,
    "instructblipvideo": "InstructBLIP for videos: its Q-Former reads each example's instruction again "
    "(qformer_input_ids, from its processor's Q-Former tokenizer), which the trainer does not give, and its "
    "processor takes videos, not pictures; train a BLIP-2 checkpoint (blip-2), whose Q-Former reads the picture "
    "alone",
    "kosmos-2": "a grounding model whose processor writes each picture's 64 tokens between <image> and </image> "
    "before the text itself, names no image token to place a record's picture, and marks the picture's tokens with "
    "image_embeds_position_mask, an input the trainer's batches do not carry" + _INSTEAD,
    "kosmos-2.5": "a document-reading model whose processor writes the picture's tokens before the text itself "
    "(its chat template writes no image placeholder) and marks them with image_embeds_position_mask, an input the "
    "trainer's batches do not carry" + _INSTEAD,
    "fuyu": "an image-text model with no vision encoder (its config names none): its model reads each picture as "
    "the flat patches its processor cuts (pixel_values of [pictures, patches, patch pixels]), which the trainer's "
    "batches of pictures, made by the image processor alone, do not carry" + _INSTEAD,
}


# The config keys of an image-text model's vision part: an encoder, or a VQ image tokenizer whose codes are tokens
# of the text (Chameleon, Emu3)
VISION_PARTS = ("vision_config", "vq_config")


def has_vision_part(config) -> bool:
    """Whether a transformers config (or its config.json as a dict) is an image-text model's: it has a vision part."""
    return any((k in config) if isinstance(config, dict) else hasattr(config, k) for k in VISION_PARTS)


def type_refusal(model_type: str | None, image_text: bool = True) -> str | None:
    """Why a model of this type cannot be trained here (None: it can be tried); `image_text`: as an image-text
    model (its pictures too), else as a causal LM on text, which the image-text refusals do not concern."""
    why = UNTRAINABLE.get(model_type or "")
    if image_text and not why:
        why = IMAGE_TEXT_UNTRAINABLE.get(model_type or "") or upstream_bug(model_type or "")
    return f"{model_type!r} is {why}" if why else None


# transformers bugs that stop a type from training as an image-text model: (the type, where in transformers (a
# dotted path), a line of that object's source that is the bug, why); found in the installed source, so a
# release that fixes it is tried again
UPSTREAM_BUGS = (
    (
        "llama4",
        "Llama4ForConditionalGeneration.forward",
        "image_outputs=outputs.image_outputs",
        "not trainable with the installed transformers: Llama4ForConditionalGeneration.forward reads "
        "image_outputs from its language model's output, which has none (AttributeError on every forward); "
        "a transformers release that fixes it will be tried",
    ),
    (
        "shieldgemma2",
        "conversion_mapping._build_checkpoint_conversion_mapping",
        '"shieldgemma2": [PrefixChange(prefix_to_add="model", model_prefix="model")]',
        "not trainable with the installed transformers: its checkpoint key conversion, written for the "
        "ShieldGemma2ForImageClassification wrapper, also prefixes every weight with 'model.' for the "
        "Gemma3ForConditionalGeneration that AutoModelForImageTextToText builds for the type, so the language "
        "model loads as random weights (and a saved model does not load back); fine-tune the Gemma 3 checkpoint "
        "it is built on (model_type gemma3, e.g. google/gemma-3-4b-it); a transformers release that fixes it "
        "will be tried",
    ),
)


def upstream_bug(model_type: str) -> str | None:
    for kind, where, line, why in UPSTREAM_BUGS:
        if kind == model_type and line in transformers_source(where):
            return why
    return None


def transformers_source(where: str) -> str:
    """The source of transformers' object at the dotted path `where` (a top-level name or a submodule first),
    '' where this transformers has none."""
    import importlib
    import inspect

    import transformers

    head, *rest = where.split(".")
    try:
        obj = getattr(transformers, head, None) or importlib.import_module(f"transformers.{head}")
        for name in rest:
            obj = getattr(obj, name)
        return inspect.getsource(obj)
    except (ImportError, AttributeError, OSError, TypeError):
        return ""


@dataclass(frozen=True)
class ConfigClass:
    """The transformers config class of a model type and the settings (constructor fields) it takes."""

    type: str
    cls: type
    settings: frozenset[str]

    def own_name(self, key: str) -> str | None:
        """This class's name for one of ARCH_KEYS, or None when it has no such setting."""
        if key == "rope_theta":  # transformers 5 keeps rope_theta inside rope_parameters
            return next((n for n in ("rope_theta", "rope_parameters") if n in self.settings), None)
        names = (key, self.cls.attribute_map.get(key, key), *_ALIASES.get(key, ()))
        return next((n for n in names if n in self.settings), None)

    def moe_name(self, key: str) -> str | None:
        """This class's name for one of MOE_KEYS, or None (a dense type, or Mixtral's expert width)."""
        return next((n for n in MOE_KEYS[key] if n in self.settings), None)

    def extra_problem(self, key: str) -> str | None:
        """Why `key` cannot be given in model.from_scratch.extra (None: it can)."""
        if key in _MANAGED:
            return _MANAGED[key]
        for common in ARCH_KEYS:
            if key == common or (key == self.own_name(common) and key != "rope_parameters"):
                return f"set it as model.from_scratch.{common}"
        for common in MOE_KEYS:
            if key == common or key == self.moe_name(common):
                return f"set it as model.from_scratch.{common}"
        if key in _generic_settings():
            return "a generic transformers setting that llm-forge decides itself"
        if key not in self.settings and self.cls.attribute_map.get(key) not in self.settings:
            close = difflib.get_close_matches(key, sorted(self.settings), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            return f"not a setting of transformers' {self.cls.__name__} ({self.type}){hint}"
        return None


@functools.cache
def _generic_settings() -> frozenset[str]:
    from transformers import PreTrainedConfig  # lazy: see config_class

    return frozenset(f.name for f in dataclasses.fields(PreTrainedConfig))


@functools.cache
def config_class(model_type: str) -> ConfigClass:
    """The config class of a transformers causal-LM (decoder) model type; ValueError naming valid types."""
    # imported here, not at the top: transformers imports torch (seconds), and the app, the planner's
    # CLI and every recipe check import this module; only a non-default architecture needs it
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED,
    )

    examples = ", ".join(ARCH_EXAMPLES)
    if model_type not in CAUSAL:
        close = difflib.get_close_matches(model_type, list(CAUSAL), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        what = "not a causal-LM model type" if model_type in CONFIG_MAPPING else "unknown model type"
        raise ValueError(
            f"{model_type!r} is {what} in transformers{hint}; use one of its {len(CAUSAL)} causal-LM "
            f"types, e.g. {examples}"
        )
    if why := type_refusal(model_type, image_text=False):
        raise ValueError(why)
    cls = CONFIG_MAPPING[model_type]
    try:
        defaults = cls()
    except Exception as e:  # noqa: BLE001 (any error of a third-party constructor)
        raise ValueError(f"{model_type!r}: transformers cannot build its default config ({e})") from None
    if defaults.is_encoder_decoder:
        raise ValueError(f"{model_type!r} is an encoder-decoder model type; use a decoder, e.g. {examples}")
    if model_type in MASKED:  # bert, roberta, ...: a causal-LM head exists, but the model is an encoder
        raise ValueError(
            f"{model_type!r} is an encoder (masked-LM) model type; use a decoder, e.g. {examples}"
        )
    if dataclasses.is_dataclass(cls):
        settings = {f.name for f in dataclasses.fields(cls)}
    else:
        settings = set(defaults.to_dict())
    c = ConfigClass(model_type, cls, frozenset(settings))
    if c.own_name("hidden_size") is None:  # gemma3, llama4, ...: a text config inside a multimodal one
        text = f"{model_type}_text"
        hint = f"; its language model alone is {text!r}" if text in CAUSAL else ""
        raise ValueError(f"{model_type!r} is a composite (multimodal) model type{hint}; use a decoder")
    return c


def router_shape(config) -> tuple[int, int] | None:
    """(experts per MoE layer, experts per token) of a Mixture-of-Experts config; None for a dense one."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if isinstance(experts, int) and isinstance(top_k, int) and experts > 1:
        return experts, top_k
    return None
