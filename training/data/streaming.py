"""Streaming training data: local shards read, tokenized and packed on the fly, resumable at the exact token.

data.streaming (and every weighted mixture, data.train: [{path, weight}, ...]) trains from a stream:
  shards (.jsonl/.txt, in order) -> windows of data.stream_window records -> tokenize + pack (the same
  tokenize_split / pack_dataset as pre-tokenized data, on one window at a time) -> the window's rows,
  shuffled by a seeded permutation -> mixture (each next row from the source furthest below its token
  share) -> global batches -> this rank's batches.
Nothing but the windows in flight is ever held: no Arrow table of the corpus, no cache entry.

Order. Every data-parallel rank reads the same global stream and keeps global batch k when
k % world == rank, which is how accelerate shards a map-style loader; so with a window that holds
the whole corpus, a streamed run trains on exactly the batches of the pre-tokenized run (same seed,
same process count), and with smaller windows the order differs only by where the shuffle stops. The
price is that every rank tokenizes the whole stream (its own worker processes, data.num_proc, keep
windows ready ahead of the step).

Resume. `state_dict()` is taken at a step boundary, when every rank has pulled the same rows: per
source the shard, the seek position (tell cookie) and line after the current window, the window's rows
not yet trained on (the packing/shuffle buffer), and per source the tokens drawn so far (the mixture's
state). It is registered with `accelerator.register_for_checkpointing`, so it lands in every
checkpoint; a resumed run seeks to the position and reads no record twice.

Hand-written because: torchdata (StatefulDataLoader, which accelerate's use_stateful_dataloader
needs) is not installed, and datasets' streaming JSON reader reports bad records without file and line
and resumes by re-reading the current shard; a seekable line reader is 50 lines.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import datasets
import torch

from training.config import DataSource, Recipe
from training.core.batch import to_device
from training.core.errors import DataError
from training.data.examples import tokenize_split
from training.data.formats import RecordFormat, ensure_chat_template, record_format
from training.data.load import expand_files
from training.data.loader import Collator, PackedCollator
from training.data.packing import pack_dataset
from training.data.shards import TEXT_CHUNK, available_cores, plain_worker

log = logging.getLogger(__name__)

STREAM_SUFFIXES = (".jsonl", ".txt", ".text")
TRACE_ENV = "LLM_FORGE_DATA_TRACE"  # tests: append "pid source epoch first_record end_record" per window read


# ----------------------------------------------------------------------------- reading records


def stream_files(src: DataSource, key: str) -> list[Path]:
    files = expand_files(src.path, key)
    if files is None:
        raise DataError(
            f"{key}: {src.path[0]!r} looks like a hub dataset; streaming reads local shards "
            f"({', '.join(STREAM_SUFFIXES)}); download it, or set data.streaming: false"
        )
    for p in files:
        if p.suffix not in STREAM_SUFFIXES:
            raise DataError(
                f"{key}: {p}: streaming reads {', '.join(STREAM_SUFFIXES)} shards (one record per line); "
                f"convert it or set data.streaming: false"
            )
    return files


def read_window(files: list[Path], fmt: RecordFormat, pos: dict, n: int) -> tuple[list[dict], dict]:
    """Up to `n` records from position `pos` onwards (fewer at the end of the last shard), and the
    position after them. Each record is checked; a bad one is a DataError naming its file and line.
    Lines as datasets' text builder splits them (universal newlines, the newline dropped)."""
    pos, records = dict(pos), []
    while len(records) < n and pos["file"] < len(files):
        path = files[pos["file"]]
        try:
            with path.open(encoding="utf-8", errors="strict") as f:
                f.seek(pos["cookie"])
                while len(records) < n:
                    line = f.readline()
                    if not line:
                        break
                    pos["line"] += 1
                    if path.suffix == ".jsonl":
                        if not line.strip():
                            continue
                        try:
                            rec = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path} line {pos['line']}: not valid JSON ({e.msg})") from None
                    else:
                        rec = {"text": line[:-1] if line.endswith("\n") else line}
                    if (why := fmt.problem(rec)) is not None:
                        raise DataError(f"{path} line {pos['line']}: {why}")
                    records.append(rec)
                if len(records) < n:
                    pos.update(file=pos["file"] + 1, cookie=0, line=0)
                else:
                    pos["cookie"] = f.tell()
        except UnicodeDecodeError:
            raise DataError(f"{path} line {pos['line'] + 1}: not UTF-8 text") from None
    pos["records"] += len(records)
    return records, pos


