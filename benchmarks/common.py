"""Helpers shared by the benchmarks: recipes in temp dirs, in-process training runs, tables, JSON results."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import yaml

from training.core.machine import cpu_description
from training.run.metrics import read_metrics
from training.run.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# as in tests/conftest.py: LLM_FORGE_TOKENIZER names a directory of the same tokenizer where the bundled package
# is not installed
TOKENIZER = os.environ.get("LLM_FORGE_TOKENIZER", "bundled:smollm2-135m-instruct")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def machine() -> str:
    """The machine every printed or saved figure was measured on: the GPU, or the CPU's model, cores,
    clock and matmul flags (training.core.machine.cpu_description: figures from one CPU kind do not hold
    on another) with torch's thread count."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"CPU {cpu_description()}; {torch.get_num_threads()} threads, torch {torch.__version__}"


def write_recipe(raw: dict, folder: Path, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def train_inprocess(recipe: Path, *overrides: str) -> int:
    """training.train.main in this process, resetting accelerate's singletons afterwards."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from training.train import main

    try:
        return main([str(recipe), *overrides])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()


def read_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(RunDir(run_dir).metrics) if "loss" in r]


def steady_tokens_per_s(rows: list[dict], warmup: int) -> float:
    """Real tokens over wall time of the steps after `warmup` (each row: tokens and its step time)."""
    rows = rows[warmup:]
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in rows)
    return tokens / seconds


def table(headers: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "date": time.strftime("%Y-%m-%d"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path


def tempdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"llm-forge-{prefix}-"))


def policy_parser(doc: str, max_new_tokens: int) -> argparse.ArgumentParser:
    """The command line of a held-out scorer: an optional run whose final/ holds a LoRA adapter, and the reply
    budget."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument(
        "run", nargs="?", help="a run directory whose final/ holds a LoRA adapter (default: the base)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    return ap


def bundled_policy(run: str | None):
    """(model, tokenizer): the bundled SmolLM2-135M-Instruct in fp32, with `run`'s final/ adapter (plain peft) when
    given, in eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.run.sources import pretrained_source

    base = pretrained_source("bundled:smollm2-135m-instruct")  # the converted bundled model's directory
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if run:
        model = PeftModel.from_pretrained(model, Path(run) / "final")
    return model.eval(), tokenizer
