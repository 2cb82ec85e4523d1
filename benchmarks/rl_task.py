"""The bundled RL task (data/rl) scored in a fresh process with plain transformers and peft: greedy answers
to the held-out prompts, the task's rewards computed here, independently of training.objectives.

    python -m benchmarks.rl_task                  # SmolLM2-135M-Instruct as bundled (before RL)
    python -m benchmarks.rl_task runs/grpo        # after training/recipes/grpo.yaml (its final/ adapter)

The rewards are those of training/recipes/grpo.yaml, written out again here: exact (the reply is the answer,
case, spaces and final punctuation aside) x 1.0 and concise (data/rl/rewards.py, the task's own function:
how much of the reply the answer is) x 0.5; a prompt passes when the reply is exactly the answer. Prints
mean reward, pass rate (exact) and each reward's mean.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch

from benchmarks.common import bundled_policy, policy_parser

ROOT = Path(__file__).resolve().parents[1]


def task_reward():
    spec = importlib.util.spec_from_file_location("rl_task_rewards", ROOT / "data/rl/rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.concise


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().strip(".!").strip().lower()


def main(argv=None) -> None:
    args = policy_parser(__doc__, 16).parse_args(argv)
    model, tokenizer = bundled_policy(args.run)
    rows = [json.loads(x) for x in (ROOT / "data/rl/eval.jsonl").read_text().splitlines()]
    concise = task_reward()
    sums = {"exact": 0.0, "concise": 0.0, "total": 0.0}
    for r in rows:
        ids = tokenizer.apply_chat_template(
            r["prompt"],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        exact = float(normalised(reply) == normalised(r["answer"]))
        share = concise([r["prompt"]], [reply], [r["answer"]])[0]  # the reply as a string
        total = exact + 0.5 * share
        for k, v in (("exact", exact), ("concise", share), ("total", total)):
            sums[k] += v
        print(f"{r['prompt'][-1]['content'][:48]!r:52} -> {reply!r}  ({total:+.2f})")
    n = len(rows)
    print(
        f"{args.run or 'bundled SmolLM2-135M-Instruct'}: mean reward {sums['total'] / n:.3f}, "
        f"pass rate (exact answers) {sums['exact'] / n:.3f} ({int(sums['exact'])}/{n}), "
        f"concise {sums['concise'] / n:.3f}"
    )


if __name__ == "__main__":
    main()
