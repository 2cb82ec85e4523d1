"""Pretraining-scale numbers before the first step: tokens in the corpus (counted, or estimated from a
timed sample for streams and before preprocessing), tokens per step, steps per epoch, and how long
preprocessing will take. Logged at start-up (train.py) and printed by the planner (plan.py)."""

from __future__ import annotations

import itertools
import json
import time

import datasets
import numpy as np
import pyarrow.compute as pc

from training.config import Recipe
from training.data.examples import format_of, tokenize_split
from training.data.formats import ensure_chat_template
from training.data.load import expand_files, image_record, json_records
from training.data.shards import available_cores
from training.data.streaming import STREAM_SUFFIXES, read_window

SAMPLE_RECORDS = 200


def sample_rate(recipe: Recipe, tokenizer) -> dict | None:
    """Tokenize the first records of the first .jsonl/.txt shard of each source, timed: total corpus bytes,
    tokens per byte and seconds per byte (one process), or None when no shard can be sampled."""
    data, fmt = recipe.data, format_of(recipe.data)
    if data.format != "text":
        ensure_chat_template(tokenizer, data)
    total = sample_bytes = sample_tokens = 0
    seconds = 0.0
    for i, src in enumerate(data.sources):
        files = expand_files(src.path, f"data.train[{i}].path" if data.is_mixture else "data.train")
        if files is None:
            return None  # a hub dataset: its size is unknown before download
        total += sum(p.stat().st_size for p in files)
        lines = [p for p in files if p.suffix in STREAM_SUFFIXES]
        if not lines:
            continue
        if (
            data.images is not None
        ):  # image-text records, normalised (images.normalize) as training reads them
            found = list(itertools.islice(json_records(lines[0]), SAMPLE_RECORDS))
            records = [r for _, r in found]
            start = time.perf_counter()
            ds = datasets.Dataset.from_list([image_record(r, fmt, lines[0].parent, w) for w, r in found])
        else:
            pos = {"file": 0, "cookie": 0, "line": 0, "records": 0}
            records, _ = read_window(lines[:1], fmt, pos, SAMPLE_RECORDS)
            if not records:
                continue
            start = time.perf_counter()
            ds = datasets.Dataset.from_list([fmt.arrow_safe(r) for r in records])
        out, _ = tokenize_split(ds, data, tokenizer, allow_empty=True)
        seconds += time.perf_counter() - start
        if lines[0].suffix == ".jsonl":
            sample_bytes += sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in records)
        else:
            sample_bytes += sum(len(r["text"].encode()) + 1 for r in records)
        sample_tokens += int(pc.sum(pc.list_value_length(out.data.column("input_ids"))).as_py() or 0)
    if not sample_bytes:
        return None
    return {
        "bytes": total,
        "tokens_per_byte": sample_tokens / sample_bytes,
        "s_per_byte": seconds / sample_bytes,
    }


def counted_tokens(ds: datasets.Dataset) -> int:
    return int(pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0)


