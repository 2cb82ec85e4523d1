"""Layer 3, data: the recipe's data section -> batches of input_ids with loss masks.

Rule: never imports accelerate or torch.distributed; loaders take the data-parallel rank and size as
integers; imports core, config, launch and run only.

The flow, one module per step:
  load.py                files (or a hub dataset) -> raw records, each checked (errors name file and line)
  formats.py             a record -> chat messages (text, instruction, chat, sharegpt; data.columns); ChatML
  turns.py               tools, tool calls and results, reasoning traces, train marks: checked; labelled turns
  tokenize.py            messages -> input_ids + labels (loss on assistant turns only); text -> blocks
  packing.py             examples -> rows of several examples (data.packing)
  cache.py               the tokenized result on disk, keyed by everything that changes it
  examples.py            a split -> tokenized examples: the one dispatch on data.format
  pipeline.py            build_datasets: the steps above, through the cache; train_loader/eval_loader
  loader.py              rows -> padded or packed batches, in a resumable order
  streaming.py           data.streaming and mixtures: read, tokenized and packed on the fly
  tokenizer.py           the run's tokenizer (pretrained, or trained on the corpus: tokenizer_training.py)
Labels are aligned with input_ids (the model shifts them); IGNORE (-100, training.core.batch) marks
tokens without loss. Loaders take the data-parallel rank and size as integers: nothing here imports
accelerate's state or torch.distributed.
"""

from training.data.formats import ensure_chat_template
from training.data.loader import make_loader, pad_batch
from training.data.pipeline import build_datasets, eval_loader, eval_split_names, train_loader
from training.data.tokenizer import load_tokenizer
from training.data.tokenizer_training import trained_tokenizer

__all__ = [
    "build_datasets",
    "ensure_chat_template",
    "eval_loader",
    "eval_split_names",
    "load_tokenizer",
    "make_loader",
    "pad_batch",
    "train_loader",
    "trained_tokenizer",
]