# ----------------------------------------------------------------------------- one window -> rows

_CONTEXT: dict = {}  # (data section, tokenizer) for forked worker processes


def window_rows(records: list[dict], seed: int) -> list[dict]:
    """Tokenize (and pack) one window exactly as the pre-tokenized pipeline would, then shuffle it by a
    permutation of `seed` (the permutation EpochSampler uses for a whole epoch)."""
    data, tokenizer = _CONTEXT["data"], _CONTEXT["tokenizer"]
    if not records:
        return []
    if data.format == "text":  # text_blocks' blocks (1000 documents at a time), tokenized in one batched call
        rows = text_window_blocks(records, data, tokenizer)
    else:
        fmt = record_format(data)
        ds = datasets.Dataset.from_list([fmt.arrow_safe(r) for r in records])
        out, _ = tokenize_split(ds, data, tokenizer, "data.train", allow_empty=True)
        if data.packing and len(out):
            out = pack_dataset(out, data.max_length)
        rows = out.with_format(None)[:]
        rows = [dict(zip(rows, vals)) for vals in zip(*rows.values())]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [rows[i] for i in perm]


def text_window_blocks(records: list[dict], data, tokenizer) -> list[dict]:
    column, eos, block = record_format(data).name("text"), tokenizer.eos_token_id, data.max_length
    if eos is None:
        raise DataError(
            "model.tokenizer: the tokenizer has no EOS token to separate documents (format: text)"
        )
    texts = [r[column] for r in records]
    enc = iter(tokenizer([t for t in texts if t.strip()], add_special_tokens=False)["input_ids"])
    docs = [next(enc) + [eos] if t.strip() else [] for t in texts]
    rows = []
    for c in range(0, len(docs), TEXT_CHUNK):
        ids = [t for d in docs[c : c + TEXT_CHUNK] for t in d]
        rows += [
            {"input_ids": ids[i : i + block], "labels": ids[i : i + block]}
            for i in range(0, len(ids) - block + 1, block)
        ]
    return rows


