"""File-system helpers: the cache root, file digests, and the one way anything is written atomically.

The rule: a file or directory that someone may read after a crash (a checkpoint, `final/`, an
export, a cache entry, the run's config/status) is written under a temporary name next to its
destination, flushed, and renamed over it. A reader sees the old complete thing or the new
complete thing, never half of one. Temporary names start with ".tmp-" so they are easy to spot
and to sweep.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """Where converted models, trained tokenizers, tokenized data and the measured CPU matmul ceiling are
    cached: $LLM_FORGE_CACHE, else llm-forge/ under $XDG_CACHE_HOME (~/.cache when unset)."""
    if root := os.environ.get("LLM_FORGE_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-forge"


def read_json_object(path: Path) -> dict:
    """A cache file's JSON object; {} where there is none yet, or it is unreadable or not an object (the caller
    measures again and rewrites it)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (best effort: some file systems refuse to open directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file so that readers see either its old or its new content, whole."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(path: Path, *, replace: bool = True) -> Iterator[Path]:
    """Fill a temporary directory beside `path`; on success it becomes `path` in one rename.

        with atomic_dir(run / "final") as tmp:
            model.save_pretrained(tmp)

    If the block raises, the temporary directory is removed and `path` is untouched. An existing
    `path` is replaced (moved aside, then deleted after the rename) unless `replace=False`, in
    which case it is an error for it to exist.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(tmp)
    if path.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(path)
        old = path.with_name(f".old-{path.name}.{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    fsync_dir(path.parent)


def sweep_temporaries(directory: Path) -> None:
    """Remove what killed writers left behind in `directory` (.tmp-* and .old-* entries)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for junk in [*directory.glob(".tmp-*"), *directory.glob(".old-*")]:
        if junk.is_dir():
            shutil.rmtree(junk, ignore_errors=True)
        else:
            junk.unlink(missing_ok=True)
