"""The bundled verifiers task (data/environments/echo_verifiers.py) scored in a fresh process with plain
transformers and peft, without verifiers or the trainer: each held-out prompt (the environment's eval dataset,
data/environments/echo_heldout.jsonl) played as the environment plays it (greedy reply, then the
environment's "Say the word once more.", then a second greedy reply), scored by its rubric written out again
here: says_word (every reply contains the word) x 1 + brevity (1 / (1 + characters / 40)) x 0.5. An episode
passes when both replies are the word alone (case, spaces, quotes and final punctuation aside).

    python -m benchmarks.verifiers_echo                        # SmolLM2-135M-Instruct as bundled
    python -m benchmarks.verifiers_echo runs/verifiers_echo    # after training/recipes/verifiers_echo.yaml
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from benchmarks.common import bundled_policy, policy_parser

ROOT = Path(__file__).resolve().parents[1]
AGAIN = "Say the word once more."


def alone(text: str, word: str) -> bool:
    return re.sub(r"[\s\"'.!]+", " ", text).strip().lower() == word


def reply(model, tokenizer, messages: list[dict], max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv=None) -> None:
    args = policy_parser(__doc__, 24).parse_args(argv)
    model, tokenizer = bundled_policy(args.run)
    rows = [json.loads(x) for x in (ROOT / "data/environments/echo_heldout.jsonl").read_text().splitlines()]
    passed, total = 0, 0.0
    for r in rows:
        messages = list(r["prompt"])
        first = reply(model, tokenizer, messages, args.max_new_tokens)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": AGAIN}]
        second = reply(model, tokenizer, messages, args.max_new_tokens)
        says = float(all(r["answer"] in x.lower() for x in (first, second)))
        brevity = 1.0 / (1.0 + (len(first) + len(second)) / 40)
        passed += int(alone(first, r["answer"]) and alone(second, r["answer"]))
        total += says + 0.5 * brevity
        print(f"{r['answer']:8} -> {first!r} / {second!r}  ({says + 0.5 * brevity:.2f})")
    n = len(rows)
    print(
        f"{args.run or 'bundled SmolLM2-135M-Instruct'}: mean reward {total / n:.3f}, "
        f"pass rate (the word alone, twice) {passed / n:.3f} ({passed}/{n})"
    )


if __name__ == "__main__":
    main()
