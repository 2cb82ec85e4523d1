"""Generate the bundled preference data set (deterministic; re-run to rebuild it byte for byte).

    python data/make_preference.py

signoff/train.jsonl, signoff/eval.jsonl  pairwise preference records {"prompt", "chosen", "rejected"}:
    short factual questions (arithmetic, capitals, opposites, letter counts, plurals, reversed words)
    whose chosen answer ends with the sign-off "Happy forging!" and whose rejected answer is the same
    answer without it. SmolLM2-135M-Instruct never signs off like that by itself; DPO teaches it to.
signoff/kto.jsonl, signoff/kto_eval.jsonl  the same questions as unpaired KTO records {"prompt", "completion",
    "label"}: every other answer signs off (label true) or not (label false).
All text is generated here from templates and lists written for this project (Apache-2.0, like the code).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIGN_OFF = "Happy forging!"

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Russia", "Moscow"), ("Greece", "Athens"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Kenya", "Nairobi"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"),
    ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Hungary", "Budapest"), ("Belgium", "Brussels"),
    ("the Netherlands", "Amsterdam"), ("Turkey", "Ankara"), ("Cuba", "Havana"), ("Iceland", "Reykjavik"),
]  # fmt: skip
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("early", "late"), ("open", "closed"), ("full", "empty"), ("hard", "soft"), ("high", "low"),
    ("old", "young"), ("rich", "poor"), ("strong", "weak"), ("wet", "dry"), ("loud", "quiet"),
    ("thick", "thin"), ("up", "down"), ("in", "out"), ("true", "false"), ("near", "far"),
    ("first", "last"), ("win", "lose"), ("push", "pull"), ("begin", "end"), ("buy", "sell"),
]  # fmt: skip
PLURALS = [
    ("mouse", "mice"), ("child", "children"), ("tooth", "teeth"), ("foot", "feet"), ("man", "men"),
    ("woman", "women"), ("goose", "geese"), ("person", "people"), ("ox", "oxen"), ("cactus", "cacti"),
    ("leaf", "leaves"), ("knife", "knives"), ("wolf", "wolves"), ("box", "boxes"), ("city", "cities"),
    ("bus", "buses"), ("hero", "heroes"), ("sheep", "sheep"), ("fish", "fish"), ("half", "halves"),
]  # fmt: skip
WORDS = [
    "garden", "river", "pencil", "window", "forest", "planet", "rocket", "basket", "candle", "silver",
    "anvil", "hammer", "bridge", "castle", "dragon", "island", "jacket", "lemon", "market", "orange",
    "pepper", "rabbit", "summer", "tiger", "violin", "wizard", "yellow", "zebra", "cloud", "stone",
]  # fmt: skip


def question(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        q = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "How much is {a} plus {b}?"])
        return q.format(a=a, b=b), f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q = rng.choice(["What is {a} times {b}?", "Multiply {a} by {b}.", "What is {a} x {b}?"])
        return q.format(a=a, b=b), f"{a} x {b} = {a * b}."
    if kind == 2:
        country, city = rng.choice(CAPITALS)
        q = rng.choice(
            ["What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}."]
        )
        return q.format(c=country), f"The capital of {country} is {city}."
    if kind == 3:
        w, o = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            w, o = o, w
        q = rng.choice(["What is the opposite of '{w}'?", "Give me the opposite of the word '{w}'."])
        return q.format(w=w), f"The opposite of '{w}' is '{o}'."
    if kind == 4:
        w = rng.choice(WORDS)
        q = rng.choice(["How many letters are in the word '{w}'?", "Count the letters in '{w}'."])
        return q.format(w=w), f"The word '{w}' has {len(w)} letters."
    if kind == 5:
        w, p = rng.choice(PLURALS)
        q = rng.choice(["What is the plural of '{w}'?", "How do you say more than one '{w}'?"])
        return q.format(w=w), f"The plural of '{w}' is '{p}'."
    w = rng.choice(WORDS)
    q = rng.choice(["Spell '{w}' backwards.", "Write the word '{w}' in reverse."])
    return q.format(w=w), f"'{w}' backwards is '{w[::-1]}'."


def make(rng: random.Random, n: int, seen: set) -> list[tuple[str, str]]:
    out = []
    while len(out) < n:
        q, a = question(rng)
        if q not in seen:
            seen.add(q)
            out.append((q, a))
    return out


def write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def main() -> None:
    rng = random.Random(15)
    seen: set = set()
    train, evals = make(rng, 480, seen), make(rng, 64, seen)

    def pair(q, a):
        return {"prompt": q, "chosen": f"{a} {SIGN_OFF}", "rejected": a}

    write(HERE / "signoff" / "train.jsonl", [pair(q, a) for q, a in train])
    write(HERE / "signoff" / "eval.jsonl", [pair(q, a) for q, a in evals])
    for name, questions in (("kto.jsonl", train), ("kto_eval.jsonl", evals)):
        kto = []
        for i, (q, a) in enumerate(questions):
            good = i % 2 == 0
            kto.append({"prompt": q, "completion": f"{a} {SIGN_OFF}" if good else a, "label": good})
        write(HERE / "signoff" / name, kto)


if __name__ == "__main__":
    main()
