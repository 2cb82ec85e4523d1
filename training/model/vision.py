"""Image-text models: a pretrained image-text checkpoint (LLaVA, Idefics3/SmolVLM, ... through transformers'
AutoModelForImageTextToText and its own AutoProcessor), or one composed LLaVA-style (model.vision): a SigLIP
vision encoder built from the recipe's sizes, transformers' two-layer projector, and the recipe's language
model (new from model.from_scratch, or a pretrained causal LM, whose weights are copied in: "bring your
own language model").

A composed model is transformers' LlavaForConditionalGeneration, so `final/` loads in plain transformers
(AutoModelForImageTextToText + AutoProcessor) and the LLaVA processor saved beside it expands the image
placeholder into as many tokens as training did. A pretrained checkpoint's `final/` carries its own
processor (with the run's tokenizer); with LoRA/QLoRA it is an adapter on the checkpoint, the adapters on
the language model's linear layers, the parts that train whole (projector, a trained tower) saved with it.
"""

from __future__ import annotations

import copy
import logging

import torch
import transformers  # LLaVA's model and processor classes as transformers.X where they are used (processors.py)
from accelerate import init_empty_weights
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    LlavaConfig,
    SiglipVisionConfig,
)
from transformers.initialization import no_init_weights

from training.config import ImageTokens, Recipe, VisionSection, with_facts
from training.config.architectures import has_vision_part, type_refusal
from training.core.dtypes import DTYPES
from training.core.errors import RecipeError
from training.model import lora_targets
from training.model.adapter_reload import unreloadable_modules
from training.model.adapters import loading_kwargs
from training.run.processors import image_text_processor, image_token
from training.run.sources import load_refusal, pretrained_source

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
        model = transformers.LlavaForConditionalGeneration._from_config(
            config, dtype=dtype, attn_implementation=attn
        )
    model.init_weights()
    if recipe.model.from_scratch is None:
        copy_language_model(model, recipe)
    freeze_untrained_parts(model, recipe)
    # the blocks FSDP wraps one by one (accelerate's transformer-based policy): transformers lists every
    # class SigLIP may have (its text tower, pooling head); accelerate refuses a listed class it cannot find
    present = {type(m).__name__ for m in model.modules()}
    model._no_split_modules = {name for name in model._no_split_modules if name in present}
    return model


