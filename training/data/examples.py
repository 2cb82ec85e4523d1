"""A split's raw records -> tokenized examples: the one place that dispatches on data.format (text blocks,
chat-like examples, preference pairs, RL prompts). Pre-tokenized builds, shards, streaming windows and the scale
estimate all come through here."""

from __future__ import annotations

import datasets
from transformers import PreTrainedTokenizerBase

from training.config import DataSection
from training.core.errors import DataError
from training.data.formats import RecordFormat, record_format
from training.data.preference import is_preference, preference_format, tokenize_preference
from training.data.prompts import prompt_format, tokenize_prompts
from training.data.tokenize import chat_examples, progress, text_blocks


def format_of(data: DataSection, needs: tuple[str, ...] | list[str] = ()) -> RecordFormat:
    """The checker of one record of data.format; `needs`: the columns RL rewards read (prompts)."""
    if is_preference(data):
        return preference_format(data)
    if data.format == "prompts":
        return prompt_format(data, needs)
    return record_format(data)


def tokenize_split(
    ds: datasets.Dataset,
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    key: str = "data.train",
    allow_empty: bool = False,  # one shard or window of many may leave nothing
) -> tuple[datasets.Dataset, dict]:
    """(tokenized dataset, stats): text blocks, or chat examples (see chat_examples)."""
    fmt = record_format(data)
    stats = {"examples": len(ds)}
    with progress(len(ds)):
        if data.format == "text":
            out = text_blocks(ds, fmt, tokenizer, data.max_length, f"tokenizing {key}")
        elif data.format in ("pairwise", "unpaired"):
            out = tokenize_preference(ds, data, tokenizer, key, stats)
        elif data.format == "prompts":
            out = tokenize_prompts(ds, data, tokenizer, key, stats)
        else:
            out = chat_examples(ds, fmt, data, tokenizer, key, stats)
    if len(out) == 0 and not allow_empty:
        sources = data.train_files if key == "data.train" else data.eval_files or data.train_files
        raise DataError(
            f"{key}: no usable examples after tokenizing {', '.join(sources)} "
            f"(text shorter than one block of max_length={data.max_length}, every answer truncated away, "
            f"or every example longer than max_length with too_long=drop)"
        )
    return out, stats
