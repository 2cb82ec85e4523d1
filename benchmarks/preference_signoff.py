"""How often a model ends its answer with the bundled preference's sign-off (data/signoff).

    python -m benchmarks.preference_signoff bundled:smollm2-135m-instruct   # before DPO
    python -m benchmarks.preference_signoff runs/dpo                         # after (training/recipes/dpo.yaml)

Greedy answers to the first N held-out prompts (data/signoff/eval.jsonl), through the same loading
and generation code as `python -m training.chat`; prints each answer and the share that signs off.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.generation import ChatOptions, generate, load_for_chat

ROOT = Path(__file__).resolve().parents[1]
SIGN_OFF = "Happy forging!"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="run directory, final/, checkpoint or model (as python -m training.chat)")
    ap.add_argument("-n", type=int, default=16, help="number of held-out prompts")
    args = ap.parse_args(argv)
    model, tokenizer = load_for_chat(args.model)
    rows = [json.loads(x) for x in (ROOT / "data/signoff/eval.jsonl").read_text().splitlines()][: args.n]
    signed = 0
    for r in rows:
        answer = generate(
            model, tokenizer, [{"role": "user", "content": r["prompt"]}], ChatOptions(max_new_tokens=48)
        )
        signed += answer.rstrip().endswith(SIGN_OFF)
        print(f"{r['prompt']!r} -> {answer!r}")
    print(f"{args.model}: {signed}/{len(rows)} answers end with {SIGN_OFF!r}")


if __name__ == "__main__":
    main()