class StreamSource:
    """One source's rows, window by window, with the next windows tokenized ahead in a worker pool."""

    def __init__(self, src: DataSource, index: int, data, seed: int, pool, key: str):
        self.name, self.weight, self.index = src.name or "train", src.weight, index
        self.files = stream_files(src, key)
        self.fmt, self.window, self.seed, self.pool = record_format(data), data.stream_window, seed, pool
        self.pos = {"file": 0, "cookie": 0, "line": 0, "records": 0, "epoch": 0, "window": 0}
        self.rows: deque[dict] = deque()  # the current window's rows not yet handed out
        self.ahead: list = []  # (future rows, position after that window), in order
        self.records_read = 0  # by this process (a resumed run starts at 0)
        self.depth = max(1, getattr(pool, "_max_workers", 1)) if pool is not None else 0

    def _window_seed(self, pos: dict) -> int:
        base = self.seed + 7919 * self.index  # sources shuffle independently
        return base + pos["epoch"] + (1_000_003 * pos["window"] if pos["window"] else 0)

    def _read_next(self, pos: dict):
        records, after = read_window(self.files, self.fmt, pos, self.window)
        if not records:  # end of the corpus: the next epoch starts from the first shard
            if pos["records"] == 0:
                raise DataError(f"data.train ({self.name}): the shards hold no records")
            pos = {"file": 0, "cookie": 0, "line": 0, "records": 0, "epoch": pos["epoch"] + 1, "window": 0}
            records, after = read_window(self.files, self.fmt, pos, self.window)
        self.records_read += len(records)
        if trace := os.environ.get(TRACE_ENV):
            with open(trace, "a") as f:
                f.write(f"{os.getpid()} {self.name} {pos['epoch']} {pos['records']} {after['records']}\n")
        seed = self._window_seed(pos)
        after = {**after, "window": pos["window"] + 1}
        if self.pool is None:
            return _Done(window_rows(records, seed)), after
        return self.pool.submit(window_rows, records, seed), after

    def next_row(self) -> dict:
        empty_windows = 0
        while not self.rows:
            while len(self.ahead) < max(1, self.depth):
                last = self.ahead[-1][1] if self.ahead else self.pos
                self.ahead.append(self._read_next(last))
            future, self.pos = self.ahead.pop(0)
            self.rows = deque(future.result())
            empty_windows += 1
            if empty_windows > 1000 and not self.rows:
                raise DataError(f"data.train ({self.name}): no usable rows in 1000 windows in a row")
        return self.rows.popleft()

    def state_dict(self) -> dict:
        return {"pos": dict(self.pos), "rows": list(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.rows, self.ahead = dict(state["pos"]), deque(state["rows"]), []


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


# ----------------------------------------------------------------------------- mixture and batches


class StreamLoader:
    """This rank's micro-batches from the (mixed) stream; `state_dict` is the data position."""

    checkpoint_label = "the data stream's position (data.streaming)"  # in resume's refusals

    def __init__(
        self, recipe: Recipe, tokenizer, dp_rank: int, dp_size: int, device, padding_free: bool = False
    ):
        data = recipe.data
        if data.format != "text":
            ensure_chat_template(tokenizer, data)
        _CONTEXT.update(data=data, tokenizer=tokenizer)
        procs = data.num_proc or max(1, available_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        pool = None
        if procs > 1:
            pool = ProcessPoolExecutor(
                procs, mp_context=multiprocessing.get_context("fork"), initializer=plain_worker
            )
        sources = data.sources
        self.sources = [
            StreamSource(
                s, i, data, recipe.seed, pool, f"data.train[{i}].path" if data.is_mixture else "data.train"
            )
            for i, s in enumerate(sources)
        ]
        total = sum(s.weight for s in self.sources)
        self.shares = [s.weight / total for s in self.sources]
        self.tokens = [0] * len(self.sources)  # drawn from each source, all ranks together
        self.batch_size = recipe.train.batch_size
        self.rank, self.world = dp_rank, dp_size  # this data-parallel rank of how many
        self.device = device
        self.batches = 0  # global batch groups handed out
        self.collate = PackedCollator(tokenizer.pad_token_id, padding_free) if data.packing else None
        self.collate = self.collate or Collator(tokenizer.pad_token_id)
        self.packed = data.packing

    def next_row(self) -> dict:
        # deficit rule: the source furthest below its share of the tokens drawn so far (ties: first source)
        drawn = sum(self.tokens)
        i = max(range(len(self.sources)), key=lambda j: (self.shares[j] * drawn - self.tokens[j], -j))
        row = self.sources[i].next_row()
        self.tokens[i] += len(row["input_ids"])
        return row

    def __iter__(self):
        while True:
            # every rank pulls the whole group of `world` batches, so all hold the same position
            group = [self.next_row() for _ in range(self.batch_size * self.world)]
            self.batches += 1
            mine = group[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            yield to_device(self.collate(mine), self.device)

    def metrics(self) -> dict:
        row = {f"data_tokens/{s.name}": n for s, n in zip(self.sources, self.tokens)}
        row["data_records_read"] = sum(s.records_read for s in self.sources)
        return row

    def state_dict(self) -> dict:
        return {
            "tokens": list(self.tokens),
            "batches": self.batches,
            "sources": [s.state_dict() for s in self.sources],
        }

    def load_state_dict(self, state: dict) -> None:
        self.tokens, self.batches = list(state["tokens"]), state["batches"]
        for s, st in zip(self.sources, state["sources"], strict=True):
            s.load_state_dict(st)
        log.info(
            "data: stream resumed at %s",
            ", ".join(
                f"{s.name} {s.pos['records']} records into epoch {s.pos['epoch']} ({len(s.rows)} rows buffered)"
                for s in self.sources
            ),
        )


def stream_metrics(loader) -> dict:
    """The per-source token counts (and records read) for a metrics row; {} for a pre-tokenized loader."""
    return loader.metrics() if isinstance(loader, StreamLoader) else {}
