"""The support matrix's image-text part: every type transformers registers as image-text-to-text, built tiny
from its own config class with a processor built here (no download), trained by the trainer itself.

    python -m benchmarks.image_text_models [--types idefics3,qwen2_5_vl,...] [--out docs/models.md]

Each type is built tiny (training/model/tiny.py: the config shrunk as the text matrix shrinks it, in every
sub-config, the vision encoder to a 32 x 32 picture; training/model/tiny_processor.py: the type's own processor
class with the bundled SmolLM2 tokenizer) and goes through the checks of training/tools/image_text_support.py
(its docstring says what each checks: LoRA and full fine-tuning through training.train, and the reload of
final/), the same that `python -m training.support PATH` runs on one image-text checkpoint's config. A type
whose processor cannot be built so is `no: needs a processor we cannot build offline: <why>`; a refusal the
trainer gives (exit 2 with its reason) is `no (refused): <reason>`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import resource
import time
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from benchmarks import models
from benchmarks.common import machine
from benchmarks.models import ROOT, Row
from training.tools.image_text_support import CHECKS, check_type


def image_text_types() -> list[str]:
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def worker(types: list[str]) -> None:
    """Check `types` in this process, one JSON line each (benchmarks.models.run_isolated reads them), its
    memory capped as the text matrix's workers are."""
    resource.setrlimit(resource.RLIMIT_AS, (models.WORKER_MEMORY, models.WORKER_MEMORY))
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["LLM_FORGE_PRECISION_AUTO"] = "no"  # fp32 on every CPU, as the tests run
    for t in types:
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's progress: not a row
            row = check_type(t)
        print(
            models.ROW_PREFIX + json.dumps({"type": t, "cells": row.cells, "seconds": row.seconds}),
            flush=True,
        )


def markdown(rows: list[Row], seconds: float) -> str:
    totals = " | ".join(
        f"{sum(r.ok(c) for r in rows)} yes, {sum(r.answered(c) for r in rows)} refused" for c in CHECKS
    )
    lines = [
        models.IMAGE_TEXT_SECTION.strip(),
        "",
        "Written by `python -m benchmarks.image_text_models` (the checks: `training/tools/image_text_support.py`):",
        "every type transformers registers as image-text-to-text, built tiny from its own config class with a",
        f"processor built offline, trained by `training.train`. {time.strftime('%Y-%m-%d')}, transformers "
        f"{transformers.__version__}, torch {torch.__version__}; {machine()}; {seconds / 60:.1f} min.",
        "",
        "`yes`: the check passed. `no (refused)`: the trainer stopped before training (exit 2), with its reason.",
        "`no:` anything else, as the check saw it; `needs a processor we cannot build offline` names what is",
        "missing (a processor class transformers registers for no such type, a library, a part the tiny build",
        "cannot make). torchvision is installed (`make install`; training/core/torchvision_ops.py).",
        "",
        "| type | " + " | ".join(CHECKS) + " |",
        "|---|" + "---|" * len(CHECKS),
        f"| **all {len(rows)}** | {totals} |",
    ]
    for r in rows:
        lines.append(
            f"| {r.model_type} | " + " | ".join(r.cells.get(c, "").replace("|", "/") for c in CHECKS) + " |"
        )
    return "\n".join(lines) + "\n"


def write(out: Path, rows: list[Row], seconds: float) -> None:
    """The image-text section of `out` (docs/models.md) replaced, the text matrix before it kept; the rows
    in its .json beside the text matrix's, marked "part": "image-text"."""
    text = out.read_text().partition(models.IMAGE_TEXT_SECTION)[0] if out.is_file() else ""
    out.write_text(text.rstrip("\n") + "\n\n" + markdown(rows, seconds))
    js = out.with_suffix(".json")
    old = [r for r in json.loads(js.read_text()) if r.get("part") != "image-text"] if js.is_file() else []
    js.write_text(json.dumps(old + [{**vars(r), "part": "image-text"} for r in rows], indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.image_text_models", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--types", default="", help="comma-separated model types (default: every image-text type)"
    )
    ap.add_argument("--out", default=str(ROOT / "docs/models.md"))
    ap.add_argument("--limit-s", type=float, default=240, help="seconds one type may take")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker.split(","))
    types = [t for t in args.types.split(",") if t] or image_text_types()
    start = time.perf_counter()
    rows = models.run_isolated(types, args.limit_s, module="benchmarks.image_text_models", checks=CHECKS)
    write(Path(args.out), rows, time.perf_counter() - start)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
