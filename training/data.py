"""Data: load files (or a hub dataset) with `datasets`, check them, tokenize with loss masks, batch.

Formats:
  text         {"text": ...}                                   -> documents joined with EOS, cut into blocks
  instruction  {"instruction", "input"?, "output"}             -> a user/assistant chat; loss on the output
  chat         {"messages": [{"role", "content"}, ...]}        -> chat template; loss on assistant turns only
Labels are aligned with input_ids (the model shifts them); -100 marks tokens without loss.
"""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from training.config import DataSection, Recipe
from training.errors import DataError

log = logging.getLogger(__name__)

IGNORE = -100
ROLES = {"system", "user", "assistant", "tool"}
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text"}
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
datasets.disable_progress_bars()


# ----------------------------------------------------------------------------- loading and checking


def expand_files(patterns: list[str], key: str) -> list[Path] | None:
    """Local files matching the patterns, or None if the patterns name a hub dataset."""
    files: list[Path] = []
    for pat in patterns:
        matches = sorted(glob.glob(pat)) if any(c in pat for c in "*?[") else ([pat] if Path(pat).exists() else [])
        if not matches:
            looks_local = Path(pat).suffix in BUILDERS or "/" not in pat or pat.startswith((".", "/", "~"))
            if looks_local or len(patterns) > 1:
                raise DataError(f"{key}: data file {pat} does not exist")
            return None  # "org/name": a hub dataset
        for m in matches:
            p = Path(m)
            if p.suffix not in BUILDERS:
                raise DataError(f"{key}: {p} has an unsupported extension (use {', '.join(sorted(BUILDERS))})")
            if p.stat().st_size == 0:
                raise DataError(f"{key}: data file {p} is empty")
            files.append(p)
    return files


def check_record(rec, fmt: str) -> str | None:
    """Why this record cannot be used in the given format, or None if it can."""
    if not isinstance(rec, dict):
        return "expected a JSON object"
    if fmt == "text":
        if not isinstance(rec.get("text"), str):
            return "missing string field 'text' (format: text)"
    elif fmt == "instruction":
        for k in ("instruction", "output"):
            if not isinstance(rec.get(k), str):
                return f"missing string field '{k}' (format: instruction needs instruction, output and optional input)"
        if rec.get("input") is not None and not isinstance(rec["input"], str):
            return "field 'input' must be a string"
    elif fmt == "chat":
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "missing non-empty list field 'messages' (format: chat)"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                return f"messages[{i}] must be an object with 'role' and string 'content'"
            if m["role"] not in ROLES:
                return f"messages[{i}] has unknown role {m['role']!r} (expected one of {', '.join(sorted(ROLES))})"
        if not any(m["role"] == "assistant" for m in msgs):
            return "no assistant message, so nothing to learn from"
    return None


