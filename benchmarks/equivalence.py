"""Backend equivalence on CPU: how far each multi-process backend lands from one process.

    python -m benchmarks.equivalence [--out DIR] [--backends ddp fsdp tp ...] [--steps 6]

Trains the same tiny from-scratch Llama (the test suite's shape: hidden 64, 2 layers, 4 heads, 32
tokens, lr 3e-3, cosine, fp32) once in one process and then under each accelerate config, launched
with `accelerate launch --config_file accelerate_configs/<backend>.yaml` as a user would, every run
with the same global batch of 4 (each backend's data-parallel ranks x batch x accumulation). Prints,
per backend, the largest |loss difference| over all steps and the largest |weight difference| in
final/ against the single-process run, and writes OUT/equivalence.json (and
benchmarks/results/equivalence.json). A run directory that already holds final/ is reused, so
`--out` of an earlier call only recomputes the figures; delete a backend's folder to run it again.
The tests (tests/integration/test_distributed.py) assert the same equivalences at rel 1e-5 (losses) and
atol 5e-5 (weights).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file

from benchmarks.common import ROOT, TOKENIZER, machine, save_result, table, train_inprocess

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
ARCH["max_position_embeddings"] = 256

# backend -> (processes, per-rank overrides giving a global batch of 4)
TWO_DP = ["train.batch_size=1", "train.grad_accum=2"]  # 2 data-parallel ranks x 1 x 2
ONE_DP = ["train.batch_size=4", "train.grad_accum=1"]  # tensor parallel alone: one data-parallel rank
BACKENDS = {
    "ddp": (2, TWO_DP),
    "zero2": (2, TWO_DP),
    "zero3_offload": (2, TWO_DP),
    "fsdp": (2, TWO_DP),
    "fsdp_offload": (2, TWO_DP),
    "tp": (2, ONE_DP),
    "fsdp_tp": (4, TWO_DP),  # dp_shard=2 x tp=2
    "hsdp": (4, ["train.batch_size=1", "train.grad_accum=1"]),  # dp_replicate=2 x dp_shard=2
}


def write_recipe(out: Path, steps: int) -> Path:
    raw = {
        "output_dir": str(out / "unused"),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": ARCH},
        "data": {
            "train": str(ROOT / "data/tiny_stories.txt"),
            "format": "text",
            "max_length": 32,
            "max_examples": 200,
            "eval_fraction": 0.05,
        },
        "train": {"lr": 3e-3, "batch_size": 4, "max_steps": steps, "warmup_steps": 2, "scheduler": "cosine"},
        "eval": {"at_start": False, "every_steps": None},
        "checkpoint": {"every_steps": None},
    }
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def losses(run: Path) -> dict[int, float]:
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def compare(run: Path, ref: Path) -> tuple[float, float]:
    """(max |loss diff| over the steps, max |weight diff| over final/'s tensors)."""
    got, want = losses(run), losses(ref)
    if sorted(got) != sorted(want):
        raise SystemExit(f"{run}: logged steps {sorted(got)} != the single-process run's {sorted(want)}")
    loss = max(abs(got[s] - want[s]) for s in want)
    a, b = load_file(run / "final/model.safetensors"), load_file(ref / "final/model.safetensors")
    if a.keys() != b.keys():
        raise SystemExit(f"{run}/final: tensors {sorted(a.keys() ^ b.keys())} differ from the single run's")
    weight = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    return loss, weight


def run_backend(name: str, recipe: Path, out: Path) -> float:
    """Launch one backend as a user would; returns the wall time in seconds (0 if reused)."""
    if (out / "final/model.safetensors").is_file():
        return 0.0
    _, overrides = BACKENDS[name]
    cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / f"{name}.yaml")]
    cmd += ["-m", "training.train", str(recipe), f"output_dir={out}", *overrides]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return time.time() - start


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.equivalence", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-equivalence")
    ap.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(args.out, args.steps)
    single = args.out / "single"
    done = (single / "final/model.safetensors").is_file()
    if not done and train_inprocess(recipe, f"output_dir={single}", *ONE_DP) != 0:
        raise SystemExit("the single-process run failed")
    rows, results = [], []
    for name in args.backends:
        seconds = run_backend(name, recipe, args.out / name)
        loss, weight = compare(args.out / name, single)
        processes = BACKENDS[name][0]
        rows.append([f"{name}.yaml", processes, f"{loss:.1e}", f"{weight:.1e}", round(seconds) or "reused"])
        results.append(
            {"backend": name, "processes": processes, "max_loss_diff": loss, "max_weight_diff": weight}
        )
        print(f"{name}: max |loss diff| {loss:.1e}, max |weight diff| {weight:.1e}", flush=True)
    print(f"\n{args.steps} steps, global batch 4, fp32, vs one process ({machine()}):\n")
    print(table(["config", "processes", "max abs loss diff", "max abs weight diff", "wall s"], rows))
    payload = {"steps": args.steps, "results": results}
    (args.out / "equivalence.json").write_text(json.dumps(payload, indent=2))
    save_result("equivalence", payload)
    return payload


if __name__ == "__main__":
    main()
