"""Data preparation benchmark: preprocessing rows/s on 1 process vs every core, and time to the first batch,
streaming vs pre-tokenized (cold cache and warm cache).

    python -m benchmarks.data_prep                  # ~300 MB generated corpus in 8 shards (takes a while)
    python -m benchmarks.data_prep --mb 20          # quicker

The corpus is generated into a temporary directory with data/make_corpus.py's story grammar (one story
per line, .txt shards), tokenized with the bundled SmolLM2 tokenizer as format text, max_length 512.
Prints figures; it is not a timed test. The model step is left out: it is the same for both paths.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import datasets
import torch

from benchmarks.common import machine
from training.config import parse_recipe
from training.data import build_datasets, make_loader, shards
from training.data.formats import record_format
from training.data.pipeline import per_file_raws
from training.data.shards import available_cores
from training.data.streaming import StreamLoader
from training.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def make_corpus(out: Path, mb: float, shards: int, fmt: str) -> list[Path]:
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "data/make_corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    rng = random.Random(0)
    files = []
    per_shard = mb * 1e6 / shards
    for i in range(shards):
        path, size, lines = out / f"shard-{i:03d}.{'txt' if fmt == 'text' else 'jsonl'}", 0, []
        while size < per_shard:
            text = corpus.story(rng)
            lines.append(
                text if fmt == "text" else json.dumps({"instruction": "Tell a story.", "output": text})
            )
            size += len(lines[-1]) + 1
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    return files


FORMAT = {"format": "text"}


def recipe(files, tmp: Path, **data):
    return parse_recipe(
        {
            "output_dir": str(tmp / "run"),
            "model": {"name_or_path": "bundled:smollm2-135m-instruct"},
            "data": {"train": [str(f) for f in files], "max_length": 512, **FORMAT, **data},
            "train": {"batch_size": 8, "max_steps": 1000},
        }
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300, help="corpus size in MB (default 300)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument(
        "--format", choices=["text", "instruction"], default="text", help="instruction: chat template"
    )
    args = ap.parse_args(argv)
    FORMAT["format"] = args.format
    logging.basicConfig(level=logging.WARNING)
    cores = available_cores()
    with tempfile.TemporaryDirectory(prefix="llm-forge-bench-") as tmp:
        tmp = Path(tmp)
        files = make_corpus(tmp, args.mb, args.shards, args.format)
        rows = sum(1 for f in files for _ in f.open())
        tok = load_tokenizer(recipe(files, tmp).model)
        print(
            f"corpus: {args.mb:.0f} MB ({args.format}) in {len(files)} shards, {rows} documents; {cores} cores "
            f"available; {machine()}"
        )
        # both timings start from Arrow files datasets has already converted, and no map result is reused
        per_file_raws(files, record_format(recipe(files, tmp).data), None)
        datasets.disable_caching()
        shards.PARALLEL_MIN_ROWS = (
            0  # the pool even for a small --mb (the pipeline skips it under 20,000 rows)
        )
        built, first = {}, {}
        for procs in sorted({1, cores}):  # each into an empty cache: the cold start of a pre-tokenized run
            start = time.perf_counter()
            ds, _ = build_datasets(
                recipe(files, tmp, num_proc=procs, cache_dir=str(tmp / f"cache{procs}")), tok
            )
            secs = time.perf_counter() - start
            next(iter(make_loader(ds, 8, tok, 0, shuffle=True)))
            built[procs], first[procs] = ds, time.perf_counter() - start
            print(f"preprocess, num_proc={procs}: {secs:.1f} s, {rows / secs:,.0f} rows/s, {len(ds)} blocks")
        if len(built) > 1:
            a, b = built.values()
            print(f"same blocks for 1 and {cores} processes: {a[:]['input_ids'] == b[:]['input_ids']}")

        print(f"time to first batch, pre-tokenized (cold cache, num_proc={cores}): {first[cores]:.1f} s")
        start = time.perf_counter()
        ds, _ = build_datasets(recipe(files, tmp, cache_dir=str(tmp / f"cache{cores}")), tok)
        next(iter(make_loader(ds, 8, tok, 0, shuffle=True)))
        print(f"time to first batch, pre-tokenized (warm cache): {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        next(iter(StreamLoader(recipe(files, tmp, streaming=True), tok, 0, 1, torch.device("cpu"))))
        print(f"time to first batch, streaming: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
