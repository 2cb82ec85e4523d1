"""Data: load files (or a hub dataset) with `datasets`, check them, tokenize with loss masks, pack, cache, batch.

Formats (see training/data_formats.py; `data.columns` maps other column names):
  text         {"text": ...}                                   -> documents joined with EOS, cut into blocks
  instruction  {"instruction", "input"?, "output"}             -> a user/assistant chat; loss on the output
  chat         {"messages": [{"role", "content"}, ...]}        -> chat template; loss on assistant turns only
  sharegpt     {"conversations": [{"from", "value"}, ...]}     -> same as chat (human/gpt/system/tool roles)
Labels are aligned with input_ids (the model shifts them); -100 marks tokens without loss.
Examples longer than data.max_length are truncated or dropped (data.too_long); with data.packing they
are packed several to a row (training/packing.py). The result is cached on disk (training/data_cache.py).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from training.config import DataSection, Recipe
from training.data_cache import cache_key, load_or_build, source_fingerprint, tokenizer_fingerprint
from training.data_formats import ROLES, RecordFormat  # noqa: F401  (ROLES re-exported)
from training.errors import DataError
from training.packing import PackedCollator, pad_batch, pack_dataset, packing_efficiency

log = logging.getLogger(__name__)

IGNORE = -100
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text"}
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PROGRESS_MIN_ROWS = 5000  # show datasets' progress bars when a split is at least this long
datasets.disable_progress_bars()


def record_format(data: DataSection) -> RecordFormat:
    return RecordFormat(data.format, dict(data.columns), data.system_prompt)


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
            if p.is_dir():
                raise DataError(f"{key}: {p} is a directory; name the data files (globs allowed, e.g. {p}/*.jsonl)")
            if p.suffix not in BUILDERS:
                raise DataError(f"{key}: {p} has an unsupported extension (use {', '.join(sorted(BUILDERS))})")
            if p.stat().st_size == 0:
                raise DataError(f"{key}: data file {p} is empty")
            files.append(p)
    return files


def check_record(rec, fmt: str | RecordFormat) -> str | None:
    """Why this record cannot be used in the given format, or None if it can."""
    return (fmt if isinstance(fmt, RecordFormat) else RecordFormat(fmt)).problem(rec)


def check_json_file(path: Path, fmt: RecordFormat) -> None:
    """Parse a JSON/JSONL file line by line so that errors name the line."""
    try:
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of records")
            if not data:
                raise DataError(f"{path}: the JSON list holds no records")
            for i, rec in enumerate(data):
                if (why := fmt.problem(rec)) is not None:
                    raise DataError(f"{path} record {i}: {why}")
            return
        n = 0
        with path.open(encoding="utf-8", errors="strict") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
                if (why := fmt.problem(rec)) is not None:
                    raise DataError(f"{path} line {lineno}: {why}")
                n += 1
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    if n == 0:
        raise DataError(f"{path}: no records (the file holds only blank lines)")


def csv_as_text(path: Path) -> datasets.Features:
    """Read every CSV column as text: "4" is an answer, not an integer."""
    import csv

    with path.open(encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def load_raw(patterns: list[str], fmt: str | RecordFormat, key: str, files: list[Path] | None = None) -> datasets.Dataset:
    fmt = fmt if isinstance(fmt, RecordFormat) else RecordFormat(fmt)
    files = expand_files(patterns, key) if files is None else files
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
        if builder == "text" and fmt.format != "text":
            raise DataError(f"{key}: .txt files hold raw text; set data.format=text")
        if builder == "text" and fmt.name("text") != "text":
            raise DataError(f"{key}: .txt files have no columns to map; remove data.columns.text")
        try:
            extra = {"features": csv_as_text(files[0])} if builder == "csv" else {}
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", **extra)
        except Exception as e:
            raise DataError(f"{key}: cannot read {', '.join(map(str, files))} ({str(e).splitlines()[0]})") from None
    if len(ds) == 0:
        raise DataError(f"{key}: the dataset is empty")
    if builder != "json":  # JSON was checked line by line above; check other sources row by row
        for i, rec in enumerate(ds):
            if (why := fmt.problem(rec)) is not None:
                where = f"{files[0]} line {i + 2}" if builder == "csv" and len(files) == 1 else f"{key} row {i}"
                raise DataError(f"{where}: {why}")
    return ds


# ----------------------------------------------------------------------------- tokenizing


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML


def instruction_to_messages(rec: dict, system_prompt: str | None) -> list[dict]:
    return RecordFormat("instruction", {}, system_prompt).messages(rec)


def tokenize_chat(messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_length: int | None = None) -> dict:
    """Render with the chat template; labels only on assistant turns (found by rendering prefixes).

    With max_length the result is truncated; without, the caller applies data.too_long.
    """
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(render(messages[:i], gen=True)), len(render(messages[: i + 1]))
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        tok if any(s <= a < e for s, e in spans) else IGNORE for tok, (a, _) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    ids = enc["input_ids"]
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "labels": labels}


def text_blocks(ds: datasets.Dataset, fmt: RecordFormat, tokenizer: PreTrainedTokenizerBase, block: int, desc: str):
    """Documents joined with EOS and cut into full blocks of `block` tokens (the tail of each 1000 docs is dropped)."""
    eos, column = tokenizer.eos_token_id, fmt.name("text")
    if eos is None:
        raise DataError("model.tokenizer: the tokenizer has no EOS token to separate documents (format: text)")

    def to_blocks(batch):
        ids: list[int] = []
        for text in batch[column]:
            if text.strip():
                ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return ds.map(to_blocks, batched=True, batch_size=1000, remove_columns=ds.column_names, desc=desc)


def tokenize_split(ds: datasets.Dataset, data: DataSection, tokenizer: PreTrainedTokenizerBase, key: str = "data.train"):
    """(tokenized dataset, stats). Chat-like formats get data.too_long applied and loss-free examples removed."""
    fmt = record_format(data)
    stats = {"examples": len(ds)}
    with progress(len(ds)):
        if data.format == "text":
            out = text_blocks(ds, fmt, tokenizer, data.max_length, f"tokenizing {key}")
        else:
            ensure_chat_template(tokenizer)

            def one(rec):
                enc = tokenize_chat(fmt.messages(rec), tokenizer)
                n = len(enc["input_ids"])
                return {**enc, "length": n}

            out = ds.map(one, remove_columns=ds.column_names, desc=f"tokenizing {key}")
            too_long = sum(n > data.max_length for n in out["length"])
            if data.too_long == "drop":
                out = out.filter(lambda r: r["length"] <= data.max_length, desc=f"dropping long examples in {key}")
                stats["dropped_too_long"] = too_long
            else:
                out = out.map(
                    lambda r: {"input_ids": r["input_ids"][: data.max_length], "labels": r["labels"][: data.max_length]},
                    desc=f"truncating {key}",
                )
                stats["truncated"] = too_long
            before = len(out)
            # An example needs a labelled token after its first one (the first token is never predicted).
            out = out.filter(lambda r: any(t != IGNORE for t in r["labels"][1:]), desc=f"checking labels in {key}")
            stats["dropped_no_labels"] = before - len(out)
            out = out.remove_columns("length")
    if len(out) == 0:
        raise DataError(
            f"{key}: no usable examples after tokenizing {', '.join(data.train if key == 'data.train' else data.eval or data.train)} "
            f"(text shorter than one block of max_length={data.max_length}, every answer truncated away, "
            f"or every example longer than max_length with too_long=drop)"
        )
    return out, stats


def finish_split(ds: datasets.Dataset, data: DataSection, stats: dict, key: str) -> tuple[datasets.Dataset, dict]:
    tokens = sum(len(x) for x in ds["input_ids"])
    stats.update(kept=len(ds), tokens=tokens)
    if data.packing:
        with progress(len(ds)):
            ds = pack_dataset(ds, data.max_length, desc=f"packing {key}")
        stats["packing_efficiency"] = packing_efficiency(ds, data.max_length)
    stats["rows"] = len(ds)
    return ds, stats


def describe(key: str, data: DataSection, stats: dict) -> str:
    """The start-up log line for one split."""
    if data.format == "text":
        return f"{key}: {stats['examples']} documents -> {stats['rows']} blocks of {data.max_length} tokens"
    kept = stats.get("kept", stats["rows"])
    line = f"{key}: {stats['examples']} examples{f', {kept} kept' if kept != stats['examples'] else ''}, {stats.get('tokens', '?')} tokens"
    if "packing_efficiency" in stats:
        line += (
            f" -> {stats['rows']} packed rows of max_length={data.max_length}, "
            f"packing efficiency {100 * stats['packing_efficiency']:.1f}% (real tokens / token slots)"
        )
    if stats.get("truncated"):
        line += f"; {stats['truncated']} truncated to max_length={data.max_length}"
    if stats.get("dropped_too_long"):
        line += f"; {stats['dropped_too_long']} dropped as longer than max_length={data.max_length}"
    if stats.get("dropped_no_labels"):
        line += f"; {stats['dropped_no_labels']} dropped with no assistant token left to learn"
    return line


def build_datasets(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    data = recipe.data
    fmt = record_format(data)
    if data.format != "text":
        ensure_chat_template(tokenizer)  # before fingerprinting: the template is part of the cache key
    train_files = expand_files(data.train, "data.train")
    eval_files = expand_files(data.eval, "data.eval") if data.eval else None
    preloaded = {}
    if train_files is None:  # hub datasets are fingerprinted by datasets itself, so load them first
        preloaded["train"] = load_raw(data.train, fmt, "data.train")
    if data.eval and eval_files is None:
        preloaded["eval"] = load_raw(data.eval, fmt, "data.eval")

    def build():
        train_raw = preloaded["train"] if "train" in preloaded else load_raw(data.train, fmt, "data.train", train_files)
        if data.max_examples:
            train_raw = train_raw.select(range(min(data.max_examples, len(train_raw))))
        eval_raw = None
        if data.eval:
            eval_raw = preloaded["eval"] if "eval" in preloaded else load_raw(data.eval, fmt, "data.eval", eval_files)
        elif data.eval_fraction > 0:
            split = train_raw.train_test_split(test_size=data.eval_fraction, seed=recipe.seed)
            train_raw, eval_raw = split["train"], split["test"]
        splits, stats = {}, {}
        for name, raw in (("train", train_raw), ("eval", eval_raw)):
            if raw is not None:
                key = f"data.{name}"
                ds, st = tokenize_split(raw, data, tokenizer, key)
                splits[name], stats[name] = finish_split(ds, data, st, key)
        return splits, stats

    if data.cache:
        key = cache_key({
            "train": source_fingerprint(train_files, data.train, preloaded.get("train")),
            "eval": source_fingerprint(eval_files, data.eval, preloaded.get("eval")) if data.eval else None,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "data": data.model_dump(mode="json", exclude={"train", "eval", "cache", "cache_dir"}),
            "seed": recipe.seed if data.eval_fraction > 0 and not data.eval else None,
        })
        splits, stats, hit = load_or_build(cache_dir(data), key, build)
        log.info("data cache %s: %s", "hit, preprocessing skipped" if hit else "written", cache_dir(data) / key)
    else:
        splits, stats = build()
    for name in splits:
        log.info(describe(f"data.{name}", data, stats[name]))
    return splits["train"], splits.get("eval")


def cache_dir(data: DataSection) -> Path:
    from training.models import cache_root

    return Path(data.cache_dir).expanduser() if data.cache_dir else cache_root() / "data"


# ----------------------------------------------------------------------------- batching


@dataclass
class Collator:
    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            n = -(-n // self.pad_to_multiple_of) * self.pad_to_multiple_of
        rows = [{**r, "attention_mask": [1] * len(r["input_ids"])} for r in rows]
        return pad_batch(rows, {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE}, n)


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


def make_loader(ds, batch_size: int, tokenizer, seed: int, shuffle: bool, padding_free: bool = False) -> torch.utils.data.DataLoader:
    """Batches of examples (padded, with attention_mask) or of packed rows (position_ids, no mask;
    with padding_free=True, for flash_attention_2, flattened into one row with varlen kwargs)."""
    packed = "position_ids" in ds.column_names
    collate = PackedCollator(tokenizer.pad_token_id, padding_free) if packed else Collator(tokenizer.pad_token_id)
    return torch.utils.data.DataLoader(
        ds.with_format(None),
        batch_size=batch_size,
        sampler=EpochSampler(len(ds), seed, shuffle),
        collate_fn=collate,
        drop_last=shuffle,
        generator=torch.Generator().manual_seed(seed),  # keeps the global RNG untouched by loader iteration
    )
