"""Memory planner: how much memory each backend in accelerate_configs/ needs for a recipe, what fits,
and which configuration that fits should be fastest.

    python -m training.plan RECIPE.yaml [--num-gpus N] [--num-machines M] [--gpu-memory 80GiB]
                                        [--cpu-memory 128GiB] [--max-length auto]

With --max-length auto it answers the inverse question: the longest data.max_length that fits, with each of
gradient checkpointing, the tiled MLP and activation offloading (training/planning/longest.py).

The memory model and what it counts: training/planning/memory.py; the report: training/planning/report.py.
"""

from __future__ import annotations

import argparse
import json
import re

from training.config import load_recipe
from training.core.errors import UserError, cli
from training.core.paths import CONFIGS_DIR
from training.planning.inventory import model_config
from training.planning.longest import format_longest, longest_lengths
from training.planning.memory import GiB, estimate, launch_command
from training.planning.report import format_plan, moe_line, print_data_scale


def parse_size_gib(text: str, flag: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|mib|mb|m|tib|tb|t)?\s*", str(text).lower())
    if not m:
        raise UserError(f"{flag}: cannot read {text!r} as a memory size (examples: 80GiB, 24GB, 40)")
    value, unit = float(m.group(1)), m.group(2) or "gib"
    scale = {
        "gib": 1,
        "g": 1,
        "gb": 1e9 / GiB,
        "mib": 1 / 1024,
        "m": 1 / 1024,
        "mb": 1e6 / GiB,
        "tib": 1024,
        "t": 1024,
        "tb": 1e12 / GiB,
    }[unit]
    if value <= 0:
        raise UserError(f"{flag}: memory size must be positive (got {text!r})")
    return value * scale


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad arguments are a UserError (exit 2, one message) like everywhere else
        raise UserError(f"{self.prog}: {message}")


@cli
def main(argv=None) -> int:
    ap = _Parser(prog="python -m training.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides, e.g. train.batch_size=4")
    ap.add_argument(
        "--num-gpus", type=int, default=1, help="GPUs per machine (default 1; 0 plans for CPU only)"
    )
    ap.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")
    ap.add_argument(
        "--num-machines", type=int, default=1, help="machines, each with --num-gpus GPUs (default 1)"
    )
    ap.add_argument(
        "--cpu-memory",
        default=None,
        help="CPU memory per machine (default: none assumed, host memory is shown but not judged)",
    )
    ap.add_argument("--configs", default=str(CONFIGS_DIR), help="folder of accelerate config files")
    ap.add_argument("--json", action="store_true", help="print the plans as JSON instead of a table")
    ap.add_argument(
        "--max-length",
        choices=["auto"],
        help="auto: print the longest data.max_length that fits, with each long-sequence switch",
    )
    args = ap.parse_args(argv)
    gpu = parse_size_gib(args.gpu_memory, "--gpu-memory")
    cpu = parse_size_gib(args.cpu_memory, "--cpu-memory") if args.cpu_memory is not None else None
    recipe = load_recipe(args.recipe, args.overrides)
    if args.max_length == "auto":
        return print_longest(recipe, args, gpu, cpu)
    plans = estimate(
        recipe, args.num_gpus, gpu, cpu, configs_dir=args.configs, num_machines=args.num_machines
    )
    for p in plans:
        p.command = launch_command(p, recipe, args.recipe)
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        print(format_plan(plans))
        print_data_scale(recipe, args.num_gpus * args.num_machines)
        if (line := moe_line(recipe, args.configs)) is not None:
            print("\n" + line)
    return 0


def print_longest(recipe, args, gpu: float, cpu: float | None) -> int:
    rows = longest_lengths(recipe, args.num_gpus, gpu, cpu, args.configs, args.num_machines)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    machines = f"{args.num_machines} machine(s) of " if args.num_machines > 1 else ""
    where = machines + (f"{args.num_gpus} GPU(s) of {gpu:g} GiB" if args.num_gpus else "the CPU")
    if cpu is not None:
        where += f" and {cpu:g} GiB of host memory"
    context = getattr(model_config(recipe).get_text_config(), "max_position_embeddings", None)
    print(format_longest(rows, recipe, where, None if recipe.model.rope_scaling else context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
