"""RL prompt records generated offline by reasoning-gym: data.train (or data.eval) = reasoning_gym:TASK.

Each split is reasoning_gym.create_dataset(TASK, size=, seed=, **config) (data.reasoning_gym: size and seed
for data.train, eval_size and eval_seed for the held-out sets, config the task's own settings), one record
per entry (a held-out set of the training task leaves out the training questions, which a task with few
distinct questions repeats across seeds):
  {"prompt": entry's question (a chat after the worked example's turn where data.reasoning_gym.example is set),
   "answer": entry's answer,
   "reasoning_gym": JSON of {"task": TASK, "config": {...}, "entry": the whole entry, metadata included}}
so that the `reasoning_gym` reward scores a completion with the task's own score_answer(answer, entry), and
exact_match or math_equal can read `answer`. An unknown task (with the close names), a setting the task does
not have (with the ones it has) or a value its config refuses is a RecipeError naming the recipe key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import logging
from collections.abc import Callable

import datasets

from training.config import REASONING_GYM, ReasoningGymSection, WorkedExample
from training.core.errors import RecipeError

log = logging.getLogger(__name__)

INSTALL = "pip install 'llm-forge[reasoning]' (or pip install reasoning-gym)"
LIST_TASKS = "python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))'"


def library():
    """The reasoning_gym package (RecipeError with the install command where it is missing)."""
    try:
        import reasoning_gym  # here: an optional dependency, imported by the runs that name it
    except ImportError:
        raise RecipeError(f"{REASONING_GYM}TASK needs the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


def task_config(task: str, key: str) -> type:
    """The config dataclass of `task` (RecipeError naming `key` and the close task names if unknown)."""
    registry = library().factory.DATASETS
    if task not in registry:
        close = difflib.get_close_matches(task, sorted(registry), n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"the tasks: {LIST_TASKS}"
        raise RecipeError(f"{key}: {REASONING_GYM}{task} is not a reasoning-gym task ({hint})")
    return registry[task][1]


def check_config(task: str, config: dict, key: str) -> None:
    """RecipeError naming data.reasoning_gym.config.KEY for a setting `task` does not have."""
    settings = [f.name for f in dataclasses.fields(task_config(task, key)) if f.name not in ("size", "seed")]
    for name in sorted(config):
        if name not in settings:
            raise RecipeError(
                f"data.reasoning_gym.config.{name}: not a setting of {task} (it takes {', '.join(settings)})"
            )


def generate(task: str, config: dict, size: int, seed: int, key: str) -> list[dict]:
    """The entries of reasoning_gym.create_dataset(task, size=, seed=, **config), checked first."""
    check_config(task, config, key)
    try:
        made = library().create_dataset(task, size=size, seed=seed, **config)
        return [made[i] for i in range(size)]
    except Exception as e:  # noqa: BLE001 (a task's config refuses values with asserts, type and value errors)
        raise RecipeError(
            f"data.reasoning_gym.config: {task} refuses {json.dumps(config)} ({type(e).__name__}: {e})"
        ) from None


def record(task: str, config: dict, entry: dict, example: WorkedExample | None = None) -> dict:
    """One prompt record: the question (after the worked example's turn where there is one: a chat), the answer,
    and what the reward needs to score (task, config, entry)."""
    made = {"task": task, "config": config, "entry": entry}
    prompt = entry["question"]
    if example:
        turn = [
            {"role": "user", "content": example.question},
            {"role": "assistant", "content": example.answer},
        ]
        prompt = [*turn, {"role": "user", "content": prompt}]
    return {
        "prompt": prompt,
        "answer": entry["answer"],
        "reasoning_gym": json.dumps(made, default=str),
    }


def load_task(
    task: str, settings: ReasoningGymSection, held_out: bool, key: str, seen: set[str] = frozenset()
) -> datasets.Dataset:
    """The records of one split (held-out sets: eval_size prompts of eval_seed, less the questions in `seen`,
    the training prompts: a task with few distinct questions repeats them across seeds), fingerprinted by
    what made them (the data cache is keyed by it)."""
    size, seed = (settings.eval_size, settings.eval_seed) if held_out else (settings.size, settings.seed)
    entries = [e for e in generate(task, settings.config, size, seed, key) if e["question"] not in seen]
    if not entries:
        raise RecipeError(
            f"{key}: every one of the {size} held-out prompts of {REASONING_GYM}{task} is a training prompt too "
            "(the task has few distinct questions with data.reasoning_gym.config); widen the config or leave "
            "data.eval out"
        )
    if len(entries) < size:
        log.info(
            "%s: %d of %d held-out prompts are training prompts too: left out", key, size - len(entries), size
        )
    version = getattr(library(), "__version__", "")
    example = settings.example.model_dump() if settings.example else None
    made = json.dumps([task, settings.config, size, seed, version, example], sort_keys=True, default=str)
    rows = [record(task, settings.config, e, settings.example) for e in entries]
    table = datasets.table.InMemoryTable.from_pylist(rows)
    return datasets.Dataset(table, fingerprint=hashlib.sha256(made.encode()).hexdigest()[:16])


def questions(ds: datasets.Dataset) -> set[str]:
    """The questions of a split load_task made (its prompts are chats where there is a worked example)."""
    return {json.loads(made)["entry"]["question"] for made in ds["reasoning_gym"]}


@functools.lru_cache(maxsize=64)
def _scorer(task: str, config: str) -> Callable:
    return library().create_dataset(task, **json.loads(config)).score_answer


def scorer(made: dict) -> Callable:
    """score_answer(answer, entry) of the task and config a record was made with (one instance kept per
    task and config)."""
    return _scorer(made["task"], json.dumps(made["config"], sort_keys=True))
