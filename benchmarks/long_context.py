"""Long-context benchmark: peak memory per process vs sequence length, with and without sequence
parallelism, and the longest sequence that trains under a memory cap. Not a test: it prints a table
(and writes benchmarks/results/long_context.json).

    python -m benchmarks.long_context                                  # CPU: 2 processes over gloo
    python -m benchmarks.long_context --lengths 1024,2048,4096,8192 --cap-gib 1.5
    python -m benchmarks.long_context --num-processes 8 --lengths 32768,65536,131072   # a GPU node

A tiny-width, many-layer Llama (hidden 64, 4 heads, 24 layers, a 512-token byte-level BPE vocabulary so
that the logits do not dominate) pretrains on the bundled stories for a few steps at each
data.max_length, launched exactly as a user would (`accelerate launch --config_file ... -m
training.train`), once per accelerate config:
  zero2.yaml       without sequence parallelism: each process holds whole sequences (batch 1 each)
  sp_ulysses.yaml  DeepSpeed Ulysses: each sequence split over all the processes (batch 1 per group)
Both shard the optimizer the same way (ZeRO-2), so the difference per process is the activations.
Memory is the trainer's peak_mem_gb of the main process: the CUDA allocator's peak on GPUs, the
process's peak RSS on CPU (which includes the ~1 GiB of libraries every process holds; the growth over
the shortest length is the part the sequence costs). A run that fails (out of memory) shows as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, machine, save_result, table, write_recipe

CONFIGS = {"without SP (zero2.yaml)": "zero2.yaml", "DeepSpeed Ulysses (sp_ulysses.yaml)": "sp_ulysses.yaml"}


def recipe(folder: Path, layers: int, hidden: int, heads: int, steps: int, longest: int) -> Path:
    return write_recipe(
        {
            "output_dir": str(folder / "unused"),
            "seed": 0,
            "model": {
                "train_tokenizer": {"vocab_size": 512},
                "from_scratch": {
                    "hidden_size": hidden,
                    "intermediate_size": 2 * hidden,
                    "num_hidden_layers": layers,
                    "num_attention_heads": heads,
                    "max_position_embeddings": max(longest, 2048),
                },
                "attn_implementation": "sdpa",
            },
            "data": {"train": str(ROOT / "data/stories/train.txt"), "format": "text"},
            "train": {"lr": 1e-3, "batch_size": 1, "max_steps": steps, "warmup_steps": 0, "log_every": 1},
            "eval": {"at_start": False},
        },
        folder,
    )


def run(config: str, recipe_path: Path, out: Path, length: int, processes: int) -> dict:
    """One launch; its peak memory, last step's throughput and loss, or why it failed."""
    accelerate = Path(sys.executable).with_name("accelerate")
    argv = [str(accelerate), "launch", "--config_file", str(ROOT / "accelerate_configs" / config)]
    argv += ["--num_processes", str(processes), "-m", "training.train", str(recipe_path)]
    argv += [f"output_dir={out}", f"data.max_length={length}"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=os.environ.copy())
    metrics = out / "metrics.jsonl"
    rows = (
        [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        if metrics.exists()
        else []
    )
    if proc.returncode != 0 or not rows:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail}"}
    return {
        "ok": True,
        "peak_gib": max(r["peak_mem_gb"] for r in rows),
        "tokens_per_s": rows[-1]["tokens_per_s"],
        "loss": rows[-1]["loss"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.long_context", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--lengths", default="1024,2048,4096,8192", help="data.max_length values, ascending")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--num-processes", type=int, default=2, help="processes (GPUs); sp_size stays the file's 2"
    )
    ap.add_argument(
        "--cap-gib", type=float, default=None, help="memory cap per process for 'longest that fits'"
    )
    args = ap.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    results: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        folder = Path(tmp)
        path = recipe(folder, args.layers, args.hidden, args.heads, args.steps, lengths[-1])
        for label, config in CONFIGS.items():
            results[label] = {}
            for n in lengths:
                r = run(config, path, folder / f"{config}-{n}", n, args.num_processes)
                results[label][n] = r
                shown = f"{r['peak_gib']:.2f} GiB, {r['tokens_per_s']:.0f} tok/s" if r["ok"] else r["error"]
                print(f"{label}, max_length {n}: {shown}", flush=True)

    base = {
        label: next((r["peak_gib"] for r in rs.values() if r["ok"]), None) for label, rs in results.items()
    }
    headers = ["max_length"]
    for label in CONFIGS:
        headers += [f"{label}: peak GiB/process", "growth GiB", "tokens/s"]
    rows = []
    for n in lengths:
        row = [n]
        for label in CONFIGS:
            r = results[label][n]
            row += (
                [r["peak_gib"], r["peak_gib"] - base[label], r["tokens_per_s"]]
                if r["ok"]
                else ["failed", "", ""]
            )
        rows.append(row)
    print(
        f"\n{machine()}; {args.num_processes} processes; Llama {args.layers} layers x hidden {args.hidden}, "
        f"{args.heads} heads, vocabulary 512, batch 1 per process / per Ulysses group, fp32\n"
    )
    print(table(headers, rows))
    longest = {}
    if args.cap_gib is not None:
        for label in CONFIGS:
            fits = [
                n
                for n in lengths
                if results[label][n]["ok"] and results[label][n]["peak_gib"] <= args.cap_gib
            ]
            longest[label] = max(fits, default=None)
            print(f"longest sequence under {args.cap_gib:g} GiB per process, {label}: {longest[label]}")
    payload = {
        "args": vars(args),
        "results": {label: {str(n): r for n, r in rs.items()} for label, rs in results.items()},
        "longest_under_cap": longest,
    }
    print(f"\nwritten: {save_result('long_context', payload)}")
    return payload


if __name__ == "__main__":
    main()
