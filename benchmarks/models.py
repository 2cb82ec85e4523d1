"""The support matrix, measured: every decoder causal-LM type transformers registers, built tiny from its own
config class, through the same checks, written to docs/models.md.

    python -m benchmarks.models [--types llama,qwen3_moe,...] [--out docs/models.md]

Each type is built tiny from its config class's defaults (training/model/tiny.py: the common size keys
shrunk under each family's own names, lists per layer cut, a family that needs more in its OVERRIDES with the
reason) and goes through the checks of training/planning/support.py (its docstring says what each checks), the
same that `python -m training.support PATH` runs on one checkpoint's config.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import peft
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from benchmarks.common import machine
from training.planning.support import CHECKS, Row, check_type, gguf_architectures

ROOT = Path(__file__).resolve().parents[1]


def causal_lm_types() -> list[str]:

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# how to get one model's row (the README shows an example)
OWN_MODEL = (
    "**Your own model**: `python -m training.support PATH` (a checkpoint directory, its `config.json`, or a hub",
    "name) builds the model tiny from its own config, shrunk as here, and prints its row, each `no` with its",
    "reason, without reading a weight; an image-text model gets its row of the image-text table below. An",
    "example is in the [README](../README.md#will-my-model-work).",
)


def markdown(rows: list[Row], seconds: float) -> str:

    n = len(rows)
    totals = " | ".join(
        f"{sum(r.ok(c) for r in rows)} yes, {sum(r.answered(c) for r in rows)} refused" for c in CHECKS
    )
    lines = [
        "# Supported models, measured",
        "",
        "Written by `python -m benchmarks.models` (the checks: `training/planning/support.py`): every causal-LM type",
        f"transformers registers, built tiny from its own config class. {time.strftime('%Y-%m-%d')}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}; {machine()}; "
        f"{seconds / 60:.1f} min.",
        "",
        "`yes`: the check passed. `no (full loss)`, `no (padded)`, `no (refused)`: the trainer's own answer for",
        "that family, with its reason (it computes the loss from full logits, keeps padded attention, or refuses",
        "`data.packing` before training). `no:` anything else: what failed, as the check saw it. Types that",
        "transformers lists as causal LMs but that are encoder-decoder or image-text composites are checked",
        "the same way, on their language model.",
        "",
        *OWN_MODEL,
        "",
        decoder_summary(rows),
        "",
        "| type | " + " | ".join(CHECKS) + " |",
        "|---|" + "---|" * len(CHECKS),
        f"| **all {n}** | {totals} |",
    ]
    for r in rows:
        cells = [r.cells.get(c, "").replace("|", "/") for c in CHECKS]
        lines.append(f"| {r.model_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def decoder_only(model_type: str) -> bool:
    """Not an encoder-decoder and not a masked-LM encoder (bert, roberta, ...) with a causal head."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return False
    try:
        return not CONFIG_MAPPING[model_type]().is_encoder_decoder
    except Exception:  # noqa: BLE001 (a default config that does not validate: a decoder's composite)
        return True


def decoder_summary(rows: list[Row]) -> str:
    """The decoder-only types that train (LoRA and full) with the chunked loss or the trainer's answer."""
    dec = [r for r in rows if decoder_only(r.model_type)]
    refused = [r for r in dec if r.cells.get("lora", "").startswith("no (refused)")]
    both = [r for r in dec if r.ok("lora") and r.ok("full") and (r.ok("chunked") or r.answered("chunked"))]
    tried = len(dec) - len(refused)
    return (
        f"**Decoder-only types** ({len(dec)} of {len(rows)}: not encoder-decoder, not masked-LM encoders): "
        f"{len(both)} of the {tried} the trainer takes ({100 * len(both) / max(tried, 1):.0f}%) pass LoRA, full "
        f"fine-tuning and the chunked loss (or the trainer's reason for the full loss); {len(refused)} are "
        f"refused before loading, with the reason ({', '.join(r.model_type for r in refused) or 'none'})."
    )


def worker(types: list[str]) -> None:
    """Check `types` in this process, one JSON line each (see `run_isolated`). Its memory is capped at
    WORKER_MEMORY: a type whose config does not shrink fails its checks with MemoryError, quickly."""
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    logging.disable(logging.WARNING)
    known = gguf_architectures()
    for t in types:
        row = check_type(t, known)
        print(ROW_PREFIX + json.dumps({"type": t, "cells": row.cells, "seconds": row.seconds}), flush=True)


ROW_PREFIX = "MATRIX-ROW "
IMAGE_TEXT_SECTION = "\n## Image-text models\n"  # where benchmarks.image_text_models' table begins
WORKER_MEMORY = 12 * 2**30  # address space; a tiny model needs far less (torch maps ~3 GiB at import)


def run_isolated(
    types: list[str], limit_s: float, module: str = "benchmarks.models", checks=CHECKS
) -> list[Row]:
    """Every type checked by worker processes (`python -m module --worker TYPES`), in order: one that crashes
    the process (a native fault) or runs past `limit_s` is a row of its own saying so, and a new worker goes
    on with the rest."""
    rows: list[Row] = []
    while len(rows) < len(types):
        todo = types[len(rows) :]
        argv = [sys.executable, "-m", module, "--worker", ",".join(todo)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + limit_s
        timer = threading.Timer(limit_s, proc.kill)
        timer.start()
        for line in proc.stdout:
            if line.startswith(ROW_PREFIX):
                got = json.loads(line[len(ROW_PREFIX) :])
                rows.append(Row(got["type"], got["cells"], got["seconds"]))
                report(rows[-1], checks)
                timer.cancel()
                deadline = time.monotonic() + limit_s
                timer = threading.Timer(limit_s, proc.kill)
                timer.start()
        timer.cancel()
        proc.wait()
        if len(rows) < len(types):  # the worker died on this type
            why = (
                f"over {limit_s:.0f} s"
                if time.monotonic() >= deadline
                else f"the process died ({proc.returncode})"
            )
            rows.append(Row(types[len(rows)], {c: f"no: {why}" for c in checks}, limit_s))
            report(rows[-1], checks)
    return rows


def report(row: Row, checks=CHECKS) -> None:
    bad = [c for c in checks if not row.ok(c)]
    print(
        f"{row.model_type:28s} {row.seconds:5.1f}s  {'all yes' if not bad else 'no: ' + ', '.join(bad)}",
        flush=True,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="", help="comma-separated model types (default: every causal-LM type)")
    ap.add_argument("--out", default=str(ROOT / "docs/models.md"))
    ap.add_argument("--limit-s", type=float, default=300, help="seconds one type may take")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker.split(","))
    types = [t for t in args.types.split(",") if t] or causal_lm_types()
    start = time.perf_counter()
    rows = run_isolated(types, args.limit_s)
    out = Path(args.out)  # the image-text part (benchmarks.image_text_models) is kept as it is
    kept = out.read_text().partition(IMAGE_TEXT_SECTION)[1:] if out.is_file() else ("", "")
    out.write_text(markdown(rows, time.perf_counter() - start) + "".join(kept))
    old = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else []
    rows_json = [vars(r) for r in rows] + [r for r in old if r.get("part") == "image-text"]
    out.with_suffix(".json").write_text(json.dumps(rows_json, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
