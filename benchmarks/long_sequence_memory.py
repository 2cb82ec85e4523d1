"""Long sequences on one device: measured peak memory of LoRA steps at the Llama-3-8B shape (width 4096, MLP
14336, vocabulary 128256, random weights) with REDUCED_LAYERS decoder layers, at long data.max_length, with
gradient checkpointing and with and without the tiled MLP (model.tiled_mlp), against the planner's peak for
the same recipe; then the planner's longest max_length for the whole 8B (32 layers) with each switch on one
80 GiB GPU (`python -m training.plan --max-length auto`). Not a test: it prints tables (and writes
benchmarks/results/long_sequence_memory.json).

    python -m benchmarks.long_sequence_memory                       # 16384 tokens, untiled and tiled
    python -m benchmarks.long_sequence_memory --lengths 16384,32768

Each step runs in a fresh process (benchmarks.planner_accuracy.measured_step: two LoRA steps in bf16 weights,
peak resident memory above the process's baseline, glibc's mmap threshold pinned so freed tensors leave at
once, as on a GPU allocator). On a CPU the time is attention's and the head's: minutes per step at 16K.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import machine, save_result, table, tempdir
from benchmarks.planner_accuracy import _run_child, _save_reduced_8b, measured_step

REDUCED_LAYERS = 1


def lora_recipe(model_dir: str, length: int, tiled: bool):
    from training.config import parse_recipe

    return parse_recipe(
        {
            "output_dir": "unused",
            "precision": "bf16",
            "model": {
                "name_or_path": model_dir,
                "dtype": "bfloat16",
                "gradient_checkpointing": True,
                "tiled_mlp": tiled,
            },
            "method": {"type": "lora", "lora": {"r": 16, "target_modules": "all-linear", "dropout": 0.0}},
            "data": {"train": ["unused.jsonl"], "max_length": length},
            "train": {"batch_size": 1},
        }
    )


def child_step(model_dir: str, length: str, tiled: str) -> dict:
    start = time.perf_counter()
    out = measured_step(lora_recipe(model_dir, int(length), tiled == "1"), 1, int(length))
    out["seconds"] = (time.perf_counter() - start) / 2
    return out


def planned_peak(model_dir: str, length: int, tiled: bool, layers: int | None = None) -> float:
    """The planner's peak (bytes) of that recipe on one device (single.yaml)."""
    from transformers import LlamaConfig

    from benchmarks.gpu import LLAMA3_8B
    from training.planning.memory import GiB, estimate

    cfg = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers or REDUCED_LAYERS})
    folder = tempdir("long-seq-plan")
    (folder / "single.yaml").write_text("distributed_type: 'NO'\n")
    plan = estimate(lora_recipe(model_dir, length, tiled), 1, 80, configs_dir=folder, config=cfg)[0]
    return plan.peak_gib * GiB


def longest_table(model_dir: str) -> str:
    from transformers import LlamaConfig

    from benchmarks.gpu import LLAMA3_8B
    from training.core.paths import CONFIGS_DIR
    from training.planning.longest import format_longest, longest_lengths

    recipe = lora_recipe(model_dir, 4096, False)
    rows = longest_lengths(recipe, 1, 80, configs_dir=CONFIGS_DIR, config=LlamaConfig(**LLAMA3_8B))
    return format_longest(rows, recipe, "one 80 GiB GPU (Llama-3-8B, LoRA r16)", None), rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.long_sequence_memory")
    ap.add_argument("--lengths", default="16384", help="comma-separated data.max_length values")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = child_step(*args.child)
        print(json.dumps(result))
        return result
    model_dir = _save_reduced_8b(tempdir("long-seq-8b"))
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for tiled in (False, True):
            step = _run_child(
                model_dir, str(length), "1" if tiled else "0", module="benchmarks.long_sequence_memory"
            )
            planned = planned_peak(model_dir, length, tiled)
            rows.append(
                {
                    "max_length": length,
                    "tiled_mlp": tiled,
                    "planned_gib": planned / 2**30,
                    "measured_gib": step["peak_bytes"] / 2**30,
                    "error_pct": 100 * (planned - step["peak_bytes"]) / step["peak_bytes"],
                    "backward_gib": step["phases"]["backward"] / 2**30,
                    "seconds_per_step": step["seconds"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"## Llama-3-8B shape, {REDUCED_LAYERS} layer(s), LoRA r16, bf16, checkpointing; {machine()}\n")
    print(
        table(
            ["max_length", "tiled MLP", "planned GiB", "measured GiB", "error %", "backward GiB", "s/step"],
            [
                [
                    r["max_length"],
                    "on" if r["tiled_mlp"] else "off",
                    round(r["planned_gib"], 2),
                    round(r["measured_gib"], 2),
                    round(r["error_pct"], 1),
                    round(r["backward_gib"], 2),
                    round(r["seconds_per_step"]),
                ]
                for r in rows
            ],
        )
    )
    text, longest = longest_table(model_dir)
    print("\n" + text)
    result = {"steps": rows, "longest": [r.as_dict() for r in longest], "machine": machine()}
    save_result("long_sequence_memory", result)
    return result


if __name__ == "__main__":
    main()
