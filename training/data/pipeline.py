"""build_datasets: the recipe's data section -> tokenized (and packed) train/eval datasets.

load (files or hub -> checked records) -> split off eval -> tokenize -> pack -> stats, the whole of
it skipped on a cache hit (the key is computed from the inputs before anything is built).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerBase

from training.config import DataSection, Recipe
from training.core.errors import DataError
from training.core.fs import file_digest
from training.data.cache import cache_dir, cache_key, load_or_build, source_fingerprint, tokenizer_fingerprint
from training.data.examples import format_of
from training.data.formats import ensure_chat_template
from training.data.images import images_digest, processor_of
from training.data.load import BUILDERS, expand_files, load_raw
from training.data.loader import make_loader
from training.data.packing import pack_dataset, packing_efficiency
from training.data.preference import is_preference, make_preference_loader
from training.data.prompts import make_prompt_loader
from training.data.scale import GROUPING_PAYS, padding_efficiencies
from training.data.shards import tokenize_parallel
from training.data.streaming import StreamLoader, stream_files
from training.data.tokenize import progress

log = logging.getLogger(__name__)


def finish_split(
    ds: datasets.Dataset, data: DataSection, stats: dict, key: str
) -> tuple[datasets.Dataset, dict]:
    """Count the tokens, pack if data.packing, and complete the split's stats."""
    tokens = sum(len(x) for x in ds["input_ids"])
    stats.update(kept=len(ds), tokens=tokens)
    if "row" in ds.column_names:  # preference rows, tokenized unit by unit: index them over the split
        ds = ds.remove_columns("row").add_column("row", list(range(len(ds))))
    if data.packing:
        with progress(len(ds)):
            ds = pack_dataset(ds, data.max_length, desc=f"packing {key}")
        stats["packing_efficiency"] = packing_efficiency(ds, data.max_length)
    stats["rows"] = len(ds)
    return ds, stats


def per_file_raws(files: list[Path], fmt, limit: int | None) -> list[tuple[datasets.Dataset, str]]:
    """Each training file loaded and checked on its own, with its digest (the first `limit` records)."""
    kinds = {BUILDERS[p.suffix] for p in files}
    if len(kinds) > 1:
        raise DataError(f"data.train: mixes file types ({', '.join(sorted(kinds))}); use one type per split")
    raws = []
    for p in files:
        if limit is not None and limit <= 0:
            break
        raw = load_raw([str(p)], fmt, "data.train", [p])
        if limit is not None:
            raw = raw.select(range(min(limit, len(raw))))
            limit -= len(raw)
        raws.append((raw, file_digest(p)))
    return raws


def describe(key: str, data: DataSection, stats: dict) -> str:
    """The start-up log line for one split."""
    if data.format == "text":
        return f"{key}: {stats['examples']} documents -> {stats['rows']} blocks of {data.max_length} tokens"
    kept = stats.get("kept", stats["rows"])
    line = f"{key}: {stats['examples']} examples"
    if kept != stats["examples"]:
        line += f", {kept} kept"
    line += f", {stats.get('tokens', '?')} tokens"
    if "packing_efficiency" in stats:
        line += (
            f" -> {stats['rows']} packed rows of max_length={data.max_length}, "
            f"packing efficiency {100 * stats['packing_efficiency']:.1f}% (real tokens / token slots)"
        )
    if stats.get("truncated"):
        line += f"; {stats['truncated']} truncated to max_length={data.max_length}"
    if stats.get("dropped_too_long"):
        line += f"; {stats['dropped_too_long']} dropped as longer than max_length={data.max_length}"
    if stats.get("dropped_cut_images"):
        line += f"; {stats['dropped_cut_images']} dropped as max_length={data.max_length} cut into an image"
    if stats.get("dropped_no_labels"):
        line += f"; {stats['dropped_no_labels']} dropped with no assistant token left to learn"
    return line


def eval_split_names(data) -> dict[str, str]:
    """{split name in the cache: held-out set name}: {"eval": "eval"} for a plain data.eval or
    eval_fraction, {"eval.NAME": NAME} for named sets."""
    if isinstance(data.eval, dict):
        return {f"eval.{n}": n for n in data.eval}
    return {"eval": "eval"} if data.eval or data.eval_fraction > 0 else {}


