"""The run's tokenizer: a pretrained one (local directory, hub name, GGUF, bundled), or a byte-level BPE
trained on the corpus (model.train_tokenizer, cached)."""

from __future__ import annotations

from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from training.config import ImageTokens, ModelSection
from training.core.errors import RecipeError
from training.core.fs import cache_root
from training.data.images import add_image_token, processor_of
from training.data.tokenizer_training import trained_tokenizer
from training.run.sources import pretrained_source


def load_tokenizer(cfg: ModelSection, images: ImageTokens | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of model.tokenizer (or name_or_path), or trained; a composed image-text model's
    (model.vision) with its image placeholder as a special token; a pretrained image-text checkpoint's
    (`images`, the recipe's data.images) with its processor's chat template."""
    tok = base_tokenizer(cfg)
    if images is not None and images.processor is not None:
        adopt_processor_template(tok, processor_of(images), images.in_text)
    elif cfg.vision is not None:
        add_image_token(tok, cfg.vision.image_token)
    return tok


# Runs before a template that reads every message's content as a list of parts (SmolVLM's): a string content
# becomes its parts again, each IMAGE (what the template writes for an image part, ImageTokens.in_text) an
# image part, the text between text parts, so that the template writes it as it would the parts.
STRING_AS_PARTS = """{%- set string_parts = namespace(messages=[]) -%}
{%- for message in messages -%}
{%- if message['content'] is string -%}
{%- set parts = namespace(list=[]) -%}
{%- for piece in message['content'].split(IMAGE) -%}
{%- if not loop.first -%}{%- set parts.list = parts.list + [{'type': 'image'}] -%}{%- endif -%}
{%- if piece -%}{%- set parts.list = parts.list + [{'type': 'text', 'text': piece}] -%}{%- endif -%}
{%- endfor -%}
{%- if not parts.list -%}{%- set parts.list = [{'type': 'text', 'text': ''}] -%}{%- endif -%}
{%- set string_parts.messages = string_parts.messages + [{'role': message['role'], 'content': parts.list}] -%}
{%- else -%}
{%- set string_parts.messages = string_parts.messages + [message] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = string_parts.messages -%}
"""


def adopt_processor_template(tok: PreTrainedTokenizerBase, processor, image: str) -> None:
    """The checkpoint's chat template (the processor's, else the tokenizer's own) on the tokenizer, taking
    string contents (as training renders its records, `image` standing for each picture) where it reads only
    lists of parts."""
    template = getattr(processor, "chat_template", None) or tok.chat_template
    if not template:
        return
    tok.chat_template = template
    try:
        shown = "[[TEXT]]" in tok.apply_chat_template(
            [{"role": "user", "content": "[[TEXT]]"}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that fails on a string content reads parts
        shown = False
    if not shown:
        tok.chat_template = STRING_AS_PARTS.replace("IMAGE", repr(image)) + template


def base_tokenizer(cfg: ModelSection) -> PreTrainedTokenizerBase:
    if cfg.train_tokenizer is not None:  # a new byte-level BPE trained on the corpus (cached)
        return trained_tokenizer(cfg.train_tokenizer, cache_root())
    src = pretrained_source(cfg.tokenizer or cfg.name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(
            src, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise RecipeError(
            f"model.tokenizer: cannot load tokenizer from {src!r} ({str(e).splitlines()[0]})"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
