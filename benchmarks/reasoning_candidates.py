"""Which reasoning-gym task can GRPO teach the bundled model? For each candidate (task, config, system prompt,
worked examples as earlier chat turns, reward) it draws 24 prompts with reasoning-gym (seed 0), asks
SmolLM2-135M-Instruct as bundled (fp32) for one greedy reply and a group of 6 sampled ones (temperature 1.0, no
top-k/top-p, as the trainer samples) and scores them with the trainer's own rewards (training.rl.rewards). A
reply passes on a reward of 1.0. GRPO learns only from groups whose rewards differ, so the column to read is
"mixed groups": the share of prompts whose sampled group holds both a pass and a miss. Sampling is seeded
per candidate (torch.manual_seed(0)), so a candidate's figures do not depend on which others run.

    OMP_NUM_THREADS=1 python -m benchmarks.reasoning_candidates                  # every candidate
    python -m benchmarks.reasoning_candidates --only add_turn pick_number_turn   # some of them
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from benchmarks.common import bundled_policy, machine, save_result, table
from training.data import procedural
from training.rl import rewards


@dataclass(frozen=True)
class Candidate:
    task: str
    config: dict
    example: tuple[str, str]  # (question, answer) quoted in the system prompt
    reward: str = "reasoning_gym"
    args: tuple = ()  # the reward's args, as (key, value) pairs
    turns: int = 0  # how many worked examples come first as chat turns (the first is `example`)

    def system(self) -> str:
        q, a = self.example
        if self.args:
            return f"You put the final answer between <answer> and </answer>. For example, asked '{q}' you reply: {a}"
        return f"You reply with the answer alone, nothing else. For example, asked '{q}' you reply: {a}"


ADD = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_parentheses": False}
ADD = {**ADD, "allow_negation": False, "operators": ["+"]}
SUM = ("Calculate 2 + 3.", "5")
MUL = ("Solve the following multiplication: 2 * 3. Give only the result as your final answer.", "6")
PICK = ("Now, pick the largest number of the following candidates: 12.5 30.25", "30.25")
PICK_CONFIG = {"min_num_candidates": 2, "max_num_candidates": 2, "min_n": 1, "max_n": 99, "max_delta": 50}
CANDIDATES = {
    "add": Candidate("basic_arithmetic", ADD, SUM),
    "add_tag": Candidate(
        "basic_arithmetic", ADD, (SUM[0], "<answer>5</answer>"), args=(("answer_tag", "answer"),)
    ),
    "add_math": Candidate("basic_arithmetic", ADD, SUM, "math_equal"),
    "add_turn": Candidate("basic_arithmetic", ADD, SUM, turns=1),
    "add_turn_exact": Candidate("basic_arithmetic", ADD, SUM, "exact_match", turns=1),  # the recipe's
    "add_math_turn": Candidate("basic_arithmetic", ADD, SUM, "math_equal", turns=1),
    "add_2turns": Candidate("basic_arithmetic", ADD, SUM, turns=2),
    "add_sub_turn": Candidate("basic_arithmetic", {**ADD, "operators": ["+", "-"]}, SUM, turns=1),
    "add_2digits_turn": Candidate("basic_arithmetic", {**ADD, "max_digits": 2}, SUM, turns=1),
    "chain_sum_math_turn": Candidate(
        "chain_sum",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        ("State the final answer to the following arithmetic problem: 2 + 3 =", "5"),
        "math_equal",
        turns=1,
    ),
    "products_turn": Candidate(
        "products", {k: ADD[k] for k in ("min_terms", "max_terms", "min_digits", "max_digits")}, MUL, turns=1
    ),
    "pick_number_turn": Candidate("number_format", PICK_CONFIG, PICK, turns=1),
    "leg_counting_math": Candidate(
        "leg_counting",
        {"min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 3},
        ("how many legs are there in total if you have 2 cats?", "8"),
        "math_equal",
    ),
    "letter_counting_math": Candidate(
        "letter_counting",
        {"min_words": 1, "max_words": 1},
        ('How many times does the letter "o" appear in the text: "moon"?', "2"),
        "math_equal",
    ),
    "spell_backward": Candidate(
        "spell_backward", {"min_word_len": 3, "max_word_len": 3}, ("Spell this word backward: cat", "tac")
    ),
    "word_sequence_reversal": Candidate(
        "word_sequence_reversal",
        {"min_words": 2, "max_words": 3},
        ("Reverse this list of words: red, blue", "blue, red"),
    ),
    "gcd_math": Candidate(
        "gcd",
        {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 12},
        ("Find the GCD of these numbers: 4, 6.", "2"),
        "math_equal",
    ),
}
SECOND = ("Calculate 6 + 1.", "7")  # the second worked example of a two-turn candidate


def chats(c: Candidate, questions: list[str]) -> list[list[dict]]:
    shots = [c.example, SECOND][: c.turns]
    turns = [{"role": r, "content": t} for q, a in shots for r, t in (("user", q), ("assistant", a))]
    return [
        [{"role": "system", "content": c.system()}, *turns, {"role": "user", "content": q}] for q in questions
    ]


def replies(model, tokenizer, conversations: list[list[dict]], n: int, max_new_tokens: int) -> list[str]:
    """n sampled replies to each conversation (one greedy reply where n is 0), in one left-padded batch."""
    tokenizer.padding_side = "left"
    ids = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True
    )
    kw = {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": 1.0, "num_return_sequences": n}
    if n == 0:
        kw = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kw)
    return tokenizer.batch_decode(out[:, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def measure(model, tokenizer, name: str, prompts: int, group: int, max_new_tokens: int) -> dict:
    """Greedy and sampled pass rates of one candidate, the share of mixed groups, and passing replies."""
    c = CANDIDATES[name]
    records = [
        procedural.record(c.task, c.config, e)
        for e in procedural.generate(c.task, c.config, prompts, 0, name)
    ]
    conversations = chats(c, [r["prompt"] for r in records])

    def passes(texts: list[str], per: int) -> list[float]:
        cols = {k: [r[k] for r in records for _ in range(per)] for k in ("answer", "reasoning_gym")}
        return [float(s == 1.0) for s in getattr(rewards, c.reward)(texts, **cols, **dict(c.args))]

    torch.manual_seed(0)
    greedy = replies(model, tokenizer, conversations, 0, max_new_tokens)
    sampled = replies(model, tokenizer, conversations, group, max_new_tokens)
    g, s = passes(greedy, 1), passes(sampled, group)
    mixed = sum(0 < sum(s[i : i + group]) < group for i in range(0, len(s), group))
    return {
        "candidate": name,
        "task": c.task,
        "reward": c.reward + "".join(f" {k}={v}" for k, v in c.args),
        "turns": c.turns,
        "greedy_pass": sum(g) / len(g),
        "sampled_pass": sum(s) / len(s),
        "mixed_groups": mixed / prompts,
        "greedy": greedy[:4],
        "passing": [t for t, p in zip(sampled, s) if p][:8],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--only", nargs="*", choices=sorted(CANDIDATES), help="candidates to measure (default all)"
    )
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--group", type=int, default=6, help="sampled replies per prompt (the recipe's group)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    model, tokenizer = bundled_policy(None)
    rows = []
    for name in args.only or CANDIDATES:
        t0 = time.perf_counter()
        rows.append(measure(model, tokenizer, name, args.prompts, args.group, args.max_new_tokens))
        print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    heads = ["candidate", "task", "reward", "turns", "greedy_pass", "sampled_pass", "mixed_groups"]
    print(f"\n{machine()}; {args.prompts} prompts (seed 0), groups of {args.group}")
    print(table(heads, [[r[h] for h in heads] for r in rows]))
    save_result("reasoning_candidates", {"prompts": args.prompts, "group": args.group, "rows": rows})


if __name__ == "__main__":
    main()