@dataclass
class Sources:
    """Where each split's records come from: expanded files (None for a hub dataset), the recipe's
    patterns, and hub datasets loaded up front (datasets fingerprints those itself)."""

    fmt: object
    train_files: list | None
    held_out: dict  # split -> the recipe's pattern of a held-out set
    files: dict  # split -> expanded files, or None for a hub dataset
    patterns: dict  # split -> the recipe's pattern
    preloaded: dict  # split -> hub dataset

    @classmethod
    def find(cls, data: DataSection, fmt, streamed: bool) -> Sources:
        train_files = [] if streamed else expand_files(data.train, "data.train")
        held_out = {
            split: data.eval_sets[n] for split, n in eval_split_names(data).items() if n in data.eval_sets
        }
        files = {"train": train_files} | {
            split: expand_files(p, f"data.{split}") for split, p in held_out.items()
        }
        patterns = {"train": data.train} | held_out
        preloaded = {
            split: load_raw(patterns[split], fmt, f"data.{split}")
            for split, found in files.items()
            if found is None and not (split == "train" and streamed)
        }
        return cls(fmt, train_files, held_out, files, patterns, preloaded)

    def load(self, name: str) -> datasets.Dataset:
        if name in self.preloaded:
            return self.preloaded[name]
        return load_raw(self.patterns[name], self.fmt, f"data.{name}", self.files[name])


def build_datasets(
    recipe: Recipe, tokenizer: PreTrainedTokenizerBase
) -> tuple[datasets.Dataset | None, dict[str, datasets.Dataset]]:
    """(train, {held-out set name: eval dataset}), from the cache when the same inputs were built before.

    The held-out sets are data.eval's names ({"eval": ...} for a plain list or eval_fraction; {} without
    held-out data). Streamed training data (data.streaming, or a mixture) is not built here: train is
    None and training/data/streaming.py reads it on the fly; the eval sets are built as usual."""
    data = recipe.data
    fmt = format_of(data, recipe.rl.columns() if recipe.rl else ())
    if data.format != "text":
        ensure_chat_template(tokenizer, data)  # before fingerprinting: the template is part of the cache key
    streamed = data.streaming or data.is_mixture
    if streamed:  # read later, window by window; check now that every source's shards are there
        for i, src in enumerate(data.sources):
            stream_files(src, f"data.train[{i}].path" if data.is_mixture else "data.train")
        if not data.eval:
            return None, {}
    src = Sources.find(data, fmt, streamed)

    def build():
        return build_splits(recipe, tokenizer, src, streamed)

    if data.cache:
        key = cache_key(split_fingerprints(recipe, tokenizer, src))
        where = cache_dir(data)
        splits, stats, hit = load_or_build(where, key, build)
        log.info("data cache %s: %s", "hit, preprocessing skipped" if hit else "written", where / key)
    else:
        splits, stats = build()
    for name in splits:
        log.info(describe(f"data.{name}", data, stats[name]))
    return splits.get("train"), {name: splits[split] for split, name in eval_split_names(data).items()}


def build_splits(recipe: Recipe, tokenizer, src: Sources, streamed: bool) -> tuple[dict, dict]:
    """Every split tokenized (per file, each cached on its own by shards.py, unless the split is random
    (eval_fraction) or a hub dataset's): ({split: dataset}, {split: stats})."""
    data = recipe.data
    per_file = src.train_files is not None and not streamed and not (data.eval_fraction > 0 and not data.eval)
    train_raws = per_file_raws(src.train_files, src.fmt, data.max_examples) if per_file else None
    train_raw = None if streamed or per_file else src.load("train")
    if data.max_examples and train_raw is not None:
        train_raw = train_raw.select(range(min(data.max_examples, len(train_raw))))
    raws = {split: [(src.load(split), None)] for split in src.held_out}
    if not data.eval and data.eval_fraction > 0:
        split = train_raw.train_test_split(test_size=data.eval_fraction, seed=recipe.seed)
        train_raw, raws["eval"] = split["train"], [(split["test"], None)]
    if train_raws is None and train_raw is not None:
        train_raws = [(train_raw, None)]
    if train_raws is not None:
        raws = {"train": train_raws} | raws
    splits, stats = {}, {}
    for name, units in raws.items():
        key = f"data.{name}"
        ds, st = tokenize_parallel(units, data, tokenizer, key)
        splits[name], stats[name] = finish_split(ds, data, st, key)
    return splits, stats


def split_fingerprints(recipe: Recipe, tokenizer, src: Sources) -> dict:
    """Everything the built splits depend on: the sources' contents, the tokenizer, the data settings."""
    data = recipe.data
    return {
        "train": source_fingerprint(src.train_files, data.train, src.preloaded.get("train")),
        "eval": None,  # a plain data.eval overrides it below, so that its caches stay valid
        **{
            split: source_fingerprint(src.files[split], src.held_out[split], src.preloaded.get(split))
            for split in src.held_out
        },
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data": data.model_dump(
            mode="json",
            exclude={
                "train",
                "eval",
                "cache",
                "cache_dir",
                "num_proc",
                "streaming",
                "stream_window",
                "packed_batch",
            },
        ),
        "seed": recipe.seed if data.eval_fraction > 0 and not data.eval else None,
    } | ({"images": images_fingerprint(data, src)} if data.images is not None else {})


