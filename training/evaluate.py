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
import json
import logging
import sys
import time
from pathlib import Path

from training.errors import RecipeError, UserError, cli
from training.fs import write_atomic
from training.rundir import RunDir, resolve_source

log = logging.getLogger("training.evaluate")
TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
BUNDLED_TASKS = ("dates_exact_match",)
DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_tasks(text: str | list[str]) -> list[str]:
    names = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise UserError("--tasks: give at least one task name")
    return names


def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def check_tasks(names: list[str], manager) -> None:
    """Refuse unknown task names before any model is loaded."""
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(
            f"--tasks: unknown lm-eval task {', '.join(unknown)}; bundled tasks (no network): "
            f"{', '.join(BUNDLED_TASKS)} (training/eval_tasks/); `python -m lm_eval ls tasks` lists the others"
        )


def model_args(source: str | Path, dtype: str) -> tuple[dict, RunDir | None]:
    """HFLM keyword arguments for what `source` points at, and the run it belongs to (if any)."""
    from training.models import adapter_base, pretrained_source

    found = resolve_source(source)
    if found.kind == "checkpoint":
        raise UserError(
            f"{source}: the run has no final/ yet (newest complete checkpoint {found.path}); "
            "evaluate it once training has finished"
        )
    args: dict = {"dtype": dtype, "add_bos_token": False}  # the chat template adds what it needs
    if found.kind == "adapter":
        args.update(pretrained=adapter_base(found), peft=str(found.path), tokenizer=str(found.path))
    else:
        args["pretrained"] = pretrained_source(str(found.path))
    return args, found.run


def evaluate(
    source: str | Path,
    tasks: list[str],
    *,
    limit: int | None = None,
    batch_size: int = 8,
    dtype: str | None = None,
    out: Path | None = None,
    manager=None,
) -> dict:
    """Run the harness; returns {task: {metrics, n, samples, ...}} and writes the results file."""
    import torch

    manager = manager or task_manager()
    check_tasks(tasks, manager)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("auto" if device == "cuda" else "float32")
    kwargs, run = model_args(source, dtype)

    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import handle_non_serializable

    try:
        lm = HFLM(batch_size=batch_size, device=device, **kwargs)
    except OSError as e:  # e.g. a name that is neither on disk nor reachable on the hub (offline)
        raise UserError(
            f"{source}: no such run or model directory, and it cannot be loaded as a hub model: {e}"
        ) from None
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        limit=limit,
        task_manager=manager,
        apply_chat_template=bool(getattr(lm.tokenizer, "chat_template", None)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    by_task = {}
    for name in tasks:
        metrics = {k: v for k, v in results["results"].get(name, {}).items() if k != "alias"}
        by_task[name] = {
            "metrics": metrics,
            "n": results.get("n-samples", {}).get(name, {}).get("effective"),
            "limit": limit,
            "model": str(source),
            "date": when,
            "samples": [
                {
                    "doc_id": s["doc_id"],
                    "target": s["target"],
                    "answer": s["filtered_resps"][0] if s["filtered_resps"] else None,
                    **{k: s[k] for k in metrics if k in s},
                }
                for s in results.get("samples", {}).get(name, [])
            ],
        }
    by_task = json.loads(json.dumps(by_task, default=handle_non_serializable))
    for path in [p for p in (run.eval_results if run is not None else None, out) if p is not None]:
        write_results(Path(path), by_task)
    return by_task


def write_results(path: Path, by_task: dict) -> None:
    """Merge this evaluation's tasks into the results file (other tasks' earlier results stay)."""
    try:
        previous = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        previous = {}
    previous.setdefault("tasks", {}).update(by_task)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(previous, indent=2) + "\n")
    log.info("wrote %s", path)


def check_harness_tasks(recipe) -> None:
    """Before training: every name in `eval.harness_tasks` is a known task (RecipeError if not)."""
    if recipe.eval.harness_tasks:
        try:
            check_tasks(recipe.eval.harness_tasks, task_manager())
        except UserError as e:
            raise RecipeError(f"eval.harness_tasks: {str(e).removeprefix('--tasks: ')}") from None


def evaluate_after_training(recipe) -> None:
    """After training, on the main process: score final/ on `eval.harness_tasks`.

    A failure is logged, not raised: the trained model is saved and the command to retry is printed.
    """
    tasks = recipe.eval.harness_tasks
    if not tasks:
        return
    root = RunDir(recipe.output_dir).root
    batch = recipe.eval.batch_size or recipe.train.batch_size
    try:
        by_task = evaluate(root, tasks, batch_size=batch)
        log.info("lm-eval harness:\n%s", summary(by_task))
    except Exception as e:  # noqa: BLE001 - training succeeded; its result must not be lost to an eval error
        log.error(
            "lm-eval harness failed (%s: %s); the model is saved. Retry with: "
            "python -m training.evaluate %s --tasks %s",
            type(e).__name__,
            e,
            root,
            ",".join(tasks),
        )


def summary(by_task: dict) -> str:
    lines = []
    for name, r in by_task.items():
        shown = ", ".join(
            f"{k.split(',')[0]} {v:.4f}"
            for k, v in r["metrics"].items()
            if isinstance(v, float) and "stderr" not in k
        )
        lines.append(f"{name}: {shown} (n={r['n']})")
    return "\n".join(lines)


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
