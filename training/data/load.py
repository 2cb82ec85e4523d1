"""Loading: data files (or a hub dataset) -> raw `datasets.Dataset`, every record checked.

Local files are found by name or glob; one split holds one file type (BUILDERS). JSON and JSONL files
are parsed line by line before `datasets` reads them, so a problem is reported with its file and
line; other sources are checked row by row after loading. Every problem is a DataError.
"""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path

import datasets

from training.core.errors import DataError
from training.data import images
from training.data.formats import RecordFormat

# file extension -> the `datasets` builder that reads it
BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}


def expand_files(patterns: list[str], key: str) -> list[Path] | None:
    """Local files matching the patterns, or None if the patterns name a hub dataset."""
    files: list[Path] = []
    for pat in patterns:
        if any(c in pat for c in "*?["):
            matches = sorted(glob.glob(pat))
        else:
            matches = [pat] if Path(pat).exists() else []
        if not matches:
            looks_local = Path(pat).suffix in BUILDERS or "/" not in pat or pat.startswith((".", "/", "~"))
            if looks_local or len(patterns) > 1:
                raise DataError(f"{key}: data file {pat} does not exist")
            return None  # "org/name": a hub dataset
        for m in matches:
            p = Path(m)
            if p.is_dir():
                raise DataError(
                    f"{key}: {p} is a directory; name the data files (globs allowed, e.g. {p}/*.jsonl)"
                )
            if p.suffix not in BUILDERS:
                supported = ", ".join(sorted(BUILDERS))
                raise DataError(f"{key}: {p} has an unsupported extension (use {supported})")
            if p.stat().st_size == 0:
                raise DataError(f"{key}: data file {p} is empty")
            files.append(p)
    return files


def check_json_file(path: Path, fmt: RecordFormat) -> None:
    """Parse a JSON/JSONL file record by record so that errors name the line."""
    n = 0
    for where, rec in json_records(path):
        if (why := fmt.problem(rec)) is not None:
            raise DataError(f"{where}: {why}")
        n += 1
    if n == 0:
        raise DataError(no_records(path))


def no_records(path: Path) -> str:
    if path.suffix == ".json":
        return f"{path}: the JSON list holds no records"
    return f"{path}: no records (the file holds only blank lines)"


def json_records(path: Path):
    """(where, record) for every record of a JSON list or JSONL file; bad JSON and non-UTF-8 named."""
    try:
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of records")
            yield from ((f"{path} record {i}", rec) for i, rec in enumerate(data))
            return
        with path.open(encoding="utf-8", errors="strict") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path} line {lineno}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None


def image_record(rec, fmt: RecordFormat, base: Path, where: str) -> dict:
    """One image-text record normalised (images.normalize) and checked; DataError naming `where`."""
    lf, ck = fmt.name(fmt.list_field), fmt.name(fmt.turn_keys[1])
    out, why = images.normalize(rec, lf, ck, fmt.images, base)
    if why is None and (why := fmt.problem(out if out is not None else rec)) is None:
        return out
    raise DataError(f"{where}: {why}")


def image_records(files: list[Path], fmt: RecordFormat, key: str) -> datasets.Dataset:
    """An image-text split: every record normalised (images.normalize: string contents, the images'
    absolute paths, each image checked) and checked; problems named with file and line."""
    records = []
    for p in files:
        if BUILDERS[p.suffix] != "json":
            raise DataError(f"{key}: {p}: image-text records are read from .jsonl or .json files")
        n = 0
        for where, rec in json_records(p):
            records.append(image_record(rec, fmt, p.parent, where))
            n += 1
        if n == 0:
            raise DataError(no_records(p))
    return datasets.Dataset.from_list(records)


def csv_as_text(path: Path) -> datasets.Features:
    """Read every CSV column as text: "4" is an answer, not an integer."""
    with path.open(encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def load_raw(
    patterns: list[str], fmt: str | RecordFormat, key: str, files: list[Path] | None = None
) -> datasets.Dataset:
    """The split named by `patterns` (`files`: already expanded), every record checked against `fmt`."""
    fmt = fmt if isinstance(fmt, RecordFormat) else RecordFormat(fmt)
    files = expand_files(patterns, key) if files is None else files
    builder = None
    if files is None:
        if fmt.images is not None:
            raise DataError(
                f"{key}: image-text records are read from local .jsonl/.json files, not a hub dataset (yet)"
            )
        try:
            ds = datasets.load_dataset(patterns[0], split="train")
        except Exception as e:  # hub errors come in many types
            first = str(e).splitlines()[0]
            raise DataError(f"{key}: cannot load hub dataset {patterns[0]!r} ({first})") from None
    else:
        builders = {BUILDERS[p.suffix] for p in files}
        if len(builders) > 1:
            kinds = ", ".join(sorted(builders))
            raise DataError(f"{key}: mixes file types ({kinds}); use one type per split")
        builder = builders.pop()
        if fmt.images is not None:
            return image_records(files, fmt, key)
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
            first = str(e).splitlines()[0]
            raise DataError(f"{key}: cannot read {', '.join(map(str, files))} ({first})") from None
    if len(ds) == 0:
        raise DataError(f"{key}: the dataset is empty")
    if builder != "json":  # JSON was checked line by line above; check other sources row by row
        for i, rec in enumerate(ds):
            if (why := fmt.problem(rec)) is not None:
                one_csv = builder == "csv" and len(files) == 1  # line 1 is the header
                where = f"{files[0]} line {i + 2}" if one_csv else f"{key} row {i}"
                raise DataError(f"{where}: {why}")
    return ds
