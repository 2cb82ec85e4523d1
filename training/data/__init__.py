"""Data: the recipe's data section -> batches of input_ids with loss masks.

The flow, one module per step:
  load.py                files (or a hub dataset) -> raw records, each checked (errors name file and line)
  formats.py             a record -> chat messages (text, instruction, chat, sharegpt; data.columns); ChatML
  tokenize.py            messages -> input_ids + labels (loss on assistant turns only); text -> blocks
  packing.py             examples -> rows of several examples (data.packing)
  cache.py               the tokenized result on disk, keyed by everything that changes it
  pipeline.py            build_datasets: the steps above, through the cache
  loader.py              rows -> padded or packed batches, in a resumable order
  tokenizer_training.py  a byte-level BPE trained on the corpus (model.train_tokenizer)
Labels are aligned with input_ids (the model shifts them); IGNORE (-100) marks tokens without loss.
"""

from training.data.formats import ensure_chat_template
from training.data.loader import make_loader, pad_batch, real_tokens
from training.data.pipeline import build_datasets, eval_split_names
from training.data.tokenize import IGNORE
from training.data.tokenizer_training import trained_tokenizer

__all__ = [
    "IGNORE",
    "build_datasets",
    "ensure_chat_template",
    "eval_split_names",
    "make_loader",
    "pad_batch",
    "real_tokens",
    "trained_tokenizer",
]
