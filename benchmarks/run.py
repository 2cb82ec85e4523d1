"""`make bench`: every benchmark that can run here, each printing its table and writing JSON under
benchmarks/results/ (CPU: ours vs transformers Trainer, packing, planner accuracy; GPU ones skip without
CUDA). The SmolLM2 fine-tuning task (15+ min) runs on its own: python -m benchmarks.finetune_task.

    python -m benchmarks.run [--skip vs_trainer,packing,planner_accuracy,gpu]
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import gpu, packing, planner_accuracy, vs_trainer
from benchmarks.common import machine, save_result, table

BENCHMARKS = {
    "vs_trainer": vs_trainer.main,
    "packing": packing.main,
    "planner_accuracy": planner_accuracy.main,
    "gpu": gpu.main,
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run")
    ap.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    skip = set(filter(None, ap.parse_args(argv).skip.split(",")))
    summary = []
    for name, fn in BENCHMARKS.items():
        if name in skip:
            continue
        print(f"\n=== {name} ===\n", flush=True)
        start = time.time()
        result = fn([])
        summary.append([name, round(time.time() - start, 1), json.dumps(_headline(name, result))])
    print(f"\n=== summary ({machine()}) ===\n")
    print(table(["benchmark", "seconds", "headline"], summary))
    save_result(
        "summary", {"runs": [dict(zip(("benchmark", "seconds", "headline"), row)) for row in summary]}
    )


def _headline(name: str, r: dict | None) -> dict:
    if r is None:
        return {"see": "table above"}
    if name == "vs_trainer":
        return {"speedup_best": round(r.get("speedup_best", float("nan")), 2), **r["tokens_per_s"]}
    if name == "packing":
        return {k: round(v, 1) for k, v in r["tokens_per_s"].items()}
    if name == "planner_accuracy":
        return {
            "model_states_exact": r["model_states_exact"],
            "max_activation_error_pct": round(r["max_activation_error_pct"], 2),
            "max_gpu_peak_error_pct": r["max_gpu_peak_error_pct"],
            "max_reduced_8b_peak_error_pct": r.get("max_reduced_8b_peak_error_pct"),
        }
    return (
        r
        if "skipped" in r
        else {c["case"]: {k: c.get(k) for k in ("tokens_per_s", "mfu", "peak_mem_gib")} for c in r["cases"]}
    )


if __name__ == "__main__":
    main()
