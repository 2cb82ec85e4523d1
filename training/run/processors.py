"""The processor of an image-text checkpoint, as the trainer, the chat and the export load it: AutoProcessor's,
or, where that fails only because the processor has a video part and torchvision is not installed (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, GLM-4V and their kin: transformers' video processors need torchvision, its image
processors have a PIL backend), the same processor class built from the checkpoint's parts: the PIL backend of
its image processor (AutoImageProcessor with backend="pil", from preprocessor_config.json), its tokenizer, its
chat template and processor_config.json as transformers reads them, and no video processor. Such a processor
is saved as the Hub ships them (save_processor), so that final/ loads with AutoProcessor wherever torchvision is.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path

import transformers
from tokenizers import AddedToken
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import is_torchvision_available

from training.core.errors import RecipeError

log = logging.getLogger(__name__)

VIDEO = "video_processor"

# transformers' processor classes (AutoProcessor, AutoImageProcessor, ProcessorMixin and their registry) are
# reached through the lazy `transformers` module when a function first needs them: importing them imports its
# image processing, torchvision and torch._dynamo (about 2.3 s of a fresh interpreter's 5-6 s), which every
# process importing the data pipeline paid, text-only runs and every tool the app starts among them.


@functools.cache
def image_text_processor(src: str, revision: str | None = None, trust_remote_code: bool = False):
    """The processor of an image-text checkpoint (`src` as pretrained_source returns it), loaded once per
    process: the data pipeline asks it how many tokens each image becomes and for the pixels of each batch."""
    try:
        processor = transformers.AutoProcessor.from_pretrained(
            src, revision=revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, ImportError, AttributeError) as e:
        processor = None if trust_remote_code else without_video(src, revision)
        if processor is None:
            hint = "" if is_torchvision_available() else "; processors with a video part need torchvision"
            raise RecipeError(
                f"model.name_or_path: cannot load the processor of the image-text model {src!r} "
                f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}{hint})"
            ) from None
        log.warning(
            "%s: videos are not available without torchvision: its processor is loaded for images only "
            "(%s, %s)",
            src,
            type(processor).__name__,
            type(processor.image_processor).__name__,
        )
    if processor.chat_template is None and isinstance(processor.tokenizer.chat_template, str):
        # the template the checkpoint ships (chat_template.jinja, which its tokenizer reads too) where the class
        # drops it: BLIP-2's and InstructBLIP's __init__ pass no keyword argument on to ProcessorMixin's
        processor.chat_template = processor.tokenizer.chat_template
    if image_token(processor) is None:
        raise RecipeError(
            f"model.name_or_path: the processor of {src!r} ({type(processor).__name__}) names no image_token, "
            "the placeholder its text carries for each image; such models are not supported"
        )
    return processor


def image_token(processor) -> str | None:
    """The placeholder the processor's text carries for each image: its image_token, a string or an AddedToken
    (BLIP-2's and InstructBLIP's `<image>`) by its text; None when it names none."""
    token = getattr(processor, "image_token", None)
    token = token.content if isinstance(token, AddedToken) else token
    return token if isinstance(token, str) else None


def leading_image_tokens(processor, picture) -> list[int] | None:
    """The tokens a processor writes for a picture before the whole text instead of in place of its image token
    (BLIP-2, InstructBLIP: num_query_tokens image tokens, then the text as it is, which carries none): its
    tokens for an empty text with the picture, where the image token with the picture comes out as those
    tokens and then the token's own; else None (the processor expands its token where it stands)."""
    token = image_token(processor)

    def ids(text: str) -> list[int]:
        enc = processor(text=[text], images=[picture], add_special_tokens=False, return_tensors="pt")
        return [int(t) for t in enc["input_ids"][0]]

    try:
        lead, with_token = ids(""), ids(token)
    except Exception:  # noqa: BLE001 - a processor that refuses a text without its token expands it in place
        return None
    own = processor.tokenizer(token, add_special_tokens=False)["input_ids"]
    return lead if lead and with_token == lead + own else None


def processor_class(src: str, revision: str | None):
    """The processor class AutoProcessor would pick: processor_config.json's, else the config's type's."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING, processor_class_from_name

    named = Path(src) / "processor_config.json"
    if named.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            cls = processor_class_from_name(json.loads(named.read_text()).get("processor_class") or "")
            if cls is not None:
                return cls
    return PROCESSOR_MAPPING.get(type(AutoConfig.from_pretrained(src, revision=revision)))


def without_video(src: str, revision: str | None):
    """The checkpoint's processor built from its parts with no video processor, or None where torchvision is
    installed (AutoProcessor's failure is then another), the class takes a part other than a tokenizer, an
    image processor and a video processor, or a part does not load."""
    if is_torchvision_available():
        return None
    try:
        cls = processor_class(src, revision)
        parts = cls.get_attributes() if cls is not None else []
        if VIDEO not in parts or not set(parts) <= {"tokenizer", "image_processor", VIDEO}:
            return None
        built = {
            "tokenizer": lambda: AutoTokenizer.from_pretrained(src, revision=revision),
            "image_processor": lambda: transformers.AutoImageProcessor.from_pretrained(
                src, revision=revision, backend="pil"
            ),
            VIDEO: lambda: None,
        }
        args = [built[name]() for name in parts]
        processor_dict, kwargs = cls.get_processor_dict(src, revision=revision)
        with unchecked_processor_classes():
            return cls.from_args_and_dict(args, processor_dict, **kwargs)
    except (OSError, ValueError, ImportError, AttributeError, TypeError, KeyError):
        return None


@contextlib.contextmanager
def unchecked_processor_classes():
    """transformers' check of each processor part's class looks the video processor up in a registry that
    needs torchvision (Qwen2-VL and its kin, even with no video processor): skipped while a processor without
    its video part is built."""
    mixin = transformers.ProcessorMixin
    check = mixin.check_argument_for_proper_class
    mixin.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        yield
    finally:
        mixin.check_argument_for_proper_class = check


def save_processor(processor, path) -> None:
    """processor.save_pretrained(path); a processor without its video part (which save_pretrained cannot
    write) as its parts, as the Hub ships Qwen2-VL's kin: preprocessor_config.json, the tokenizer,
    chat_template.jinja and processor_config.json with the class and its own settings (InternVL's
    image_seq_length, ...; AutoProcessor then builds the video processor from the image processor's settings,
    where torchvision is installed)."""
    if VIDEO not in type(processor).get_attributes() or getattr(processor, VIDEO, None) is not None:
        processor.save_pretrained(path)
        return
    path = Path(path)
    processor.image_processor.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    if isinstance(processor.chat_template, str):
        (path / "chat_template.jinja").write_text(processor.chat_template)
    parts = type(processor).get_attributes()
    own = {k: v for k, v in processor.to_dict().items() if k not in parts}
    (path / "processor_config.json").write_text(json.dumps(own, indent=2, sort_keys=True) + "\n")
