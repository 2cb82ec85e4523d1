"""Parallel preprocessing, cached per shard: pre-tokenized data on every core, and a new shard costs only itself.

A split is cut into units: each data file (a shard), and files longer than UNIT_ROWS records into pieces
of UNIT_ROWS. Each unit is tokenized on its own (tokenize_split per unit for chat-like formats: every
step is per record; for format text, each document's ids, the EOS appended) in a pool of data.num_proc
forked processes, and saved as its own cache entry, keyed by the file's bytes, the row range, the
tokenizer and the options that change tokenizing (cache.py; written atomically). The units are then
concatenated in file order, and text documents cut into blocks 1000 documents at a time, exactly as
text_blocks does on the whole split: the result is the serial result, token for token, row for row.
Adding a shard adds units; the other units' entries are reused. The main process shows one bar (rows,
rows/s, ETA) over all units.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import tempfile
from pathlib import Path

import datasets
from tqdm.auto import tqdm

from training.config import DataSection
from training.core.errors import DataError
from training.core.fs import atomic_dir
from training.data.cache import cache_dir, cache_key, load_or_build, tokenizer_fingerprint
from training.data.examples import tokenize_split
from training.data.formats import record_format
from training.data.images import images_digest
from training.data.tokenize import PROGRESS_MIN_ROWS

log = logging.getLogger(__name__)

UNIT_ROWS = 50_000  # records per unit of work (and per cache entry) within one file
PARALLEL_MIN_ROWS = 20_000  # fewer rows than this are tokenized in this process (a pool costs seconds)
TEXT_CHUNK = 1000  # text_blocks cuts blocks 1000 documents at a time
CHUNK_STATS = ("examples", "truncated", "dropped_too_long", "dropped_cut_images", "dropped_no_labels")

_JOB: dict = {}  # what forked workers read: units, data section, tokenizer, output directory


def plain_worker() -> None:
    """Initializer of forked pool workers: SIGTERM ends them again. A fork inherits the parent's handlers,
    and the trainer's GracefulStop only notes a SIGTERM, so Pool.terminate() would wait for ever."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _tokenize_unit(i: int) -> tuple[int, dict]:
    raw, start, end, key = _JOB["units"][i]
    data, tokenizer = _JOB["data"], _JOB["tokenizer"]
    piece = raw if (start, end) == (0, len(raw)) else raw.select(range(start, end))

    def build():
        if data.format == "text":
            eos, column = tokenizer.eos_token_id, record_format(data).name("text")
            if eos is None:
                raise DataError(
                    "model.tokenizer: the tokenizer has no EOS token to separate documents (format: text)"
                )

            def doc_ids(batch):
                texts = batch[column]
                enc = tokenizer([t for t in texts if t.strip()], add_special_tokens=False)["input_ids"]
                it = iter(enc)
                return {"input_ids": [next(it) + [eos] if t.strip() else [] for t in texts]}

            out = piece.map(doc_ids, batched=True, batch_size=1000, remove_columns=piece.column_names)
            return {"rows": out}, {"examples": len(piece)}
        out, st = tokenize_split(piece, data, tokenizer, _JOB["key"], allow_empty=True)
        return {"rows": out}, st

    if key is not None:
        _, stats, _ = load_or_build(_JOB["shards"], key, build)
    else:  # no cache: through a temporary directory, so that workers can hand back Arrow tables
        splits, stats = build()
        with atomic_dir(Path(_JOB["tmp"]) / str(i)) as tmp:
            splits["rows"].save_to_disk(str(tmp))
    return end - start, stats


def units_of(raws: list[tuple[datasets.Dataset, str | None]], data: DataSection, tokenizer) -> list[tuple]:
    """(raw, start, end, cache key or None): `raws` pairs each dataset with its file's digest (None: not
    cacheable alone, e.g. after a random eval split)."""
    options = data.model_dump(
        mode="json",
        include={
            "format",
            "columns",
            "system_prompt",
            "max_length",
            "too_long",
            "train_on",
            "reasoning",
            "chat_template_kwargs",
        },
    )  # the chat template itself (data.chat_template's text, or the tokenizer's) is in the tokenizer's key
    if data.format == "text":
        options = {k: options[k] for k in ("format", "columns")}  # ids per document: no length involved
    if data.images is not None:  # how many tokens an image becomes, and the images' contents, below
        options["images"] = dataclasses.asdict(data.images)
    tok = tokenizer_fingerprint(tokenizer)
    units = []
    for raw, digest in raws:
        for start in range(0, len(raw), UNIT_ROWS):
            end = min(len(raw), start + UNIT_ROWS)
            key = None
            if digest is not None and data.cache:
                unit = [digest, start, end]
                if data.images is not None:
                    unit.append(images_digest(p for row in raw[start:end]["images"] for p in row))
                key = cache_key({"unit": unit, "tokenizer": tok, "data": options})
            units.append((raw, start, end, key))
    return units


def tokenize_parallel(
    raws: list[tuple[datasets.Dataset, str | None]], data: DataSection, tokenizer, key: str
) -> tuple[datasets.Dataset, dict]:
    """What tokenize_split(concatenation of raws) returns, built unit by unit on data.num_proc processes."""
    units = units_of(raws, data, tokenizer)
    total = sum(end - start for _, start, end, _ in units)
    procs = min(data.num_proc or available_cores(), len(units))
    with tempfile.TemporaryDirectory(prefix="llm-forge-units-") as tmp:
        _JOB.update(
            units=units, data=data, tokenizer=tokenizer, key=key, tmp=tmp, shards=cache_dir(data) / "units"
        )
        main = os.environ.get("LOCAL_RANK", "0") == "0"
        bar = tqdm(
            total=total, unit="rows", desc=f"tokenizing {key}", disable=not main or total < PROGRESS_MIN_ROWS
        )
        stats: dict = {}
        if procs > 1 and total >= PARALLEL_MIN_ROWS:
            log.info("tokenizing %s: %d rows in %d units on %d processes", key, total, len(units), procs)
            with multiprocessing.get_context("fork").Pool(procs, initializer=plain_worker) as pool:
                results = list(_progress(pool.imap(_tokenize_unit, range(len(units))), bar))
        else:
            results = list(_progress(map(_tokenize_unit, range(len(units))), bar))
        bar.close()
        for _, st in results:
            for k in CHUNK_STATS:
                if k in st:
                    stats[k] = stats.get(k, 0) + st[k]
        parts = []
        for i, (_, _, _, ukey) in enumerate(units):
            if ukey is not None:
                parts.append(datasets.load_from_disk(str(_JOB["shards"] / ukey / "rows")))
            else:
                parts.append(datasets.load_from_disk(str(Path(tmp) / str(i)), keep_in_memory=True))
        _JOB.clear()
        out = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if data.format == "text":
        block = data.max_length

        def to_blocks(batch):
            ids = [t for doc in batch["input_ids"] for t in doc]
            blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
            return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

        out = out.map(to_blocks, batched=True, batch_size=TEXT_CHUNK, remove_columns=out.column_names)
    if len(out) == 0:
        raise DataError(
            f"{key}: no usable examples after tokenizing (text shorter than one block of "
            f"max_length={data.max_length}, every answer truncated away, or every example longer than "
            f"max_length with too_long=drop)"
        )
    return out, stats


def _progress(results, bar):
    for n, st in results:
        bar.update(n)
        yield n, st


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