def check_json_file(path: Path, fmt: str) -> None:
    """Parse a JSON/JSONL file line by line so that errors name the line."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from None
        records = data if isinstance(data, list) else None
        if records is None:
            raise DataError(f"{path}: expected a JSON list of records")
        for i, rec in enumerate(records):
            if (why := check_record(rec, fmt)) is not None:
                raise DataError(f"{path} record {i}: {why}")
        return
    n = 0
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
                if (why := check_record(rec, fmt)) is not None:
                    raise DataError(f"{path} line {lineno}: {why}")
                n += 1
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text") from None
    if n == 0:
        raise DataError(f"{path}: no records (the file holds only blank lines)")


def load_raw(patterns: list[str], fmt: str, key: str) -> datasets.Dataset:
    files = expand_files(patterns, key)
    builder = None
    if files is None:
        try:
            ds = datasets.load_dataset(patterns[0], split="train")
        except Exception as e:  # hub errors come in many types
            raise DataError(f"{key}: cannot load hub dataset {patterns[0]!r} ({str(e).splitlines()[0]})") from None
    else:
        builders = {BUILDERS[p.suffix] for p in files}
        if len(builders) > 1:
            raise DataError(f"{key}: mixes file types ({', '.join(sorted(builders))}); use one type per split")
        builder = builders.pop()
        if builder == "json":
            for p in files:
                check_json_file(p, fmt)
        if builder == "text" and fmt != "text":
            raise DataError(f"{key}: .txt files hold raw text; set data.format=text")
        try:
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
        except Exception as e:
            raise DataError(f"{key}: cannot read {', '.join(map(str, files))} ({str(e).splitlines()[0]})") from None
    if len(ds) == 0:
        raise DataError(f"{key}: the dataset is empty")
    if builder != "json":  # JSON was checked line by line above; check other sources row by row
        for i, rec in enumerate(ds):
            if (why := check_record(rec, fmt)) is not None:
                raise DataError(f"{key} row {i}: {why}")
    return ds


# ----------------------------------------------------------------------------- tokenizing


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML


def instruction_to_messages(rec: dict, system_prompt: str | None) -> list[dict]:
    prompt = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": rec["output"]}]


def tokenize_chat(messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict:
    """Render with the chat template; labels only on assistant turns (found by rendering prefixes)."""
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(render(messages[:i], gen=True)), len(render(messages[: i + 1]))
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_length)
    labels = [
        tok if any(s <= a < e for s, e in spans) else IGNORE for tok, (a, _) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    return {"input_ids": enc["input_ids"], "labels": labels}


def tokenize_split(ds: datasets.Dataset, data: DataSection, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    cols = ds.column_names
    if data.format == "text":
        eos = tokenizer.eos_token_id
        block = data.max_length

        def to_blocks(batch):
            ids: list[int] = []
            for text in batch["text"]:
                if text.strip():
                    ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
            blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
            return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

        out = ds.map(to_blocks, batched=True, batch_size=1000, remove_columns=cols)
    else:
        ensure_chat_template(tokenizer)

        def one(rec):
            msgs = rec["messages"] if data.format == "chat" else instruction_to_messages(rec, data.system_prompt)
            return tokenize_chat([{"role": m["role"], "content": m["content"]} for m in msgs], tokenizer, data.max_length)

        out = ds.map(one, remove_columns=cols)
        out = out.filter(lambda r: any(t != IGNORE for t in r["labels"]))
    if len(out) == 0:
        raise DataError(
            f"data: no usable examples after tokenizing {', '.join(data.train)} "
            f"(text shorter than one block of max_length={data.max_length}, or every answer truncated away)"
        )
    return out


def build_datasets(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    data = recipe.data
    train_raw = load_raw(data.train, data.format, "data.train")
    if data.max_examples:
        train_raw = train_raw.select(range(min(data.max_examples, len(train_raw))))
    eval_raw = None
    if data.eval:
        eval_raw = load_raw(data.eval, data.format, "data.eval")
    elif data.eval_fraction > 0:
        split = train_raw.train_test_split(test_size=data.eval_fraction, seed=recipe.seed)
        train_raw, eval_raw = split["train"], split["test"]
    train = tokenize_split(train_raw, data, tokenizer)
    evals = tokenize_split(eval_raw, data, tokenizer) if eval_raw is not None else None
    return train, evals


# ----------------------------------------------------------------------------- batching


@dataclass
class Collator:
    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            n = -(-n // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), n), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[i, :k] = torch.tensor(r["input_ids"])
            labels[i, :k] = torch.tensor(r["labels"])
            mask[i, :k] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class EpochSampler(torch.utils.data.Sampler):
    """A shuffle that depends only on (seed, epoch), so a resumed run sees the same order."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


def make_loader(ds, batch_size: int, tokenizer, seed: int, shuffle: bool) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        ds.with_format(None),
        batch_size=batch_size,
        sampler=EpochSampler(len(ds), seed, shuffle),
        collate_fn=Collator(tokenizer.pad_token_id),
        drop_last=shuffle,
        generator=torch.Generator().manual_seed(seed),  # keeps the global RNG untouched by loader iteration
    )
