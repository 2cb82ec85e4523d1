"""Seconds per RL step, synchronous and with rl.async, with the rollouts drawn in process or by a server on cores of
its own: what overlapping generation with training buys on this machine.

    python -m benchmarks.rl_async [--recipe training/recipes/grpo.yaml] [--steps 4]
        [--ways sync,async,server,server-async,server-adapter]

Each way is a fresh `python -m training.train RECIPE train.max_steps=STEPS` (no held-out evaluation, no
checkpoint). `server` ways start `python -m training.serve` on the recipe's model first (`server-adapter`: the
policy pushed as its LoRA adapter, rl.server_push=adapter); with more than one CPU core the server is pinned to
the upper half of the cores and the trainer to the lower half (taskset), each with as many torch threads as
cores, so the two sides do not share cores (the in-process ways use every core). Prints,
per way, the mean over steps 2..STEPS of the step's wall seconds (the metrics rows' elapsed_s apart), its
generation seconds and, with rl.async, how long the step waited for its rollouts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine, read_rows, save_result, table, tempdir
from training.config.io import load_recipe

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("sync", "async", "server", "server-async", "server-adapter")


def cores() -> tuple[list[int], list[int]]:
    """(the trainer's cores, the server's cores): the lower and upper half of those this process may use."""
    mine = sorted(os.sched_getaffinity(0))
    half = max(1, len(mine) // 2)
    return mine[:half], mine[half:] or mine


def pinned(command: list[str], cpus: list[int]) -> tuple[list[str], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
    return ["taskset", "-c", ",".join(map(str, cpus)), *command], env


def start_server(model: str, cpus: list[int], log: Path) -> tuple[subprocess.Popen, str]:
    """python -m training.serve MODEL on a free port; (the process, its base URL) once it listens."""
    command, env = pinned([sys.executable, "-m", "training.serve", model, "--port", "0"], cpus)
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True
    )
    line = proc.stdout.readline()  # "serving NAME at http://127.0.0.1:PORT/v1"
    found = re.search(r"(http://\S+/v1)", line)
    if not found:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r} (see {log})")
    return proc, found.group(1)


def run_way(way: str, recipe: Path, steps: int, work: Path) -> dict:
    out = work / way
    overrides = [
        f"output_dir={out}",
        f"train.max_steps={steps}",
        "eval.at_start=false",
        "checkpoint.every_steps=1000",
    ]
    overrides += ["rl.async=1"] if way.endswith("async") else []
    server = None
    command = [sys.executable, "-m", "training.train", str(recipe)]
    env = dict(os.environ)
    try:
        if way.startswith("server"):
            trainer_cpus, server_cpus = cores()
            server, url = start_server(
                load_recipe(recipe).model.name_or_path, server_cpus, work / f"{way}-serve.log"
            )
            overrides += ["rl.generator=server", f"rl.server_url={url}"]
            overrides += ["rl.server_push=adapter"] if "adapter" in way else []
            command, env = pinned(command, trainer_cpus)
        start = time.perf_counter()
        subprocess.run(command + overrides, env=env, cwd=ROOT, check=True, capture_output=True)
        wall = time.perf_counter() - start
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    return summary(way, [r for r in read_rows(out) if "reward" in r], wall)


def summary(way: str, rows: list[dict], wall: float) -> dict:
    later = rows[1:] or rows
    per_step = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])] or [rows[0]["elapsed_s"]]
    mean = lambda key: sum(r.get(key, 0.0) for r in later) / len(later)  # noqa: E731
    return {
        "way": way,
        "step_s": sum(per_step) / len(per_step),
        "generation_s": mean("generation_s"),
        "train_s": mean("train_s"),
        "wait_s": mean("rollout_wait_s"),
        "reward": mean("reward"),
        "wall_s": wall,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.rl_async", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "training/recipes/grpo.yaml")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ways", default=",".join(WAYS))
    args = ap.parse_args(argv)
    work = tempdir("rl_async")
    results = [run_way(w, args.recipe, args.steps, work) for w in args.ways.split(",")]
    print(machine())
    print(
        table(
            ["way", "s/step", "generation s", "train s", "waited s", "reward", "run s"],
            [
                [
                    r["way"],
                    f"{r['step_s']:.1f}",
                    f"{r['generation_s']:.1f}",
                    f"{r['train_s']:.1f}",
                    f"{r['wait_s']:.1f}",
                    f"{r['reward']:.3f}",
                    f"{r['wall_s']:.0f}",
                ]
                for r in results
            ],
        )
    )
    print(json.dumps(str(save_result("rl_async", {"recipe": str(args.recipe), "results": results}))))


if __name__ == "__main__":
    main()
