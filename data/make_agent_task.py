"""Generate data/agent/: a calculator task for agent training, SFT then RL (deterministic, no network; re-run
to rebuild the files byte for byte).

    python data/make_agent_task.py   # data/agent/{sft,train,eval}.jsonl

The task: short word problems of two operations (a product and a sum or difference) on 2- and 3-digit numbers,
too long for a 135M model to work out in its head, with the calculator tool of data/agent/task.py; the policy
must turn the words into the calculator's expression. A reply is right when its last assistant message ends
with the answer.
  sft.jsonl    48 tool-calling chats in the tools data format (a `tools` list, the assistant's call, the tool's
               result, the answer) on 3 of the task's 8 kinds of problem: the SFT step teaches the call
               format on those;
  train.jsonl  192 prompt records ({"prompt": [messages], "answer": "..."}) of all 8 kinds: RL's prompts;
  eval.jsonl   64 held-out prompt records of all 8 kinds, numbers seen nowhere else.
All text is generated here from templates, Apache-2.0 like the code.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "agent"))
from task import calculate  # noqa: E402 (the tool itself, for its schema and results)

# (question, expression): two operations each, numbers too long for a 135M model to work out in its head; the
# policy must turn the words into the calculator's expression
PROBLEMS = [
    ("A shop has {a} boxes of {b} pens and sells {c} pens. How many pens are left?", "{a} * {b} - {c}"),
    (
        "A train covers {a} km a day for {b} days, then {c} km more. How far does it go in all?",
        "{a} * {b} + {c}",
    ),
    (
        "{a} crates hold {b} apples each, and {c} more apples lie loose. How many apples are there?",
        "{a} * {b} + {c}",
    ),
    # the SFT chats use only the three above
    (
        "Each of {b} workers earns {a} dollars, and {c} dollars go to tax in total. What do they keep?",
        "{a} * {b} - {c}",
    ),
    (
        "A farm packs {a} eggs a day. After {b} days, {c} eggs have broken. How many eggs are whole?",
        "{a} * {b} - {c}",
    ),
    (
        "There are {b} shelves with {a} books each, plus a pile of {c} books. How many books in total?",
        "{a} * {b} + {c}",
    ),
    (
        "A printer prints {a} pages an hour for {b} hours; {c} pages jam. How many good pages?",
        "{a} * {b} - {c}",
    ),
    (
        "{c} people came early, then {b} buses of {a} people each arrived. How many people came?",
        "{c} + {a} * {b}",
    ),
]
SFT_WORDINGS = 3


def schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(calculate)


def question(rng: random.Random, wordings: int, seen: set) -> tuple[str, str, str]:
    """(question, expression, answer) with numbers not used before."""
    while True:
        a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(100, 999)
        if (a, b, c) not in seen:
            seen.add((a, b, c))
            break
    text, expression = rng.choice(PROBLEMS[:wordings])
    expression = expression.format(a=a, b=b, c=c)
    return text.format(a=a, b=b, c=c), expression, calculate(expression)


def sft_record(text: str, expression: str, answer: str) -> dict:
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return {
        "tools": [schema()],
        "messages": [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": calculate(expression)},
            {"role": "assistant", "content": answer},
        ],
    }


def prompt_record(text: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": text}], "answer": answer}


def main() -> None:
    rng, seen = random.Random(40), set()
    out = HERE / "agent"
    sft = [sft_record(*question(rng, SFT_WORDINGS, seen)) for _ in range(48)]
    train = [prompt_record(t, p) for t, _, p in (question(rng, len(PROBLEMS), seen) for _ in range(192))]
    held = [prompt_record(t, p) for t, _, p in (question(rng, len(PROBLEMS), seen) for _ in range(64))]
    for name, rows in (("sft", sft), ("train", train), ("eval", held)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"data/agent/{name}.jsonl: {len(rows)} records")


if __name__ == "__main__":
    main()
