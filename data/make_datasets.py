"""Generate the small bundled datasets (deterministic; re-run to rebuild them byte for byte).

    python data/make_datasets.py

dates/       chat task: rewrite a date written in words/other formats as ISO 8601 (YYYY-MM-DD).
             Learnable in minutes with LoRA; the base SmolLM2-135M-Instruct mostly gets it wrong.
alpaca_tiny.jsonl  instruction/input/output records (alpaca style), for tests and examples.
tiny_stories.txt   a small synthetic English corpus for pretraining smoke runs.
All text is generated here from templates, so we are free to ship it (Apache-2.0, like the code).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
DAYS_IN = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
SYSTEM = "You rewrite dates in ISO 8601 format (YYYY-MM-DD). Answer with the date only."


def ordinal(d: int) -> str:
    suffix = "th" if 11 <= d % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(d % 10, "th")
    return f"{d}{suffix}"


def date_phrase(rng: random.Random, y: int, m: int, d: int) -> str:
    name = MONTHS[m - 1]
    styles = [
        f"{name} {d}, {y}",
        f"{d} {name} {y}",
        f"{name[:3]} {d}, {y}",
        f"the {ordinal(d)} of {name}, {y}",
        f"{name} {ordinal(d)} {y}",
        f"{d}.{m}.{y}",
        f"{d} {name[:3]}. {y}",
    ]
    return rng.choice(styles)


def make_dates(rng: random.Random, n: int, seen: set) -> list[dict]:
    out = []
    asks = [
        "Convert to ISO format: {}",
        "What is {} in YYYY-MM-DD?",
        "Rewrite this date as ISO 8601: {}",
        "ISO date for {}?",
    ]
    while len(out) < n:
        y, m = rng.randint(1900, 2099), rng.randint(1, 12)
        d = rng.randint(1, DAYS_IN[m - 1] if m != 2 else 28)
        if (y, m, d) in seen:
            continue
        seen.add((y, m, d))
        question = rng.choice(asks).format(date_phrase(rng, y, m, d))
        out.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": f"{y:04d}-{m:02d}-{d:02d}"},
                ]
            }
        )
    return out


def make_alpaca(rng: random.Random, n: int) -> list[dict]:
    words = [
        "apple",
        "river",
        "cloud",
        "stone",
        "music",
        "garden",
        "window",
        "planet",
        "candle",
        "forest",
        "bridge",
        "yellow",
    ]
    recs = []
    for _ in range(n):
        k = rng.randint(3, 6)
        ws = rng.sample(words, k)
        task = rng.choice(["sort", "count", "upper", "reverse"])
        if task == "sort":
            recs.append(
                {
                    "instruction": "Sort these words alphabetically.",
                    "input": " ".join(ws),
                    "output": " ".join(sorted(ws)),
                }
            )
        elif task == "count":
            recs.append(
                {"instruction": "How many words are in the input?", "input": " ".join(ws), "output": str(k)}
            )
        elif task == "upper":
            recs.append(
                {
                    "instruction": f"Write the word '{ws[0]}' in capital letters.",
                    "input": "",
                    "output": ws[0].upper(),
                }
            )
        else:
            recs.append(
                {
                    "instruction": "Reverse the order of these words.",
                    "input": " ".join(ws),
                    "output": " ".join(ws[::-1]),
                }
            )
    return recs


def make_stories(rng: random.Random, n_sentences: int) -> str:
    names = ["Tom", "Mia", "Sam", "Lily", "Ben", "Zoe", "Max", "Anna"]
    animals = ["cat", "dog", "bird", "fox", "rabbit", "duck"]
    places = ["park", "garden", "forest", "house", "lake", "school"]
    things = ["ball", "kite", "book", "hat", "box", "apple"]
    feelings = ["happy", "sad", "tired", "excited", "scared", "proud"]
    templates = [
        "{n} went to the {p} with a {a}.",
        "The {a} found a {t} in the {p}.",
        "{n} was {f} because the {a} lost the {t}.",
        "One day, {n} and the {a} played with a {t}.",
        "The {a} ran to the {p} and {n} followed it.",
        "{n} gave the {t} to the {a}, and the {a} was {f}.",
        "At the end of the day, {n} went home and felt {f}.",
    ]
    paras, sent = [], []
    for _ in range(n_sentences):
        sent.append(
            rng.choice(templates).format(
                n=rng.choice(names),
                a=rng.choice(animals),
                p=rng.choice(places),
                t=rng.choice(things),
                f=rng.choice(feelings),
            )
        )
        if len(sent) >= rng.randint(4, 8):
            paras.append(" ".join(sent))
            sent = []
    return "\n".join(paras) + "\n"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main() -> None:
    rng = random.Random(1234)
    seen: set = set()
    write_jsonl(HERE / "dates" / "train.jsonl", make_dates(rng, 2000, seen))
    write_jsonl(HERE / "dates" / "test.jsonl", make_dates(rng, 200, seen))
    write_jsonl(HERE / "alpaca_tiny.jsonl", make_alpaca(rng, 200))
    (HERE / "tiny_stories.txt").write_text(make_stories(rng, 6000))
    print(
        "wrote",
        ", ".join(
            str(p.relative_to(HERE)) for p in sorted(HERE.rglob("*")) if p.is_file() and p.suffix != ".py"
        ),
    )


if __name__ == "__main__":
    main()
