"""A verifiers environment's prompts as a prompt file the trainer reads (data.format: prompts), one JSON record a
line with the environment's own prompt messages (its system prompt included), answer, info and task: what its
rollouts and rubric receive back when rl.environment names the environment.

    python -m training.verifiers_data ENV --out FILE [--args JSON] [--split train|eval] [-n N]

ENV is an installed environment's id (what vf.load_environment loads) or path/to/env.py (its
load_environment), as rl.environment names it after `verifiers:`; --args are the keyword arguments of its
load_environment (rl.environment_args). The environment runs in the verifiers Python (make verifiers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.core.errors import UserError, cli
from training.rl.verifiers_env import Worker


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.verifiers_data", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("env", metavar="ENV", help="an installed verifiers environment's id, or path/to/env.py")
    p.add_argument("--out", required=True, help="the JSONL prompt file to write")
    p.add_argument("--args", default="{}", help="load_environment's keyword arguments, as JSON")
    p.add_argument("--split", choices=("train", "eval"), default="train", help="its dataset or eval dataset")
    p.add_argument("-n", type=int, default=-1, help="the first N rows (default: all)")
    return p


@cli
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        env_args = json.loads(args.args)
    except json.JSONDecodeError as e:
        raise UserError(f"--args: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(env_args, dict):
        raise UserError("--args: a JSON object of keyword arguments, e.g. '{\"size\": 64}'")
    worker = Worker(args.env, env_args, key=f"ENV {args.env}")
    try:
        rows = worker.rows(args.split, args.n)
    finally:
        worker.close()
    if not rows:
        raise UserError(f"ENV {args.env}: its {args.split} dataset is empty")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if k != "example_id"}) + "\n")
    print(f"wrote {len(rows)} prompt records of {args.env} ({args.split}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
