"""On-disk cache of the tokenized (and packed) datasets.

The key is a hash of everything that changes the result: the bytes of every data file (or a hub
dataset's fingerprint), the tokenizer (vocabulary, merges, special tokens, chat template), the data
section of the recipe (format, column mapping, max_length, too_long, packing, system prompt, train_on,
reasoning, chat template keyword arguments, split)
and the pipeline version. A hit loads memory-mapped Arrow files and skips all preprocessing. The
entry appears atomically (fs.atomic_dir) under a file lock, so concurrent launches never see half an
entry; under `accelerate launch` train.py already lets the main process build first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import datasets
from filelock import FileLock

from training.config import DataSection
from training.core.fs import atomic_dir, cache_root, file_digest

PIPELINE_VERSION = 3  # bump whenever tokenizing/packing code changes its output
STATS = "stats.json"  # written last into an entry: {split: stats} plus the list of splits


def cache_dir(data: DataSection) -> Path:
    """data.cache_dir, or `data/` under the cache root."""
    return Path(data.cache_dir).expanduser() if data.cache_dir else cache_root() / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h = hashlib.sha256()
    h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    h.update(
        json.dumps(
            [
                tokenizer.chat_template,
                sorted(map(str, tokenizer.all_special_tokens)),
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                type(tokenizer).__name__,
            ]
        ).encode()
    )
    return h.hexdigest()


def source_fingerprint(
    files: list[Path] | None, patterns: list[str], loaded: datasets.Dataset | None = None
) -> list:
    if files is None:  # a hub dataset: datasets' own fingerprint of what it downloaded
        return [patterns, getattr(loaded, "_fingerprint", None)]
    return [[str(p), file_digest(p)] for p in files]


def cache_key(parts: dict) -> str:
    blob = json.dumps({"version": PIPELINE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_or_build(
    directory: Path, key: str, build: Callable[[], tuple[dict, dict]]
) -> tuple[dict, dict, bool]:
    """({split: Dataset}, stats, hit) for the entry `key` in `directory`.

    `build()` returns ({split: Dataset}, stats) and runs only on a miss.
    """
    entry = directory / key
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if (entry / STATS).is_file():
            stats = json.loads((entry / STATS).read_text())
            splits = {name: datasets.load_from_disk(str(entry / name)) for name in stats["splits"]}
            return splits, stats, True
        splits, stats = build()
        stats = {**stats, "splits": sorted(splits)}
        with atomic_dir(entry) as tmp:
            for name, ds in splits.items():
                ds.save_to_disk(str(tmp / name))
            (tmp / STATS).write_text(json.dumps(stats, indent=1))
        # memory-mapped, like a hit
        splits = {name: datasets.load_from_disk(str(entry / name)) for name in splits}
        return splits, stats, False
