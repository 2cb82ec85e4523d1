"""Generate the bundled online-RL task (deterministic; re-run to rebuild it byte for byte).

    python data/make_rl_task.py

rl/train.jsonl, rl/eval.jsonl  prompt records {"prompt", "answer", "kind"}: short questions (sums of small
    numbers, capitals, opposites) asking for the answer alone, as a chat whose earlier turn shows one worked
    example of the kind. SmolLM2-135M-Instruct often still replies with a sentence ("The capital of France
    is Paris.") or a wrong answer, so an exact match of the whole reply often fails; the bundled recipe (training/recipes/grpo.yaml) rewards the exact answer
    (exact_match) and how much of the reply the answer is (rl/rewards.py, a user reward function), and RL
    has something to teach. The held-out questions differ from the training ones.
All text is generated here from templates and lists written for this project (Apache-2.0, like the code).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
INSTRUCTION = "Reply with the answer alone."
# One worked example per kind, shown as an earlier turn of the chat (not asked again in the data).
EXAMPLES = {
    "sum": ("What is 10 + 10?", "20"),
    "capital": ("What is the capital of Italy?", "Rome"),
    "opposite": ("What is the opposite of 'good'?", "bad"),
}

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Russia", "Moscow"), ("Greece", "Athens"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Thailand", "Bangkok"),
    ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("Cuba", "Havana"), ("Denmark", "Copenhagen"),
]  # fmt: skip
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("early", "late"), ("full", "empty"), ("hard", "soft"), ("high", "low"), ("old", "young"),
    ("rich", "poor"), ("strong", "weak"), ("wet", "dry"), ("loud", "quiet"), ("thick", "thin"),
    ("up", "down"), ("first", "last"), ("win", "lose"), ("push", "pull"), ("buy", "sell"),
]  # fmt: skip


def questions(rng: random.Random) -> list[dict]:
    out = []
    sums = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    for a, b in rng.sample(sums, 40):  # as many sums as capitals and opposites together
        out.append({"q": f"What is {a} + {b}?", "answer": str(a + b), "kind": "sum"})
    for country, city in CAPITALS:
        out.append({"q": f"What is the capital of {country}?", "answer": city, "kind": "capital"})
    for word, opposite in OPPOSITES:
        out.append({"q": f"What is the opposite of '{word}'?", "answer": opposite, "kind": "opposite"})
    rng.shuffle(out)
    return out


def record(q: dict) -> dict:
    """A conversational prompt: the kind's worked example as an earlier exchange, then the question."""
    example_q, example_a = EXAMPLES[q["kind"]]
    prompt = [
        {"role": "user", "content": f"{example_q} {INSTRUCTION}"},
        {"role": "assistant", "content": example_a},
        {"role": "user", "content": f"{q['q']} {INSTRUCTION}"},
    ]
    return {"prompt": prompt, "answer": q["answer"], "kind": q["kind"]}


def main() -> None:
    rng = random.Random(2311)
    qs = questions(rng)
    held_out, train = qs[:32], qs[32:]
    out = HERE / "rl"
    out.mkdir(exist_ok=True)
    for name, part in (("train", train), ("eval", held_out)):
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for q in part:
                f.write(json.dumps(record(q), ensure_ascii=False) + "\n")
    print(f"wrote {len(train)} training and {len(held_out)} held-out prompts to {out}")


if __name__ == "__main__":
    main()
