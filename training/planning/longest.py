"""The inverse question of the planner: the longest data.max_length that fits the named machines, with each
of the switches that bound a long sequence's activations (gradient checkpointing, the tiled MLP, activation
offloading), by the same memory model as `python -m training.plan` (training.planning.memory). The search is
a doubling then a bisection over max_length in steps of STEP tokens, up to LIMIT."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from training.config import Recipe
from training.planning.memory import BackendPlan, plan_backend, plan_rank, planning_inputs

STEP = 256
LIMIT = 1 << 21  # 2M tokens: longer is reported as "at least"
SWITCHES: tuple[tuple[str, dict], ...] = (
    ("none", {"gradient_checkpointing": False, "tiled_mlp": False, "activation_offloading": False}),
    (
        "gradient_checkpointing",
        {"gradient_checkpointing": True, "tiled_mlp": False, "activation_offloading": False},
    ),
    (
        "gradient_checkpointing + tiled_mlp",
        {"gradient_checkpointing": True, "tiled_mlp": True, "activation_offloading": False},
    ),
    (
        "gradient_checkpointing + activation_offloading",
        {"gradient_checkpointing": True, "tiled_mlp": False, "activation_offloading": True},
    ),
    (
        "gradient_checkpointing + tiled_mlp + activation_offloading",
        {"gradient_checkpointing": True, "tiled_mlp": True, "activation_offloading": True},
    ),
)


@dataclass
class Longest:
    switches: str
    overrides: str  # the recipe overrides that set them
    max_length: int  # 0: not even STEP tokens fit (or the switches are refused here)
    file: str = ""  # the fastest backend file that fits at that length
    peak_gib: float = 0.0
    reason: str = ""  # why nothing fits (the shortest length's verdict)

    def as_dict(self) -> dict:
        return asdict(self)


def variant(recipe: Recipe, max_length: int, switches: dict) -> Recipe:
    """The recipe at another max_length with the model's memory switches set."""
    model = recipe.model.model_copy(update=switches)
    data = recipe.data.model_copy(update={"max_length": max_length})
    return recipe.model_copy(update={"model": model, "data": data})


def best_fit(plans: list[BackendPlan]) -> BackendPlan | None:
    """The plan `estimate` would recommend among these, or None when none fits."""
    best = min(plans, key=plan_rank, default=None)
    return best if best is not None and best.fits else None


def longest_lengths(
    recipe: Recipe,
    num_gpus: int = 1,
    gpu_gib: float = 80,
    cpu_gib: float | None = None,
    configs_dir: str | Path | None = None,
    num_machines: int = 1,
    config=None,
) -> list[Longest]:
    """For each of SWITCHES, the longest max_length (a multiple of STEP) at which some backend file fits."""
    recipe, inv, backends = planning_inputs(
        recipe, num_gpus, gpu_gib, cpu_gib, configs_dir, config, num_machines
    )

    def plans(length: int, switches: dict) -> list[BackendPlan]:
        r = variant(recipe, length, switches)
        ckpt = switches["gradient_checkpointing"]
        return [
            plan_backend(
                r, inv, b, num_gpus, gpu_gib, cpu_gib, ckpt or b.activation_checkpointing, num_machines
            )
            for b in backends
        ]

    rows = []
    for name, switches in SWITCHES:
        overrides = " ".join(f"model.{k}={str(v).lower()}" for k, v in switches.items() if v)
        length = search(lambda n, s=switches: best_fit(plans(n, s)) is not None)
        if not length:
            shortest = plans(STEP, switches)
            reasons = sorted({p.reason for p in shortest if p.reason}, key=len)
            rows.append(Longest(name, overrides, 0, reason=reasons[0] if reasons else ""))
            continue
        best = best_fit(plans(length, switches))
        rows.append(Longest(name, overrides, length, best.file, round(best.peak_gib, 2)))
    return rows


def search(fits) -> int:
    """The largest multiple of STEP up to LIMIT for which fits(n) holds (fits is monotone: longer sequences
    need more memory); 0 when STEP does not."""
    if not fits(STEP):
        return 0
    low, high = STEP, STEP * 2
    while high <= LIMIT and fits(high):
        low, high = high, high * 2
    if high > LIMIT:
        return low
    while high - low > STEP:
        mid = (low + high) // 2 // STEP * STEP
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def format_longest(rows: list[Longest], recipe: Recipe, where: str, context: int | None) -> str:
    """The table `python -m training.plan RECIPE --max-length auto` prints."""
    base = next((r.max_length for r in rows if r.switches == "gradient_checkpointing"), 0)
    lines = [
        f"Longest data.max_length that fits {where} (train.batch_size={recipe.train.batch_size}, "
        f"method {recipe.method.type}, precision {recipe.precision}), by the planner's memory model:",
        "",
        "| switches | longest max_length | vs checkpointing | fastest file that fits | peak GiB |",
        "|---|---:|---:|---|---:|",
    ]
    for r in rows:
        if not r.max_length:
            lines.append(f"| {r.switches} | none | | {r.reason or 'refused'} | |")
            continue
        more = "at least " if r.max_length >= LIMIT else ""
        ratio = f"{r.max_length / base:.1f}x" if base else ""
        lines.append(
            f"| {r.switches} | {more}{r.max_length:,} | {ratio} | {Path(r.file).name} | {r.peak_gib:.1f} |"
        )
    if context and any(r.max_length > context for r in rows):
        lines += [
            "",
            f"The model was trained for {context:,} positions (max_position_embeddings): past that, set "
            "model.rope_scaling (linear, dynamic or yarn) to stretch its RoPE.",
        ]
    lines += [
        "",
        "Set the switches with the overrides, e.g. "
        + (next((r.overrides for r in rows[1:] if r.max_length), "") or "-"),
    ]
    return "\n".join(lines)
