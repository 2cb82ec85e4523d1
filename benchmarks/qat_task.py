"""Quantization-aware training against post-training quantization, on the date task.

    python -m benchmarks.qat_task [--steps 60] [--lr 5e-5] [--eval-n 100] [--scheme int8-int4] [--out runs/bench-qat]

Full fine-tuning of the bundled SmolLM2-135M-Instruct on data/dates twice, with the real CLI: plain, and
with `method.qat` (torchao fake-quantized linear layers). Each final/ is scored on held-out prompts
(greedy, exact match, as benchmarks.finetune_task) in float and quantized on load with transformers'
TorchAoConfig of the same scheme: the plain fine-tune quantized is post-training quantization (PTQ), the
QAT one quantized is what QAT trained for. Prints a table, writes OUT/results.json. Not a test: minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import yaml

from benchmarks import finetune_task
from benchmarks.common import machine
from benchmarks.finetune_task import ROOT, exact_match, held_out, train
from training.config.schema import QAT
from training.run.rundir import RunDir


def recipe_dict(out: Path, steps: int, lr: float, qat: QAT | None) -> dict:
    """benchmarks.finetune_task's date-task recipe, full fine-tuning (with method.qat), batch 8, no checkpoints."""
    method = {"type": "full"} | ({"qat": qat.model_dump()} if qat else {})
    return finetune_task.recipe_dict(method, out, steps, lr, 8) | {"checkpoint": {"every_steps": None}}


def scheme_config(qat: QAT):
    """transformers' TorchAoConfig of the scheme (the output head left in float, as QAT leaves it)."""
    from transformers import TorchAoConfig

    from training.model.qat import base_config

    return TorchAoConfig(base_config(qat), modules_to_not_convert=["lm_head"])


def score(final: Path, rows: list[dict], qat: QAT | None) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"quantization_config": scheme_config(qat)} if qat else {}
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32, **kwargs)
    return exact_match(model, AutoTokenizer.from_pretrained(final), rows)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--eval-n", type=int, default=100)
    ap.add_argument("--scheme", default="int8-int4", choices=["int8-int4", "int4", "int8"])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "runs/bench-qat"))
    args = ap.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    qat = QAT(scheme=args.scheme, group_size=args.group_size)
    rows = held_out(args.eval_n)
    results = {
        "machine": machine(),
        "steps": args.steps,
        "lr": args.lr,
        "scheme": qat.model_dump(),
        "runs": {},
    }
    for name, with_qat in (("full", None), ("full+qat", qat)):
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        recipe = out / "recipe.yaml"
        recipe.write_text(
            yaml.safe_dump(recipe_dict(out / "run", args.steps, args.lr, with_qat), sort_keys=False)
        )
        wall = train(recipe, out / "train.log")
        final = RunDir(out / "run").final
        t = time.time()
        as_float, quantized = score(final, rows, None), score(final, rows, qat)
        results["runs"][name] = {"train_wall_s": round(wall, 1), "float": as_float, "quantized": quantized}
        print(
            f"[{name}] trained in {wall:.0f} s; exact match {as_float:.1%} in float, {quantized:.1%} quantized "
            f"({args.scheme}, groups of {args.group_size}; scored in {time.time() - t:.0f} s)",
            flush=True,
        )
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| fine-tune | float | quantized |\n|---|---|---|")
    for name, r in results["runs"].items():
        print(f"| {name} | {r['float']:.1%} | {r['quantized']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
