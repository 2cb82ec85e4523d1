"""Pipeline-parallel throughput and its bubble: 2 stages, 1, 2 and 4 micro-batches per stage.

    python -m benchmarks.pipeline [--out DIR] [--steps 6] [--layers 8] [--hidden 256] [--length 128]

Trains one from-scratch Llama (untied head, its own 2048-token tokenizer; fp32) with a fixed global batch of 8 rows, first in one
process with one thread (the baseline: one device), then under a 2-stage pipeline (accelerate_configs/
pp.yaml's keys, one thread per stage process) with m = 2, 4 and 8 micro-batches (1, 2 and 4 per stage),
for GPipe and 1F1B, each launched with `accelerate launch` as a user would. Prints real tokens/s over the
steps after the first two, the speed-up over one process, and the bubble (p - 1) / (m + p - 1) that
the schedule predicts: with p stages on p devices the ideal speed-up is p x (1 - bubble). Writes
OUT/pipeline.json and benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT, machine, read_rows, save_result, steady_tokens_per_s, table
from training.launch.checks import bubble_fraction

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
ROWS, STAGES = 8, 2


def recipe(out: Path, args) -> Path:
    raw = {
        "output_dir": str(out / "unused"),
        "seed": 0,
        "model": {
            "train_tokenizer": {"vocab_size": 2048},  # a small head: the layers, split in stages, dominate
            "from_scratch": {
                "hidden_size": args.hidden,
                "intermediate_size": 4 * args.hidden,
                "num_hidden_layers": args.layers,
                "num_attention_heads": 4,
                "max_position_embeddings": args.length,
                "tie_word_embeddings": False,
            },
        },
        "data": {"train": str(ROOT / "data/tiny_stories.txt"), "format": "text", "max_length": args.length},
        "train": {"lr": 1e-3, "batch_size": ROWS, "max_steps": args.steps, "warmup_steps": 0, "log_every": 1},
        "eval": {"at_start": False},
        "checkpoint": {"every_steps": None},
    }
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def pp_config(out: Path, schedule: str, m: int) -> Path:
    raw = yaml.safe_load((ROOT / "accelerate_configs" / "pp.yaml").read_text())
    raw["parallelism_config"].update(
        parallelism_config_pp_schedule=schedule, parallelism_config_pp_microbatches=m
    )
    path = out / f"pp_{schedule}_{m}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(cmd: list[str], run_dir: Path, threads: int) -> float:
    if not (run_dir / "final").is_dir():
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return steady_tokens_per_s(read_rows(run_dir), warmup=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--length", type=int, default=128)
    args = ap.parse_args(argv)
    out = args.out or Path(f"/tmp/llm-forge-pipeline-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    r = recipe(out, args)
    base_dir = out / "single"
    base = run([sys.executable, "-m", "training.train", str(r), f"output_dir={base_dir}"], base_dir, 1)
    rows = [["one process (1 thread)", "-", "-", "-", round(base), 1.0, "-"]]
    results = {"single": base}
    for schedule in ("GPipe", "1F1B"):
        for per_stage in (1, 2, 4):
            m = per_stage * STAGES
            run_dir = out / f"{schedule}-{m}"
            cmd = [ACCELERATE, "launch", "--config_file", str(pp_config(out, schedule, m))]
            cmd += ["-m", "training.train", str(r), f"output_dir={run_dir}"]
            tps = run(cmd, run_dir, 1)
            bubble = bubble_fraction(STAGES, m)
            results[f"{schedule}-{m}"] = tps
            rows.append(
                [
                    f"2 stages, {schedule}",
                    m,
                    per_stage,
                    f"{bubble:.0%}",
                    round(tps),
                    tps / base,
                    STAGES * (1 - bubble),
                ]
            )
            print(rows[-1], flush=True)
    headers = ["run", "micro-batches", "per stage", "bubble", "tokens/s", "speed-up", "ideal p(1-bubble)"]
    print(
        f"\n{machine()}; global batch {ROWS} x {args.length} tokens, {args.layers} layers, hidden {args.hidden}"
    )
    print(table(headers, rows))
    payload = {"args": vars(args) | {"out": str(out)}, "tokens_per_s": results}
    save_result("pipeline", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
