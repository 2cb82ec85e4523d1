"""Models loaded for generation: a run's result, a checkpoint, an adapter or any model, and the picture an
image-text model is given (the chat CLI, the app's Chat tab, the demo and the benchmarks load through here).

What a path is, is decided by training.run.rundir.resolve_source: a run directory resolves to its final/
(or its newest checkpoint if there is no final/ yet). An adapter directory loads its base model
(models.adapter_base) and the adapter; a checkpoint is rebuilt from the run's recipe and loaded from
its saved state.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from safetensors.torch import load_file
from transformers import AutoTokenizer

from training.config import load_recipe
from training.config.architectures import has_vision_part
from training.core.errors import UserError
from training.data import ensure_chat_template
from training.data.images import image_processor
from training.data.tokenizer import load_tokenizer
from training.model.build import build_model
from training.model.vision import checkpoint_processor, processor_for, rendered_image, resolve_image_text
from training.run.processors import image_text_processor
from training.run.rundir import BASE_CONFIG, Source, resolve_source
from training.run.sources import (
    adapter_base,
    adapter_base_kwargs,
    auto_model,
    is_reward_model,
    pretrained_source,
)


def load_for_chat(source: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) ready for generation, from a run dir, final/, checkpoint, adapter or model."""
    found = resolve_source(source)
    refuse_reward_model(source, found)
    if found.kind == "model":
        src = pretrained_source(str(found.path))
        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
            model = auto_model(src).from_pretrained(src, dtype=dtype)
        except OSError as e:
            reason = str(e).splitlines()[0]
            if isinstance(found.path, str):  # not on disk: a hub name, as far as resolve_source can tell
                raise UserError(
                    f"{source}: no such path, and no hub model of that name loads ({reason})"
                ) from None
            raise UserError(f"{source}: cannot load the model ({reason})") from None
    elif found.kind == "adapter":
        # peft imports bitsandbytes (seconds): only for adapters
        from peft import PeftModel

        base_src = adapter_base(found)
        base = auto_model(base_src).from_pretrained(base_src, dtype=dtype, **adapter_base_kwargs(found.path))
        tokenizer = AutoTokenizer.from_pretrained(found.path)
        model = PeftModel.from_pretrained(base, found.path)
    else:
        model, tokenizer = _load_checkpoint(found)
    return model.to(device).eval(), ready_for_chat(tokenizer)


def refuse_reward_model(source: str, found: Source) -> None:
    """UserError for a reward model (it scores text, it does not chat), saying how to use it instead."""
    if not is_reward_model(found):
        return
    path = found.path
    merge = ""
    if found.kind != "model":  # an adapter or a checkpoint: merged into a plain model first
        path = f"{found.run.root if found.run else found.path}/merged"
        merge = f"merge it (python -m training.export {found.run.root if found.run else found.path} --merge), then "
    raise UserError(
        f"{source} is a reward model (sequence classification: one score per text); it scores, it does not "
        f"chat. To use it as a reward of online RL, {merge}give rl.rewards: [{{function: reward_model, "
        f"args: {{path: {path}}}}}]"
    )


def ready_for_chat(tokenizer):
    """The tokenizer with a chat template (ChatML where it has none) and a pad token (its end token)."""
    ensure_chat_template(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def adapter_base_key(adapter: Source) -> tuple[str, str]:
    """What decides which base model an adapter loads on: the base's source, and the base config the run
    changed (base_config.json, e.g. RoPE scaling). Adapters with equal keys can share one loaded base."""
    config = Path(adapter.path) / BASE_CONFIG
    return adapter_base(adapter), config.read_text() if config.is_file() else ""


def load_adapters(adapters: dict[str, Source], device: str | torch.device = "cpu", dtype=torch.float32):
    """(model, {name: tokenizer}): one base model loaded once, with each adapter (of that base:
    `adapter_base_key` equal) attached under its name by peft; `model.set_adapter(name)` chooses the one that
    generates, `model.disable_adapter()` gives the base itself."""
    from peft import PeftModel

    (first_name, first), *rest = adapters.items()
    base_src = adapter_base(first)
    base = auto_model(base_src).from_pretrained(base_src, dtype=dtype, **adapter_base_kwargs(first.path))
    model = PeftModel.from_pretrained(base, first.path, adapter_name=first_name)
    for name, found in rest:
        model.load_adapter(found.path, adapter_name=name)
    tokenizers = {
        name: ready_for_chat(AutoTokenizer.from_pretrained(found.path)) for name, found in adapters.items()
    }
    return model.to(device).eval(), tokenizers


def takes_images(model) -> bool:
    """Whether the model is an image-text one (its config has a vision part)."""
    return has_vision_part(model.config)


def with_image(messages: list[dict], processor) -> list[dict]:
    """The messages with the picture before the first user message's text, where training put it (one
    picture per conversation), written as the processor's chat template writes an image part (e.g.
    Qwen2-VL's <|vision_start|><|image_pad|><|vision_end|>), else as its image token."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    image = rendered_image(processor) or processor.image_token
    pictured = {**messages[first], "content": image + messages[first]["content"]}
    return [*messages[:first], pictured, *messages[first + 1 :]]


def load_processor(source: str, model):
    """The processor that turns an image into the model's pixel values and image tokens: final/'s own, or,
    for a checkpoint, the one the run's final/ would get; UserError for a text-only model."""
    if not takes_images(model):
        raise UserError(
            f"--image: {source} is a text-only model ({model.config.model_type}); it takes no images"
        )
    found = resolve_source(source)
    if found.kind == "model":
        return image_text_processor(pretrained_source(str(found.path)))
    if found.kind == "adapter":  # a LoRA run's final/ carries the processor beside the adapter
        return image_text_processor(str(found.path))
    recipe = resolve_image_text(load_recipe(found.run.config))  # a checkpoint of an image-text run
    tokenizer = load_tokenizer(recipe.model, recipe.data.images)
    if recipe.image_text_checkpoint:
        return checkpoint_processor(recipe, tokenizer)
    return processor_for(recipe, tokenizer, image_processor(recipe.model.vision.image_size))


def read_image(path: str):
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise UserError(f"--image: {path} does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"--image: {path} cannot be read as an image ({e})") from None


def _load_checkpoint(ckpt: Source):
    """The run's model rebuilt from its recipe, with the checkpoint's weights."""
    if ckpt.run is None:
        raise UserError(f"{ckpt.path}: checkpoint outside its run directory, cannot rebuild the model")
    recipe = load_recipe(ckpt.run.config)
    tokenizer = load_tokenizer(recipe.model)
    model = build_model(recipe, tokenizer, torch.device("cpu"))
    weights = Path(ckpt.path) / "model.safetensors"
    if not weights.is_file():
        raise UserError(
            f"{ckpt.path}: no model.safetensors "
            "(sharded DeepSpeed/FSDP checkpoints: use final/ or export first)"
        )
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    tied = {k for k in missing if "lm_head" in k}
    if unexpected or set(missing) - tied:
        raise UserError(
            f"{ckpt.path}: weights do not match the run's model "
            f"({len(missing)} missing, {len(unexpected)} unexpected keys)"
        )
    if tied:
        model.tie_weights()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.use_cache = True  # fast generation
    return model, tokenizer
