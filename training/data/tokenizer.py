"""The run's tokenizer: a pretrained one (local directory, hub name, GGUF, bundled), or a byte-level BPE
trained on the corpus (model.train_tokenizer, cached)."""

from __future__ import annotations

from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from training.config import ModelSection
from training.core.errors import RecipeError
from training.core.fs import cache_root
from training.data.images import add_image_token
from training.data.tokenizer_training import trained_tokenizer
from training.run.sources import pretrained_source


def load_tokenizer(cfg: ModelSection) -> PreTrainedTokenizerBase:
    """The tokenizer of model.tokenizer (or name_or_path), or trained; an image-text model's (model.vision)
    with its image placeholder as a special token."""
    tok = base_tokenizer(cfg)
    if cfg.vision is not None:
        add_image_token(tok, cfg.vision.image_token)
    return tok


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