def padding_efficiencies(
    ds: datasets.Dataset, batch_size: int, seed: int, group_size: int | None = None
) -> tuple[float, float] | None:
    """For unpacked examples: the real tokens per computed token of one epoch of batches padded to their
    longest, in random order and in the loader's length-grouped order (grouped in `group_size`, default
    the batch); None for preference pairs or too few examples to tell."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    if "input_ids" not in ds.column_names:  # preference pairs: two sequences per example
        return None
    lengths = pc.list_value_length(ds.data.column("input_ids")).to_numpy()
    group = group_size or batch_size
    if len(lengths) < 2 * group:
        return None

    def efficiency(order) -> float:  # real tokens / (each batch's longest x its size), vectorised
        ordered = lengths[np.asarray(order)]
        starts = np.arange(0, len(ordered), batch_size)
        sizes = np.diff(np.append(starts, len(ordered)))
        return float(ordered.sum() / (np.maximum.reduceat(ordered, starts) * sizes).sum())

    g = torch.Generator().manual_seed(seed)
    random = efficiency(torch.randperm(len(lengths), generator=g).numpy())
    grouped = efficiency(get_length_grouped_indices(lengths.tolist(), group, generator=g))
    return random, grouped


GROUPING_PAYS = 0.75  # group when random batches compute at most this share of the grouped ones' real tokens


def padding_hint(ds: datasets.Dataset, batch_size: int, seed: int) -> str | None:
    """For unpacked examples batched in random order (train.group_by_length: false): the hint to group or
    pack when that would save at least a quarter of the compute; else None."""
    found = padding_efficiencies(ds, batch_size, seed)
    if found is None or found[0] > GROUPING_PAYS * found[1]:
        return None
    random, grouped = found
    return (
        f"data: random batches of {batch_size} are {random:.2f} real tokens per computed token (padding to "
        f"the longest); train.group_by_length: true would make it {grouped:.2f}, data.packing: true ~1.0"
    )


def human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def rl_scale_lines(recipe: Recipe, world: int, total_steps: int | None, train_ds) -> list[str]:
    """Online RL's start-up lines, in prompts and generations: what a step draws, the generation budget, and
    how much of the prompt file the run goes through (each batch of rollouts trains rl.num_iterations steps)."""
    rl, t = recipe.rl, recipe.train
    prompts = t.batch_size * world * t.grad_accum
    completions = prompts * rl.num_generations
    what = (
        f"episodes of up to {rl.max_turns} replies and {rl.max_new_tokens} tokens after the prompt"
        if rl.episodes
        else f"completions of at most {rl.max_new_tokens} tokens"
    )
    if rl.episodes and rl.max_turns is None:  # a verifiers environment: its own turns
        what = f"episodes of the environment's own turns, at most {rl.max_new_tokens} tokens a reply"
    lines = [
        f"data scale: {prompts} prompts per step ({t.batch_size} x {world} rank(s) x {t.grad_accum} accumulation) "
        f"x {rl.num_generations} generations = {completions} {what}: a generation budget of "
        f"{human(completions * rl.max_new_tokens)} tokens per sampling step"
    ]
    if train_ds is None:
        return lines
    corpus, mu = len(train_ds), rl.num_iterations
    reuse = f", each batch of rollouts trained {mu} steps" if mu > 1 else ""
    lines.append(
        f"data scale: {corpus} prompts in the corpus (counted), about {max(1, round(corpus * mu / prompts))} "
        f"steps per epoch of prompts{reuse}"
    )
    if total_steps:
        drawn = -(-total_steps // mu) * prompts
        lines.append(
            f"data scale: {total_steps} steps sample {drawn} prompts ({drawn * rl.num_generations} generations) "
            f"= {drawn / corpus:.2f} epochs of prompts"
        )
    return lines


def scale_lines(
    recipe: Recipe, tokenizer, world: int, total_steps: int | None = None, train_ds=None
) -> list[str]:
    """The start-up lines. `train_ds`: the pre-tokenized train split (exact count), else a sample estimate.
    Online RL counts prompts and generations (rl_scale_lines), not tokens."""
    if recipe.rl is not None:
        return rl_scale_lines(recipe, world, total_steps, train_ds)
    data, t = recipe.data, recipe.train
    per_step = t.batch_size * world * t.grad_accum * data.max_length
    bound = "" if data.format == "text" or data.packing else "at most "
    lines = [
        f"data scale: {bound}{human(per_step)} tokens per step ({t.batch_size} x {world} rank(s) x "
        f"{t.grad_accum} accumulation x max_length {data.max_length})"
    ]
    procs = data.num_proc or available_cores()
    if train_ds is not None:
        corpus, how = counted_tokens(train_ds), "counted"
        rate = None
    else:
        rate = sample_rate(recipe, tokenizer)
        corpus = rate["bytes"] * rate["tokens_per_byte"] if rate else None
        how = f"estimated from a {SAMPLE_RECORDS}-record sample"
    if corpus:
        lines.append(
            f"data scale: {human(corpus)} tokens in the corpus ({how}), about "
            f"{max(1, round(corpus / per_step))} steps per epoch"
        )
    if total_steps:
        epochs = f" = {total_steps * per_step / corpus:.2f} epochs" if corpus else ""
        lines.append(f"data scale: {total_steps} steps train {human(total_steps * per_step)} tokens{epochs}")
    if train_ds is not None and data.format != "text" and not data.packing and t.group_by_length is False:
        hint = padding_hint(train_ds, t.batch_size, recipe.seed)
        if hint:
            lines.append(hint)
    if rate:
        secs = rate["s_per_byte"] * rate["bytes"]
        what = "tokenizing on the fly" if data.streaming or data.is_mixture else "preprocessing"
        lines.append(
            f"data scale: {what} {human(rate['bytes'] / 1e6 * 1e6)}B of shards takes ~{duration(secs)} on one "
            f"process, ~{duration(secs / procs)} on {procs} (timed sample; "
            f"{human(rate['tokens_per_byte'] / rate['s_per_byte'])} tokens/s per process)"
        )
    return lines
