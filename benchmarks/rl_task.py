"""The bundled RL task (data/rl) scored in a fresh process with plain transformers and peft: greedy answers
to the held-out prompts, the task's rewards computed here, independently of training.objectives.

    python -m benchmarks.rl_task                  # SmolLM2-135M-Instruct as bundled (before RL)
    python -m benchmarks.rl_task runs/grpo        # after training/recipes/grpo.yaml (its final/ adapter)

The rewards are those of training/recipes/grpo.yaml, written out again here: exact (the reply is the answer,
case, spaces and final punctuation aside) x 1.0, mentions (data/rl/rewards.py, the task's own function)
x 0.5, brevity (0 up to 12 characters, down to -1 at 24) x 0.5; a prompt passes when exact and mentions
both hold (total >= 1.5). Prints mean reward, pass rate and each reward's mean.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.run.sources import pretrained_source

ROOT = Path(__file__).resolve().parents[1]


def task_reward():
    spec = importlib.util.spec_from_file_location("rl_task_rewards", ROOT / "data/rl/rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mentions_answer


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().strip(".!").strip().lower()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", help="a run directory whose final/ holds a LoRA adapter (default: no RL)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    base = pretrained_source("bundled:smollm2-135m-instruct")  # the converted bundled model's directory
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if args.run:
        model = PeftModel.from_pretrained(model, Path(args.run) / "final")
    model.eval()
    rows = [json.loads(x) for x in (ROOT / "data/rl/eval.jsonl").read_text().splitlines()]
    mentions = task_reward()
    sums = {"exact": 0.0, "mentions": 0.0, "brevity": 0.0, "total": 0.0, "passed": 0}
    for r in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        exact = float(normalised(reply) == normalised(r["answer"]))
        mention = mentions([r["prompt"]], [reply], [r["answer"]])[0]
        brevity = -min(1.0, max(0, len(reply) - 12) / 12)
        total = exact + 0.5 * mention + 0.5 * brevity
        for k, v in (("exact", exact), ("mentions", mention), ("brevity", brevity), ("total", total)):
            sums[k] += v
        sums["passed"] += total >= 1.5 - 1e-9
        print(f"{r['prompt'][:48]!r:52} -> {reply!r}  ({total:+.2f})")
    n = len(rows)
    print(
        f"{args.run or 'bundled SmolLM2-135M-Instruct'}: mean reward {sums['total'] / n:.3f}, "
        f"pass rate {sums['passed'] / n:.3f} ({sums['passed']}/{n}); exact {sums['exact'] / n:.3f}, "
        f"mentions {sums['mentions'] / n:.3f}, brevity {sums['brevity'] / n:.3f}"
    )


if __name__ == "__main__":
    main()
