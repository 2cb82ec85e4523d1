"""The `make demo` run: answers to held-out prompts before training, the training run itself (the
same `python -m training.train` command a user would type), the answers after, and where things are.

    python -m training.demo [RECIPE.yaml] [--examples N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import transformers

from training.config import load_recipe
from training.core.errors import UserError, cli
from training.generation import ChatOptions, generate, load_for_chat
from training.run.rundir import RunDir


def held_out_examples(path: str, n: int) -> list[tuple[list[dict], str]]:
    """(prompt messages, expected answer) for the first n chat records of a held-out file."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip() and len(out) < n:
            msgs = json.loads(line)["messages"]
            out.append((msgs[:-1], msgs[-1]["content"]))
    return out


def answers(source: str, examples) -> list[str]:
    model, tokenizer = load_for_chat(source)
    return [generate(model, tokenizer, msgs, ChatOptions(max_new_tokens=24)) for msgs, _ in examples]


def exact_match(preds: list[str], examples) -> float:
    return 100.0 * sum(p.strip() == want for p, (_, want) in zip(preds, examples)) / max(len(examples), 1)


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", nargs="?", default="training/recipes/demo.yaml")
    ap.add_argument("--examples", type=int, default=30, help="held-out prompts to score before/after")
    args = ap.parse_args(argv)
    transformers.logging.set_verbosity_error()
    recipe = load_recipe(args.recipe)
    if recipe.data.format != "chat" or not recipe.data.eval:
        raise UserError(f"{args.recipe}: the demo needs a chat recipe with data.eval (held-out prompts)")
    examples = held_out_examples(recipe.data.eval_files[0], args.examples)

    print(
        f"== 1/3 base model {recipe.model.name_or_path}: answering {len(examples)} held-out prompts",
        flush=True,
    )
    before = answers(recipe.model.name_or_path, examples)

    print(f"== 2/3 training: {sys.executable} -m training.train {args.recipe} resume=none", flush=True)
    t0 = time.time()
    rc = subprocess.run([sys.executable, "-m", "training.train", args.recipe, "resume=none"]).returncode
    if rc != 0:
        print(f"training failed with exit code {rc}", file=sys.stderr)
        return rc
    minutes = (time.time() - t0) / 60

    run = RunDir(recipe.output_dir)
    print(f"== 3/3 fine-tuned model {run.final}: answering the same prompts", flush=True)
    after = answers(str(run.root), examples)

    print(
        "\nheld-out prompt                                         | expected   | before               | after"
    )
    one_line = lambda text: " ".join(text.split())[:20]  # noqa: E731
    for (msgs, want), b, a in list(zip(examples, before, after))[:8]:
        print(f"{msgs[-1]['content'][:55]:<55} | {want:<10} | {one_line(b):<20} | {one_line(a)}")
    print(
        f"\nexact match on {len(examples)} held-out prompts: before {exact_match(before, examples):.0f}%  "
        f"after {exact_match(after, examples):.0f}%   (training took {minutes:.1f} min)"
    )
    print(f"run directory: {run.root.resolve()}")
    print(f"loss plot:     {run.loss_plot.resolve()}")
    print(f"metrics:       {run.metrics.resolve()}")
    print(
        f'chat with it:  {sys.executable} -m training.chat {run.root} --prompt "Convert to ISO format: July 4, 1976" '
        f'--system "{examples[0][0][0]["content"]}"'
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
