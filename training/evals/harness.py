"""lm-evaluation-harness on a run, a model or an adapter: the library behind `python -m training.evaluate`
(its usage and what it writes are described there) and behind `eval.harness_tasks` after training."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from training.core.errors import RecipeError, UserError
from training.core.fs import write_atomic
from training.core.paths import PACKAGE_DIR
from training.run.rundir import RunDir, resolve_source
from training.run.sources import adapter_base, pretrained_source

log = logging.getLogger("training.evaluate")
TASKS_DIR = PACKAGE_DIR / "eval_tasks"
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
    by_task = json.loads(json.dumps(per_task(results, tasks, limit, source), default=handle_non_serializable))
    for path in [p for p in (run.eval_results if run is not None else None, out) if p is not None]:
        write_results(Path(path), by_task)
    return by_task


def per_task(results: dict, tasks: list[str], limit: int | None, source) -> dict:
    """lm-eval's results as {task: {metrics, n, limit, model, date, samples}} (what the app shows)."""
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
    batch = recipe.eval_batch_size
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
