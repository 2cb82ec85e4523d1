"""Train a causal LM from one recipe.

    python -m training.train RECIPE.yaml [dotted.key=value ...]
    accelerate launch [--config_file accelerate_configs/<backend>.yaml] -m training.train RECIPE.yaml

The command line only: the run is training.loop (setup -> fit, with the step in loop/step.py).
"""

from __future__ import annotations

import argparse
import sys

from training.config import load_recipe
from training.core.errors import EXIT_ABORTED, TrainingAborted, cli
from training.launch.confine import Confinement
from training.loop.fit import train
from training.loop.setup import setup
from training.model.unwrap import deepspeed_unimported
from training.run.lock import RunLock


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.lr=1e-4")
    return ap.parse_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    confinement = Confinement.from_env()  # set where the app launched this run: its workspace's rule
    if confinement is not None:
        confinement.check(recipe, args.recipe)
    # one run per directory (the lock: taken by setup, released here); deepspeed imported only by the
    # runs that use it (training.model.unwrap)
    with RunLock(recipe.output_dir) as lock, deepspeed_unimported():
        return train(setup(recipe, lock))


def entry() -> None:
    try:
        code = main()
    except TrainingAborted as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_ABORTED
    sys.exit(code)


if __name__ == "__main__":
    entry()