def checkpoint_config(recipe: Recipe):
    """model.name_or_path's transformers config (its config.json; no weights), refused where its type is not a
    language model to train (training.config.architectures.type_refusal)."""
    cfg = recipe.model
    src = pretrained_source(cfg.name_or_path)
    try:
        config = AutoConfig.from_pretrained(
            src, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise load_refusal(src, None, e) from None
    if why := type_refusal(config.model_type):
        raise RecipeError(f"model.name_or_path: {cfg.name_or_path}: {why}")
    return config


# ----------------------------------------------------------------------------- pretrained checkpoints


def resolve_image_text(recipe: Recipe) -> Recipe:
    """The recipe, told what model.name_or_path is: for a pretrained image-text checkpoint (its config has a
    vision part), its processor's image tokens, which make the run an image-text one (its data, model and
    final/) and apply the image-text rules; otherwise a model.vision over it composes a new model. Reads the
    checkpoint's config and processor, never its weights."""
    cfg = recipe.model
    if cfg.from_scratch is not None or cfg.name_or_path is None or recipe._checkpoint_read:
        return recipe
    tokens = None
    if not cfg.converted_text_model and has_vision_part(checkpoint_config(recipe)):
        tokens = checkpoint_image_tokens(recipe)
    why = f"model.name_or_path {cfg.name_or_path} is an image-text model" if tokens else "model.name_or_path"
    return with_facts(recipe, why, _checkpoint_read=True, _image_text_checkpoint=tokens)


def checkpoint_image_tokens(recipe: Recipe) -> ImageTokens:
    cfg = recipe.model
    src = pretrained_source(cfg.name_or_path)
    processor = image_text_processor(src, cfg.revision, cfg.trust_remote_code)
    return ImageTokens(
        token=(cfg.vision or VisionSection()).image_token,
        processor=src,
        revision=cfg.revision,
        trust_remote_code=cfg.trust_remote_code,
        rendered=rendered_image(processor),
        model_token=expanded_token(processor),
    )


def expanded_token(processor) -> str:
    """The token of a picture's text that the processor expands: its image token, or the placeholder it reads in
    its place (Qianfan-OCR's <image>, which becomes <img>, its image tokens, </img>)."""
    placeholder = getattr(processor, "image_placeholder_token", None)
    return placeholder if isinstance(placeholder, str) else image_token(processor)


def rendered_image(processor) -> str:
    """What the checkpoint's chat template writes for one image part: the difference between a user message
    of an image and a text part and the same message without the image ("" when the processor has no
    template, or what it writes does not hold the processor's image token)."""
    if not getattr(processor, "chat_template", None):
        return ""
    # a marker with no bracket: Pixtral's [IMG] would share its first character, and the diff would eat it
    text = [{"type": "text", "text": "@@TEXT@@"}]

    def render(parts):
        return processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)

    try:
        with_image, without = render([{"type": "image"}, *text]), render(text)
    except Exception:  # noqa: BLE001 - any template error: the image token alone stands for the image
        return ""
    start = 0
    while start < min(len(with_image), len(without)) and with_image[start] == without[start]:
        start += 1
    end = 0
    while end < min(len(with_image), len(without)) - start and with_image[-1 - end] == without[-1 - end]:
        end += 1
    middle = with_image[start : len(with_image) - end]
    return middle.strip() if expanded_token(processor) in middle else ""


def image_text_parts(model) -> dict[str, list[str]]:
    """The module names of a pretrained image-text model's parts: its vision tower (transformers'
    get_encoder("image"); none where the pictures' patches go straight into the language model through an
    embedder, as Gemma 4 Unified's), its language model (get_decoder()), and its projector: the base model's other
    children (LLaVA's multi_modal_projector, Idefics3's connector, Gemma 4 Unified's embed_vision; none for
    Qwen2-VL, whose merger is inside its tower; a container's modules one by one: wholes), or the model's own where
    it has no base model inside (Llama 4). A VQ image tokenizer is the tower where transformers names none (Emu3's,
    Chameleon's vqmodel: its codes are tokens of the text, so there is no projector; Chameleon's language model is
    its base model, the tokenizer inside it).
    Of a model wrapped by peft, the parts of the model inside, named as in the wrapper."""
    names = {id(m): n for n, m in model.named_modules()}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    tower, decoder = inner.get_encoder("image"), inner.get_decoder()
    if decoder is None or decoder is inner:
        raise RecipeError(
            f"model.name_or_path: {type(model).__name__}'s vision tower and language model cannot be told apart "
            "(transformers' get_encoder('image') / get_decoder() find neither); such models are not supported"
        )
    towers = [] if tower is None or tower is inner else [tower]
    towers = towers or vq_tokenizers(inner)
    head = inner.get_output_embeddings()
    whole = {id(m) for m in (*towers, decoder, head)}
    children = [] if decoder is inner.base_model else inner.base_model.named_children()
    projector = [names[id(m)] for _, c in children if id(c) not in whole for m in wholes(c)]
    return {
        "tower": [names[id(t)] for t in towers],
        "projector": projector,
        "language model": [names[id(decoder)]],
    }


def vq_tokenizers(model) -> list[torch.nn.Module]:
    """The model's VQ image tokenizer (the module built from its config's vq_config), else none."""
    vq = getattr(model.config, "vq_config", None)
    kind = getattr(vq, "model_type", None)
    if kind is None:
        return []
    found = [
        m
        for m in model.modules()
        if m is not model and getattr(getattr(m, "config", None), "model_type", 0) == kind
    ]
    return found[:1]


