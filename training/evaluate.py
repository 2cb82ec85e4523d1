"""Score a run or a model on benchmarks with EleutherAI's lm-evaluation-harness.

    python -m training.evaluate RUN_OR_MODEL --tasks TASK[,TASK] [--limit N] [--batch-size N]
                                [--dtype auto|float32|bfloat16|float16] [--out FILE]

RUN_OR_MODEL is a run directory (its final/ is scored: a full model, or an adapter on the base it was
trained on), an adapter or model directory, a .gguf file, or a hub/bundled model name
(`bundled:smollm2-135m-instruct`). The harness runs in this process (`lm_eval.simple_evaluate` with its
`HFLM`, which loads an adapter with its `peft=` argument), greedy, with the model's chat template.

Tasks bundled with the repository (training/eval_tasks/, no network needed):
  dates_exact_match   exact match on data/dates/test.jsonl, scored as benchmarks/finetune_task.py does
Any other lm-eval task name works too where its dataset can be downloaded or is in the HF cache.

Results go to RUN/eval_results.json for a run (one entry per task, merged with earlier ones; the app
shows them), to --out if given, and to stdout. `eval.harness_tasks: [..]` in a recipe runs this after
training.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from training.core.errors import UserError, cli
from training.evals.harness import DTYPES, evaluate, parse_tasks, summary
from training.run.rundir import resolve_source


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.evaluate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    ap.add_argument("source", metavar="RUN_OR_MODEL")
    ap.add_argument("--tasks", required=True, help="comma-separated task names")
    ap.add_argument("--limit", type=int, default=None, help="score only the first N examples of each task")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 on CPU, auto on GPU")
    ap.add_argument("--out", type=Path, default=None, help="also write the results JSON here")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit: {args.limit}; give a positive number of examples")
    if args.batch_size < 1:
        raise UserError(f"--batch-size: {args.batch_size}; give a positive number")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tasks = parse_tasks(args.tasks)
    resolve_source(args.source)  # a missing run or model is refused before the harness is imported
    by_task = evaluate(
        args.source, tasks, limit=args.limit, batch_size=args.batch_size, dtype=args.dtype, out=args.out
    )
    print(summary(by_task), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
