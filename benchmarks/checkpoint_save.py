"""What a checkpoint costs the training loop: synchronous saves vs checkpoint.async_save.

    python -m benchmarks.checkpoint_save [--steps 12] [--every 3] [--staging DIR] [--out DIR]

Full fine-tuning of the bundled SmolLM2-135M-Instruct in fp32 in one process (a checkpoint holds the
weights and AdamW's two moments: about 1.6 GB), on data/alpaca_tiny.jsonl, one run per mode in this
process: `none` (no checkpoints), `sync`, `async` (staged in --staging, default /dev/shm). For each save it
records the seconds the loop was held (training.parallel.checkpoint.Checkpointer.save, timed here: for
async, writing the staged copy plus waiting for the previous save's copy if it is still in flight) and,
for async, the staging alone and the seconds the background thread took to copy and complete it; and the mean step time of the
logged steps (the rows' own times, which leave the saves out) to show what a copy in flight costs the
steps that run beside it. The last save of a run is waited for in both modes (the end of the run), so
only the saves before it are compared. Writes OUT/checkpoint_save.json and
benchmarks/results/checkpoint_save.json, and removes the runs' directories (a few GiB of checkpoints each).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, machine, read_rows, save_result, table, train_inprocess, write_recipe
from training.parallel import checkpoint

MODEL = "bundled:smollm2-135m-instruct"


def recipe(out: Path, mode: str, args) -> Path:
    ckpt = {"every_steps": None} if mode == "none" else {"every_steps": args.every, "keep_last": 2}
    if mode == "async":
        ckpt |= {"async_save": True, "staging_dir": args.staging}
    raw = {
        "output_dir": str(out / mode),
        "seed": 0,
        "precision": "no",
        "model": {"name_or_path": MODEL},
        "method": {"type": "full"},
        "data": {"train": str(ROOT / "data/alpaca_tiny.jsonl"), "format": "instruction", "max_length": 128},
        "train": {"lr": 1e-5, "batch_size": 2, "max_steps": args.steps, "warmup_steps": 0, "log_every": 1},
        "eval": {"at_start": False},
        "checkpoint": ckpt,
    }
    return write_recipe(raw, out, f"{mode}.yaml")


def timed_saves() -> tuple[list, list]:
    """Patch Checkpointer so that every save's loop-held and background seconds are recorded."""
    held, background = [], []
    save, copy = checkpoint.Checkpointer.save, checkpoint.Checkpointer._copy

    def timed_save(self, step, *a, **k):
        began = time.perf_counter()
        try:
            return save(self, step, *a, **k)
        finally:
            held.append((step, time.perf_counter() - began))

    def timed_copy(self, step, state, stage, tmp, staged_s):
        began = time.perf_counter()
        try:
            return copy(self, step, state, stage, tmp, staged_s)
        finally:
            background.append((step, time.perf_counter() - began, staged_s))

    checkpoint.Checkpointer.save, checkpoint.Checkpointer._copy = timed_save, timed_copy
    return held, background


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_save")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--staging", default=None, help="checkpoint.staging_dir (default: /dev/shm)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    out.mkdir(parents=True, exist_ok=True)
    held, background = timed_saves()
    results = {}
    for mode in ("none", "sync", "async"):
        held.clear(), background.clear()
        began = time.perf_counter()
        assert train_inprocess(recipe(out, mode, args)) == 0
        wall = time.perf_counter() - began
        rows = read_rows(out / mode)[1:]  # the first step warms up
        step_s = [r["tokens"] / r["tokens_per_s"] for r in rows]
        beside = {s + 1 for s, _ in held[:-1]} if mode == "async" else set()  # steps run beside a copy
        results[mode] = {
            "wall_s": wall,
            "step_s_mean": statistics.mean(step_s),
            "step_s_beside_copy": statistics.mean(
                [t for r, t in zip(rows, step_s, strict=True) if r["step"] in beside] or [float("nan")]
            ),
            "saves_held_s": [round(t, 3) for _, t in held],
            "saves_background_s": [round(t, 3) for _, t, _ in background],
            "saves_staged_s": [
                round(t, 3) for *_, t in background
            ],  # of the held time: writing the staged copy
        }
        print(mode, json.dumps(results[mode]), flush=True)
    size = sum(f.stat().st_size for f in (out / "sync/checkpoints").glob("step-*/**/*") if f.is_file())
    size /= len(list((out / "sync/checkpoints").glob("step-*")))
    rows = []
    for mode in ("sync", "async"):
        r = results[mode]
        mid = r["saves_held_s"][:-1]  # the last save is waited for at the end of the run, in both modes
        rows.append(
            [
                mode,
                statistics.mean(mid),
                statistics.mean(r["saves_staged_s"][:-1]) if mode == "async" else float("nan"),
                statistics.mean(r["saves_background_s"][:-1]) if mode == "async" else float("nan"),
                r["step_s_mean"],
                r["step_s_beside_copy"],
                r["wall_s"],
            ]
        )
    rows.append(
        [
            "none",
            float("nan"),
            float("nan"),
            float("nan"),
            results["none"]["step_s_mean"],
            float("nan"),
            results["none"]["wall_s"],
        ]
    )
    print(
        f"\n{machine()}; checkpoint {size / 2**30:.2f} GiB, {args.steps} steps, a save every {args.every}\n"
    )
    print(
        table(
            [
                "mode",
                "loop held per save (s)",
                "of which staging (s)",
                "background per save (s)",
                "step (s)",
                "step beside a copy (s)",
                "run wall (s)",
            ],
            rows,
        )
    )
    for mode in ("none", "sync", "async"):  # 4-5 GiB of checkpoints each
        shutil.rmtree(out / mode, ignore_errors=True)
    result = {"checkpoint_gib": size / 2**30, "steps": args.steps, "every": args.every, "modes": results}
    (out / "checkpoint_save.json").write_text(json.dumps(result, indent=2))
    save_result("checkpoint_save", result)
    return result


if __name__ == "__main__":
    main()
