"""Train a recipe on a Ray cluster, through Ray Train.

    python -m training.ray_launch RECIPE.yaml --config_file accelerate_configs/ddp.yaml --num_workers N \
        [--address ADDRESS] [--use_gpu] [--max_restarts K] [dotted.key=value ...]

Ray Train's TorchTrainer starts N workers (one per process `accelerate launch` would start), sets up
torch.distributed among them (gloo on CPUs, NCCL on GPUs), and each runs training.train's entry point with
the environment `accelerate launch --config_file FILE` gives its processes: accelerate's own launch helpers
compute it from the file (mixed precision, FSDP or DeepSpeed settings), and LLM_FORGE_ACCELERATE_CONFIG
names the file for the keys accelerate does not pass on. The same recipe and config file therefore train
the same way as under `accelerate launch` (tests/integration/test_ray.py: equal to 2-process DDP).

- `--address`: a running cluster (`auto`, or `ray://HOST:10001`); without it a local one is started on
  this machine. Every worker must see the recipe, the data and `output_dir` at the same paths (a shared
  file system), as on a SLURM cluster.
- `--max_restarts K`: Ray Train restarts the whole worker group up to K times after a worker dies; the
  restarted group resumes from the newest complete checkpoint (`resume: auto`), as torchrun's do.
- Exit codes are those of training.train: 2 for bad input (the recipe is checked here before Ray starts),
  3 when a run aborts (e.g. a full disk); 1 when a worker fails otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from training.config import load_recipe
from training.core.errors import EXIT_ABORTED, EXIT_BAD_INPUT, TrainingAborted, UserError, cli
from training.train import main as train_main


class RankExit(Exception):
    """A worker's training ended with a non-zero exit code (carried to the driver)."""

    def __init__(self, code: int, rank: int):
        super().__init__(code, rank)  # both, so that it pickles back whole to the driver
        self.code, self.rank = code, rank

    def __str__(self) -> str:
        return f"rank {self.rank} exited with code {self.code}"


def accelerate_env(config_file: str, num_processes: int, num_machines: int) -> dict[str, str]:
    """The environment `accelerate launch --config_file FILE` gives each training process, from
    accelerate's own launch helpers (the variables it adds to this process's environment)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", config_file, "--num_processes", str(num_processes)]
    argv += ["--num_machines", str(num_machines), "-m", "training.train", "RECIPE"]
    args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    added = {k: str(v) for k, v in env.items() if os.environ.get(k) != v}
    # torch's rendezvous and ranks come from Ray Train, not from accelerate's launcher
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH"):
        added.pop(key, None)
    return added | {"LLM_FORGE_ACCELERATE_CONFIG": str(Path(config_file).resolve())}


def attempt(directory: Path, rank: int) -> int:
    """How many times this rank started before in this run (each rank counts its own starts in a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    mark = directory / f"rank-{rank}"
    before = int(mark.read_text()) if mark.is_file() else 0
    mark.write_text(str(before + 1))
    return before


def worker(config: dict) -> None:
    """One Ray Train worker: accelerate's environment and this worker's ranks, then training.train."""
    import ray.train  # a worker runs where Ray is (main() checked it is installed)

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    os.environ.update(config["env"])
    os.environ.update(
        # the group's restart count, as torchrun's elastic agent tells its workers
        TORCHELASTIC_RESTART_COUNT=str(attempt(Path(config["attempts"]), rank)),
        RANK=str(rank),
        LOCAL_RANK=str(ctx.get_local_rank()),
        WORLD_SIZE=str(ctx.get_world_size()),
        LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()),
        NODE_RANK=str(ctx.get_node_rank()),
    )
    os.chdir(config["cwd"])
    try:
        code = train_main(config["argv"])
    except SystemExit as e:  # bad input: training.train printed the message
        code = e.code if isinstance(e.code, int) else 1
    except TrainingAborted as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_ABORTED
    if code:
        raise RankExit(code, rank)


def exit_code(error: BaseException) -> int:
    """The exit code a failed Ray Train run carries: a worker's RankExit anywhere in the error's causes."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RankExit):
            return e.code
        todo += [e.__cause__, e.__context__, *getattr(e, "worker_failures", {}).values()]
        todo += [getattr(e, "error", None)]
    return 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training.ray_launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.lr=1e-4")
    ap.add_argument(
        "--config_file", required=True, help="the accelerate config file, as for accelerate launch"
    )
    ap.add_argument("--num_workers", type=int, required=True, help="training processes (one per GPU)")
    ap.add_argument("--address", help="a running Ray cluster (auto, ray://HOST:PORT); default: a local one")
    ap.add_argument("--use_gpu", action="store_true", help="one GPU per worker (NCCL)")
    ap.add_argument("--max_restarts", type=int, default=0, help="restart the worker group this many times")
    ap.add_argument("--cpus_per_worker", type=float, default=1.0, help="CPUs Ray reserves for each worker")
    return ap.parse_intermixed_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)  # bad input ends here, before any worker starts
    if args.num_workers < 1:
        raise UserError(f"--num_workers must be at least 1 (got {args.num_workers})")
    if not Path(args.config_file).is_file():
        raise UserError(f"--config_file {args.config_file}: no such file")
    try:  # an optional dependency: pip install 'llm-forge[ray]'
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise UserError("Ray Train is not installed: pip install 'llm-forge[ray]' (ray[train])") from None

    env = accelerate_env(args.config_file, args.num_workers, 1)
    storage = Path(recipe.output_dir).resolve() / "ray"
    shutil.rmtree(storage / "attempts", ignore_errors=True)  # a new launch counts its restarts afresh
    ray.init(address=args.address, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        worker,
        train_loop_config={
            "env": env,
            "cwd": os.getcwd(),
            "argv": [str(Path(args.recipe).resolve()), *args.overrides],
            "attempts": str(storage / "attempts"),
        },
        scaling_config=ScalingConfig(
            num_workers=args.num_workers,
            use_gpu=args.use_gpu,
            resources_per_worker={"CPU": args.cpus_per_worker},
        ),
        torch_config=TorchConfig(backend="nccl" if args.use_gpu else "gloo"),
        run_config=RunConfig(
            name="ray",
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=args.max_restarts),
        ),
    )
    try:
        trainer.fit()
    except Exception as e:  # Ray's TrainingFailedError, carrying the workers' errors
        code = exit_code(e)
        if code != EXIT_BAD_INPUT:
            print(f"error: the Ray Train run failed: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return code
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
