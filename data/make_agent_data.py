"""Generate data/tools/ and data/reasoning/: tool-calling chats and arithmetic with reasoning traces
(deterministic, no network; re-run to rebuild the files byte for byte).

    python data/make_agent_data.py   # data/tools/tool_calls.jsonl (48), data/reasoning/reasoning.jsonl (64)

tools/tool_calls.jsonl: chat records with a top-level `tools` list (a weather lookup and a calculator, as
JSON-schema function definitions) where the assistant calls a tool (`tool_calls`, arguments as a dict), a
`tool` message answers with the result, and the assistant answers from it; some chats call both tools, some
need none. The weather is made up by a seeded generator; the calculator's results are exact.
reasoning/reasoning.jsonl: short arithmetic word problems whose assistant message has the working in
`reasoning_content` and the answer in `content`.
All text is generated here from templates, Apache-2.0 like the code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Osaka", "Quito", "Perth", "Cairo", "Denver", "Hanoi"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression with + - * and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
                "required": ["expression"],
            },
        },
    },
]
SYSTEM = "You are a helpful assistant. Use the tools when they help."


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def weather(rng: random.Random, city: str, unit: str) -> tuple[dict, str]:
    celsius = rng.randint(-5, 34)
    temp = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    sky = rng.choice(SKIES)
    result = {"city": city, "temperature": temp, "unit": unit, "sky": sky}
    return result, f"It is {temp} degrees {'C' if unit == 'celsius' else 'F'} and {sky} in {city}."


def expression(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    forms = [
        (f"{a} + {b}", a + b),
        (f"{a} * {c}", a * c),
        (f"({a} + {b}) * {c}", (a + b) * c),
        (f"{a} * {b} - {c}", a * b - c),
    ]
    return rng.choice(forms)


def weather_chat(rng: random.Random) -> list[dict]:
    city, unit = rng.choice(CITIES), rng.choice(["celsius", "celsius", "fahrenheit"])
    question = rng.choice(
        ["What's the weather in {c}?", "Is it warm in {c} right now?", "Weather for {c}, please."]
    )
    args = {"city": city} if unit == "celsius" else {"city": city, "unit": unit}
    result, answer = weather(rng, city, unit)
    return [
        {"role": "user", "content": question.format(c=city)},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", **args)]},
        {"role": "tool", "name": "get_weather", "content": json.dumps(result)},
        {"role": "assistant", "content": answer},
    ]


def calculator_chat(rng: random.Random) -> list[dict]:
    text, value = expression(rng)
    question = rng.choice(["What is {e}?", "Compute {e} for me.", "Can you work out {e}?"])
    return [
        {"role": "user", "content": question.format(e=text)},
        {"role": "assistant", "content": None, "tool_calls": [call("calculate", expression=text)]},
        {"role": "tool", "name": "calculate", "content": str(value)},
        {"role": "assistant", "content": f"{text} = {value}."},
    ]


def both_chat(rng: random.Random) -> list[dict]:
    city = rng.choice(CITIES)
    result, _ = weather(rng, city, "celsius")
    text = f"{result['temperature']} * 9 / 5 + 32"
    fahrenheit = result["temperature"] * 9 / 5 + 32
    return [
        {"role": "user", "content": f"How warm is it in {city} in Fahrenheit? Use the calculator."},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city=city)]},
        {"role": "tool", "name": "get_weather", "content": json.dumps(result)},
        {"role": "assistant", "content": "", "tool_calls": [call("calculate", expression=text)]},
        {"role": "tool", "name": "calculate", "content": f"{fahrenheit:g}"},
        {
            "role": "assistant",
            "content": f"It is {fahrenheit:g} degrees F ({result['temperature']} C) in {city}.",
        },
    ]


def no_tool_chat(rng: random.Random) -> list[dict]:
    city = rng.choice(CITIES)
    return [
        {"role": "user", "content": f"Which country is {city} in? Answer in one word."},
        {"role": "assistant", "content": COUNTRIES[city]},
    ]


COUNTRIES = {
    "Paris": "France",
    "Lagos": "Nigeria",
    "Lima": "Peru",
    "Oslo": "Norway",
    "Osaka": "Japan",
    "Quito": "Ecuador",
    "Perth": "Australia",
    "Cairo": "Egypt",
    "Denver": "USA",
    "Hanoi": "Vietnam",
}


def tool_chats(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    kinds = [weather_chat, calculator_chat, both_chat, no_tool_chat]
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM}, *kinds[i % len(kinds)](rng)]
        out.append({"tools": TOOLS, "messages": messages})
    return out


def reasoning_chats(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    items = ["apples", "pencils", "stamps", "marbles", "books", "shells"]
    out = []
    for _ in range(n):
        name, thing = rng.choice(["Ada", "Ben", "Chen", "Dara", "Eli", "Femi"]), rng.choice(items)
        have, buy, give = rng.randint(3, 40), rng.randint(2, 30), rng.randint(1, 10)
        question = (
            f"{name} has {have} {thing}, buys {buy} more and gives {give} away. How many {thing} are left?"
        )
        total = have + buy
        trace = f"{name} starts with {have}. {have} + {buy} = {total}. {total} - {give} = {total - give}."
        out.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {
                        "role": "assistant",
                        "reasoning_content": trace,
                        "content": f"{have + buy - give} {thing}.",
                    },
                ]
            }
        )
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    write(HERE / "tools" / "tool_calls.jsonl", tool_chats(48))
    write(HERE / "reasoning" / "reasoning.jsonl", reasoning_chats(64))
    (HERE / "tools" / "tools.json").write_text(json.dumps(TOOLS, indent=2) + "\n", encoding="utf-8")
    print("wrote data/tools/tool_calls.jsonl, data/tools/tools.json and data/reasoning/reasoning.jsonl")
