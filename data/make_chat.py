"""Generate data/chat/: chat conversations with a realistic spread of lengths (deterministic; re-run to
rebuild the files byte for byte).

    python data/make_chat.py      # data/chat/train.jsonl (1500 conversations), data/chat/test.jsonl (100)

Real chat data mixes one-line questions with long multi-turn sessions; dynamic padding, packing and
length grouping only show their differences on such a spread. Each conversation has 1-8 user/assistant
turns drawn from a handful of tasks whose answers follow from the prompt (so a model can learn them):
rewrite a date (short), sort/reverse/count a word list, add numbers step by step, tell a story, answer a
question about a story given in the prompt, number a story's sentences (long). Under the SmolLM2
tokenizer with its chat template the conversations are 44 to about 1100 tokens long, median 213
(`python -m benchmarks.packing --data data/chat/train.jsonl` prints the distribution).
All text is generated here from templates (stories from make_corpus.py), Apache-2.0 like the code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_corpus import story
from make_datasets import DAYS_IN, date_phrase

HERE = Path(__file__).resolve().parent / "chat"
MAX_CHARS = 2700  # at most about 1000 tokens with the chat template
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a patient assistant. Answer exactly what is asked.",
    "You help with small text and number tasks. Be precise.",
]
WORDS = [
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
    "orange",
    "silver",
    "paper",
    "rocket",
    "pencil",
    "castle",
    "dragon",
    "island",
    "lemon",
    "mirror",
    "needle",
    "ocean",
    "pepper",
    "rabbit",
    "saddle",
    "tiger",
    "violin",
    "wagon",
    "anchor",
    "basket",
    "cactus",
    "donkey",
    "engine",
    "feather",
    "guitar",
    "hammer",
    "igloo",
    "jacket",
    "kettle",
    "ladder",
    "magnet",
    "napkin",
    "olive",
    "puzzle",
    "quartz",
    "ribbon",
    "shovel",
    "tunnel",
    "umbrella",
    "valley",
    "walnut",
    "yogurt",
    "zebra",
]


def date_turn(rng: random.Random) -> tuple[str, str]:
    y, m = rng.randint(1900, 2099), rng.randint(1, 12)
    d = rng.randint(1, DAYS_IN[m - 1] if m != 2 else 28)
    ask = rng.choice(["Convert to ISO format: {}", "What is {} in YYYY-MM-DD?", "ISO date for {}?"])
    return ask.format(date_phrase(rng, y, m, d)), f"{y:04d}-{m:02d}-{d:02d}"


def words_turn(rng: random.Random) -> tuple[str, str]:
    ws = [rng.choice(WORDS) for _ in range(int(rng.lognormvariate(2.2, 0.8)) + 3)]
    task = rng.choice(["sort", "reverse", "count", "upper"])
    listed = ", ".join(ws)
    if task == "sort":
        return f"Sort these words alphabetically: {listed}", ", ".join(sorted(ws))
    if task == "reverse":
        return f"Reverse the order of this list: {listed}", ", ".join(ws[::-1])
    if task == "count":
        w = rng.choice(ws)
        n = ws.count(w)
        return (
            f"How many times does the word '{w}' appear in this list? {listed}",
            f"The word '{w}' appears {n} time{'s' if n != 1 else ''}.",
        )
    return f"Write these words in capital letters: {listed}", ", ".join(w.upper() for w in ws)


def sum_turn(rng: random.Random) -> tuple[str, str]:
    nums = [rng.randint(1, 999) for _ in range(rng.randint(2, 14))]
    lines, total = [], 0
    for x in nums:
        lines.append(f"{total} + {x} = {total + x}")
        total += x
    return (
        "Add these numbers step by step: " + " ".join(map(str, nums)),
        "\n".join(lines) + f"\nThe sum is {total}.",
    )


def story_turn(rng: random.Random) -> tuple[str, str]:
    text = story(rng)
    name = text.split("named ")[-1].split(".")[0] if "named " in text else None
    ask = rng.choice(["Tell me a short story.", "Write a children's story about a lost object."])
    if name and rng.random() < 0.5:
        ask = f"Tell me a story about a child called {name}."
    return ask, text


def story_question_turn(rng: random.Random) -> tuple[str, str]:
    text = story(rng)
    sentences = [s.strip() + "." for s in text.replace("!", ".").split(".") if s.strip().strip('"')]
    kind = rng.choice(["count", "first", "last", "number"])
    if kind == "count":
        return f"How many sentences are in this story?\n\n{text}", f"It has {len(sentences)} sentences."
    if kind == "first":
        return f"What is the first sentence of this story?\n\n{text}", sentences[0]
    if kind == "last":
        return f"Quote the last sentence of this story.\n\n{text}", sentences[-1]
    return (
        f"Number the sentences of this story, one per line.\n\n{text}",
        "\n".join(f"{i}. {s}" for i, s in enumerate(sentences, 1)),
    )


TASKS = [(date_turn, 3), (words_turn, 3), (sum_turn, 2), (story_turn, 2), (story_question_turn, 2)]


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
    turns = min(8, 1 + int(rng.expovariate(0.6)))
    size = 0
    for _ in range(turns):
        task = rng.choices([t for t, _ in TASKS], weights=[w for _, w in TASKS])[0]
        user, assistant = task(rng)
        if messages and size + len(user) + len(assistant) > MAX_CHARS:
            break
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        size += len(user) + len(assistant)
    if size > MAX_CHARS:  # a single over-long turn: start again
        return conversation(rng)
    return {"messages": messages}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(out: Path = HERE, n_train: int = 1500, n_test: int = 100) -> None:
    rng = random.Random(14)
    write_jsonl(out / "train.jsonl", [conversation(rng) for _ in range(n_train)])
    write_jsonl(out / "test.jsonl", [conversation(rng) for _ in range(n_test)])
    print(f"wrote {out}/train.jsonl ({n_train} conversations) and test.jsonl ({n_test})")


if __name__ == "__main__":
    import sys

    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
