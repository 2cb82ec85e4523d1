"""See the data before training: the first records of data.train as the trainer tokenizes them (the model's
chat template, the recipe's data settings), with the tokens that carry the loss marked, and the token lengths
of the records against data.max_length.

    python -m training.preview RECIPE.yaml [dotted.key=value ...] [--examples 3] [--scan 2000] [--json]
    python -m training.preview RECIPE.yaml --check [--scan 200] [--json]

The examples come from the trainer's own tokenization (training.data.examples.tokenize_split), so what is
shown is what trains: the loss tokens are the ones whose label is kept. The lengths are those of the first
--scan records tokenized without truncation: the share longer than max_length is what data.too_long would
truncate or drop. Supervised formats only (text, instruction, chat and its prompt/completion records, sharegpt); the app's
Configure tab runs this (with --json) for its data preview.

--check reads the first --scan records of every file of data.train and data.eval, as the trainer reads them,
and reports the problems it would refuse them for (a file missing or empty, JSON that does not parse, a record
without the columns or turns data.format needs), naming the file and line, any data format; the app's form
shows them under data.train and data.eval before Start. The trainer checks every record when it loads the data.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

from training.config import load_recipe
from training.core.batch import IGNORE
from training.core.errors import DataError, RecipeError, UserError, cli
from training.data.examples import format_of, tokenize_split
from training.data.formats import RecordFormat, ensure_chat_template
from training.data.load import expand_files, json_records, load_raw, no_records
from training.data.tokenizer import load_tokenizer
from training.launch.confine import Confinement
from training.model.vision import resolve_image_text

SUPERVISED = ("text", "instruction", "chat", "sharegpt")  # chat includes prompt/completion records
UNLIMITED = 1 << 30  # max_length for measuring lengths: nothing is truncated


def segments(ids: list[int], labels: list[int], tokenizer) -> list[dict]:
    """The example's tokens as runs of text, each with whether its tokens carry the loss."""
    out: list[dict] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE) != (labels[start] != IGNORE):
            text = tokenizer.decode(ids[start:i], skip_special_tokens=False)
            out.append({"text": text, "loss": labels[start] != IGNORE, "tokens": i - start})
            start = i
    return out


def lengths_histogram(lengths: list[int], max_length: int, bins: int = 20) -> dict:
    """Counts of token lengths in equal bins up to the longest (or max_length, if longer)."""
    top = max([*lengths, max_length]) if lengths else max_length
    counts, edges = np.histogram(lengths, bins=bins, range=(0, top))
    return {"edges": [int(e) for e in edges], "counts": [int(c) for c in counts]}


def preview(recipe, examples: int = 3, scan: int = 2000) -> dict:
    data = recipe.data
    if data.format not in SUPERVISED or data.streaming or data.is_mixture:
        raise RecipeError(
            f"data.format={data.format}: the preview shows supervised data from files (formats "
            f"{', '.join(SUPERVISED)}), not preference pairs, RL prompts, streams or mixtures"
        )
    tokenizer = load_tokenizer(recipe.model)
    if data.format != "text":
        ensure_chat_template(tokenizer, data)
    raw = load_raw(data.train, format_of(data), "data.train")
    raw = raw.select(range(min(scan, len(raw))))
    # allow_empty: at a short max_length every answer may be cut away; the preview then says so
    shown, _ = tokenize_split(raw.select(range(min(examples, len(raw)))), data, tokenizer, allow_empty=True)
    whole = data.model_copy(update={"max_length": UNLIMITED, "too_long": "truncate"})
    measured, _ = tokenize_split(raw, whole, tokenizer, allow_empty=True)
    lengths = [len(ids) for ids in measured["input_ids"]] if data.format != "text" else []
    rows = [
        {
            "tokens": len(r["input_ids"]),
            "loss_tokens": sum(label != IGNORE for label in r["labels"]),
            "segments": segments(r["input_ids"], r["labels"], tokenizer),
        }
        for r in shown
    ]
    too_long = sum(n > data.max_length for n in lengths)
    return {
        "format": data.format,
        "max_length": data.max_length,
        "examples": rows,
        "scanned": len(raw),
        "tokens": int(sum(lengths)),
        "longer_than_max_length": too_long,
        "share_longer": too_long / len(lengths) if lengths else 0.0,
        "too_long": data.too_long,
        "lengths": lengths_histogram(lengths, data.max_length) if lengths else None,
    }