def wholes(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module, or of a container (ModuleList, ModuleDict: Granite 4 Vision's layerwise_projectors) the
    modules in it: peft's modules_to_save wraps a module with a forward, never a container."""
    if isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict):
        return [m for c in module.children() for m in wholes(c)]
    return [module]


def trained_whole(recipe: Recipe, parts: dict[str, list[str]]) -> list[str]:
    """The parts besides the language model that train whole: the projector unless frozen, the tower as
    model.vision.tower says (by default: trained when composed, as it is new; frozen for a checkpoint)."""
    v = recipe.model.vision or VisionSection()
    tower = v.tower or ("trained" if recipe.composes_image_text else "frozen")
    return (parts["projector"] if v.projector == "trained" else []) + (
        parts["tower"] if tower == "trained" else []
    )


def freeze_untrained_parts(model, recipe: Recipe) -> tuple[dict[str, list[str]], list[str]]:
    """Full training: the tower and the projector frozen unless they train whole (LoRA freezes everything
    but its adapters and modules_to_save itself), and of a trained tower what the model never reads
    (unread_tower_modules); nothing is unfrozen. Returns (parts, trained whole)."""
    parts = image_text_parts(model)
    whole = trained_whole(recipe, parts)
    if recipe.method.type == "full":
        for name in parts["tower"] + parts["projector"]:
            if name not in whole:
                model.get_submodule(name).requires_grad_(False)
        for module in unread_tower_modules(model):
            module.requires_grad_(False)
    return parts, whole


def unread_tower_modules(model) -> list[torch.nn.Module]:
    """The vision encoder's modules whose output a LLaVA-family model never reads, so they get no gradient
    (which DDP refuses to wait for): it takes the hidden states of encoder layer `vision_feature_layer`
    (-2 in LLaVA-1.5: the last layer is unread), before the encoder's final LayerNorm. They stay as loaded
    (or built) and are saved so, as transformers expects."""
    feature = getattr(model.config, "vision_feature_layer", None)
    if feature is None:
        return []
    tower = model.get_encoder("image")
    encoder = getattr(tower, "vision_model", tower)
    layers = getattr(getattr(encoder, "encoder", None), "layers", None)
    if layers is None:
        return []
    n = len(layers)  # hidden_states[k] is the output of the first k layers (0: the embeddings)
    read = max(k % (n + 1) for k in (feature if isinstance(feature, list) else [feature]))
    unread = list(layers[read:])
    post = getattr(encoder, "post_layernorm", None)
    return unread + ([post] if post is not None else [])


def pretrained_image_text_model(recipe: Recipe, device: torch.device, attn: str):
    """The pretrained image-text checkpoint (AutoModelForImageTextToText), QLoRA's language model quantised
    and nothing else; for full training, its frozen parts frozen (LoRA freezes them with the rest)."""
    cfg = recipe.model
    src = pretrained_source(cfg.name_or_path)
    kwargs = loading_kwargs(recipe, device)
    if "quantization_config" in kwargs:  # only the language model is quantised: the rest stays as it is
        with init_empty_weights():
            shape = AutoModelForImageTextToText.from_config(checkpoint_config(recipe))
        kept = unquantized_parts(image_text_parts(shape))
        kwargs["quantization_config"].llm_int8_skip_modules = [*kept, "lm_head"]
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            src,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=attn,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            **kwargs,
        )
    except (OSError, ValueError) as e:  # a missing file, or an attention its class does not have
        raise load_refusal(src, attn, e) from None
    parts, whole = freeze_untrained_parts(model, recipe)
    log.info(
        "image-text model %s (%s): language model %s; trained whole: %s; frozen: %s",
        cfg.name_or_path,
        type(model).__name__,
        "with adapters" if recipe.method.type in ("lora", "qlora") else "trained",
        ", ".join(whole) or "nothing else",
        ", ".join(n for n in parts["tower"] + parts["projector"] if n not in whole) or "nothing",
    )
    return model


