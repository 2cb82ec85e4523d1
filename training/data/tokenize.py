"""Tokenizing: raw records -> input_ids with aligned labels (the model shifts them).

IGNORE (-100) marks a token without loss. Chat-like formats are rendered with the chat template and
carry labels on assistant turns only; examples longer than data.max_length are truncated or dropped
(data.too_long), and examples left with nothing to learn are dropped. Text documents are joined with
EOS and cut into blocks of data.max_length tokens, every token labelled.
"""

from __future__ import annotations

import contextlib

import datasets
from transformers import PreTrainedTokenizerBase

from training.config import DataSection
from training.core.batch import IGNORE
from training.core.errors import DataError
from training.data.formats import RecordFormat, ensure_chat_template

PROGRESS_MIN_ROWS = 5000  # show datasets' progress bars when a split is at least this long
datasets.disable_progress_bars()


@contextlib.contextmanager
def progress(n_rows: int):
    """datasets' progress bars for long preprocessing only (short runs and tests stay quiet)."""
    if n_rows < PROGRESS_MIN_ROWS:
        yield
        return
    datasets.enable_progress_bars()
    try:
        yield
    finally:
        datasets.disable_progress_bars()


def tokenize_chat(
    messages: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    train_from: int = 0,
) -> dict:
    """Render with the chat template; labels only on assistant turns (found by rendering prefixes) from
    message `train_from` on (a prompt-completion record's completion).

    With max_length the result is truncated; without, the caller applies data.too_long.
    """

    def render(msgs: list[dict], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from:
            continue
        start, end = len(render(messages[:i], gen=True)), len(render(messages[: i + 1]))
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        tok if any(s <= a < e for s, e in spans) else IGNORE
        for tok, (a, _) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    ids = enc["input_ids"]
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "labels": labels}


def text_blocks(
    ds: datasets.Dataset, fmt: RecordFormat, tokenizer: PreTrainedTokenizerBase, block: int, desc: str
) -> datasets.Dataset:
    """Documents joined with EOS and cut into full blocks of `block` tokens.

    The tail of each 1000 documents (less than one block) is dropped.
    """
    eos, column = tokenizer.eos_token_id, fmt.name("text")
    if eos is None:
        raise DataError(
            "model.tokenizer: the tokenizer has no EOS token to separate documents (format: text)"
        )

    def to_blocks(batch):
        ids: list[int] = []
        for text in batch[column]:
            if text.strip():
                ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return ds.map(to_blocks, batched=True, batch_size=1000, remove_columns=ds.column_names, desc=desc)


def chat_examples(
    ds: datasets.Dataset,
    fmt: RecordFormat,
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    key: str,
    stats: dict,
) -> datasets.Dataset:
    """Records -> tokenized chats, data.too_long applied, examples without a labelled token removed.

    Counts what was truncated or dropped into `stats`.
    """
    ensure_chat_template(tokenizer)

    def one(rec):
        enc = tokenize_chat(fmt.messages(rec), tokenizer, train_from=fmt.completion_start(rec))
        n = len(enc["input_ids"])
        return {**enc, "length": n}

    out = ds.map(one, remove_columns=ds.column_names, desc=f"tokenizing {key}")
    n_max = data.max_length
    too_long = sum(n > n_max for n in out["length"])
    if data.too_long == "drop":
        out = out.filter(lambda r: r["length"] <= n_max, desc=f"dropping long examples in {key}")
        stats["dropped_too_long"] = too_long
    else:
        out = out.map(
            lambda r: {"input_ids": r["input_ids"][:n_max], "labels": r["labels"][:n_max]},
            desc=f"truncating {key}",
        )
        stats["truncated"] = too_long
    before = len(out)

    def learns(r) -> bool:  # a labelled token after the first one (the first is never predicted)
        return any(t != IGNORE for t in r["labels"][1:])

    out = out.filter(learns, desc=f"checking labels in {key}")
    stats["dropped_no_labels"] = before - len(out)
    return out.remove_columns("length")