def check(recipe, records: int = 200) -> dict[str, list[str]]:
    """The problems the trainer would refuse data.train's and data.eval's files for, found in their first
    `records` records: {recipe key: [problem naming the file and line]}, {} when none is found. Records of an
    image-text run are only parsed (their images are checked against the model's processor at training)."""
    data = recipe.data
    try:
        resolved = resolve_image_text(
            recipe
        )  # reads the checkpoint's config (and processor), not its weights
        text_only = not (resolved.image_text_checkpoint or resolved.composes_image_text)
    except (
        UserError,
        OSError,
    ):  # a model it cannot read (the form says so elsewhere): parse the records only
        text_only = False
    fmt = format_of(data) if text_only else None
    sets = [("data.train", s.path) for s in data.sources] + [
        ("data.eval", f) for f in data.eval_sets.values()
    ]
    problems: dict[str, list[str]] = {}
    for key, patterns in sets:
        try:
            for path in expand_files(patterns, key) or []:  # None: a hub dataset, read at training
                if path.suffix in (".json", ".jsonl"):
                    first_records(path, fmt, records)
        except DataError as e:
            problems.setdefault(key, []).append(str(e))
    return problems


def first_records(path: Path, fmt: RecordFormat | None, records: int) -> None:
    """DataError for the first of `path`'s first `records` records that does not parse or that `fmt` refuses."""
    n = 0
    for where, rec in itertools.islice(json_records(path), records):
        if fmt is not None and (why := fmt.problem(rec)) is not None:
            raise DataError(f"{where}: {why}")
        n += 1
    if n == 0:
        raise DataError(no_records(path))


def as_text(out: dict) -> str:
    """The preview for a terminal: loss tokens between [[ ]], then the length figures."""
    lines = []
    for i, ex in enumerate(out["examples"], 1):
        body = "".join(f"[[{s['text']}]]" if s["loss"] else s["text"] for s in ex["segments"])
        lines += [
            f"--- example {i}: {ex['tokens']} tokens, {ex['loss_tokens']} carry the loss ([[...]])",
            body,
        ]
    if out["lengths"]:
        lines.append(
            f"--- {out['scanned']} records, {out['tokens']:,} tokens untruncated; "
            f"{out['longer_than_max_length']} ({out['share_longer']:.1%}) longer than max_length="
            f"{out['max_length']} (data.too_long: {out['too_long']})"
        )
    return "\n".join(lines)


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.preview", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides")
    ap.add_argument("--examples", type=int, default=3, help="records shown (default 3)")
    ap.add_argument("--scan", type=int, default=2000, help="records whose lengths are counted (default 2000)")
    ap.add_argument("--json", action="store_true", help="print JSON (the app reads it)")
    ap.add_argument("--check", action="store_true", help="only check the first --scan records of each file")
    args = ap.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    if (confinement := Confinement.from_env()) is not None:  # run by the app: its workspace's rule
        confinement.check(recipe, args.recipe)
    if args.check:
        problems = check(recipe, max(1, args.scan))
        said = [m if m.startswith(key) else f"{key}: {m}" for key, msgs in problems.items() for m in msgs]
        text = "\n".join(said) or "no problem found"
        print(json.dumps({"problems": problems}, ensure_ascii=False) if args.json else text)
        return 2 if problems and not args.json else 0
    out = preview(recipe, max(1, args.examples), max(1, args.scan))
    print(json.dumps(out, ensure_ascii=False) if args.json else as_text(out))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