def unquantized_parts(parts: dict[str, list[str]]) -> list[str]:
    """What QLoRA leaves unquantised of an image-text model besides the output head: the tower and the
    projector (only the language model is quantised)."""
    return parts["tower"] + parts["projector"]


def image_text_lora_targets(model, recipe: Recipe) -> tuple[list[str], list[str]]:
    """(the linear layers of the language model that get adapters, the modules that train whole and are
    saved with the adapter) of a pretrained image-text model: method.lora.target_modules ('all-linear' or
    names) within the language model only, and the trained parts (trained_whole) beside
    method.lora.modules_to_save."""
    parts, lc = image_text_parts(model), recipe.method.lora
    (decoder,) = parts["language model"]
    wanted = None if lc.target_modules == "all-linear" else set(lc.target_modules)  # the schema's only string
    left_out = all_linear_left_out(model) if wanted is None else set()
    targets = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and name.startswith(decoder + ".")
        and not any(name.startswith(t + ".") for t in parts["tower"])  # Chameleon's tokenizer is in its LM
        and (wanted is None or name.rsplit(".", 1)[-1] in wanted)
        and not any(name == o or name.startswith(o + ".") for o in left_out)
    ]
    if wanted is None:
        targets = reloadable_targets(model, targets)
    if not targets:
        raise RecipeError(
            f"method.lora.target_modules={lc.target_modules}: no linear layer of the language model ({decoder}) "
            f"matches"
        )
    return targets, trained_whole(recipe, parts) + list(lc.modules_to_save or [])


def reloadable_targets(model, targets: list[str]) -> list[str]:
    """`targets` without the layers whose adapters peft would not load back from final/ (adapter_reload:
    transformers' key conversion renames them on load whatever key they are saved under), said at start-up:
    'all-linear' leaves them frozen rather than train adapters that reload as zero."""
    frozen = unreloadable_modules(model, targets)
    if frozen:
        kinds = sorted({lora_targets.layer_suffix(n) for n in frozen})
        log.info(
            "LoRA: %s stay frozen (%d layers): peft would not load their adapters back (transformers' key "
            "conversion for %s renames them on load); name them in method.lora.target_modules to adapt them anyway",
            ", ".join(kinds),
            len(frozen),
            model.config.model_type,
        )
    return [t for t in targets if t not in frozen]


def all_linear_left_out(model) -> set[str]:
    """What 'all-linear' leaves out of a language model as it does for a text one (lora_targets.resolve): the
    Mixture-of-Experts routers (Llama 4's, an nn.Linear that returns scores and logits), linear layers with a
    forward of their own, the state-space mixers' out_proj."""
    routers = lora_targets.router_modules(model) if lora_targets.fused_expert_parameters(model) else []
    return {
        *routers,
        *lora_targets.linears_with_own_forward(model),
        *lora_targets.state_space_out_projs(model),
    }


def checkpoint_processor(recipe: Recipe, tokenizer):
    """The processor saved with final/ of a pretrained image-text run: the checkpoint's own, with the run's
    tokenizer and chat template (the template that training rendered)."""
    cfg = recipe.model
    loaded = image_text_processor(pretrained_source(cfg.name_or_path), cfg.revision, cfg.trust_remote_code)
    processor = copy.copy(loaded)  # the loaded one is shared (the data pipeline's)
    processor.tokenizer = tokenizer
    processor.chat_template = tokenizer.chat_template
    return processor


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


def processor_for(recipe: Recipe, tokenizer, image_processor) -> transformers.LlavaProcessor:
    """The processor saved with final/: the run's tokenizer (and chat template) and image processor, set to
    expand each placeholder into the number of tokens the model was trained with."""
    v = recipe.model.vision
    return transformers.LlavaProcessor(
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