def images_fingerprint(data, src: Sources) -> list:
    """An image-text run's image tokens (a checkpoint's: with its processor's settings, which decide what each
    picture becomes) and the contents of every image its splits name."""
    names = ["train", *src.held_out]
    paths = [p for name in names for row in src.load(name)["images"] for p in row]
    settings = processor_of(data.images).to_json_string() if data.images.processor else None
    return [dataclasses.asdict(data.images), settings, images_digest(paths)]


def group_by_length(recipe: Recipe, train_ds, window: int) -> bool:
    """train.group_by_length, with `auto` (the default) decided from the data: length-grouped batches where
    random ones would compute under GROUPING_PAYS of the grouped ones' real tokens (spread-out chat or
    instruction lengths), said in the log; random batches where lengths are alike (and for packed rows or
    pretraining text, where rows are full)."""
    choice = recipe.train.group_by_length
    if choice != "auto":
        return choice
    if recipe.data.packing or recipe.data.format == "text":
        return False
    found = padding_efficiencies(train_ds, recipe.train.batch_size, recipe.seed, window)
    if found is None or found[0] > GROUPING_PAYS * found[1]:
        return False
    log.info(
        "data: length-grouped batches (train.group_by_length: auto): %.2f real tokens per computed token "
        "instead of %.2f in random batches; train.group_by_length: false keeps the random order",
        found[1],
        found[0],
    )
    return True


def examples_per_row(ds: datasets.Dataset) -> float:
    """A packed split's examples per row (each packed example's position ids restart at 0)."""
    flat = pc.list_flatten(ds.with_format("arrow")["position_ids"])
    return pc.sum(pc.equal(flat, 0)).as_py() / max(1, len(ds))


def packed_rows(batch_size: int, ds, unit: str) -> int:
    """Rows per micro-batch: `batch_size`, except for packed rows counted in examples (data.packed_batch), where
    it is the rows that hold about `batch_size` examples at the split's examples per row (at least one)."""
    if unit == "rows" or ds is None or "position_ids" not in ds.column_names:
        return batch_size
    return max(1, round(batch_size / max(examples_per_row(ds), 1e-9)))


def train_loader(
    recipe: Recipe,
    train_ds,
    tokenizer,
    dp_rank: int,
    dp_size: int,
    device,
    padding_free: bool,
    packed_batch: str = "rows",
):
    """The train loader of the data's shape: a stream (data.streaming or a mixture: read on the fly, its
    position checkpointed; this data-parallel rank's share), preference pairs (two sequences per example,
    never packed), or rows (padded, or packed and padding-free where the attention allows it; `packed_batch`:
    what train.batch_size counts of packed rows, see packed_rows)."""
    t = recipe.train
    if train_ds is None:
        return StreamLoader(recipe, tokenizer, dp_rank, dp_size, device, padding_free=padding_free)
    if is_preference(recipe.data):
        return make_preference_loader(train_ds, t.batch_size, tokenizer, recipe.seed, shuffle=True)
    if recipe.data.format == "prompts":
        # rl.num_iterations: each step's global window of prompts comes once per num_iterations steps
        window, repeat = t.batch_size * dp_size * t.grad_accum, recipe.rl.num_iterations
        return make_prompt_loader(train_ds, t.batch_size, tokenizer, recipe.seed, True, window, repeat)
    rows = packed_rows(t.batch_size, train_ds, packed_batch)
    if "position_ids" in train_ds.column_names:
        log.info(
            "data.packing: a micro-batch is %d packed row(s) of up to %d tokens, about %.0f examples "
            "(train.batch_size=%d counts %s: data.packed_batch)",
            rows,
            recipe.data.max_length,
            rows * examples_per_row(train_ds),
            t.batch_size,
            packed_batch,
        )
    window = rows * dp_size * t.grad_accum
    return make_loader(
        train_ds,
        rows,
        tokenizer,
        recipe.seed,
        True,
        padding_free,
        group_by_length=group_by_length(recipe, train_ds, window),
        images=recipe.data.images,
        group_size=window,
    )


def eval_loader(
    recipe: Recipe, ds, batch_size: int, tokenizer, padding_free: bool, packed_batch: str = "rows"
):
    """A held-out set's loader, in order."""
    if is_preference(recipe.data):
        return make_preference_loader(ds, batch_size, tokenizer, recipe.seed, shuffle=False)
    if recipe.data.format == "prompts":
        return make_prompt_loader(ds, batch_size, tokenizer, recipe.seed, shuffle=False)
    return make_loader(
        ds,
        packed_rows(batch_size, ds, packed_batch),
        tokenizer,
        recipe.seed,
        shuffle=False,
        padding_free=padding_free,
        images=recipe.data.images,
    )
