"""A single-turn verifiers environment (verifiers 0.3's classic API), as its docs write one: a dataset of
questions and answers, a system prompt, a parser and a rubric of two weighted functions.

    python -m training.verifiers_data data/environments/reverse_verifiers.py --out prompts.jsonl
"""

import verifiers as vf
from datasets import Dataset

WORDS = ["stone", "river", "apple", "cloud", "maple", "tiger", "ocean", "lemon", "piano", "wagon"]


def load_environment(size: int = 10, **kwargs) -> vf.Environment:
    rows = [{"question": f"Reverse the word: {w}", "answer": w[::-1]} for w in (WORDS * size)[:size]]
    parser = vf.Parser()

    def reversed_word(completion, answer, **kw) -> float:
        return float(answer in (parser.parse_answer(completion) or ""))

    def short(completion, **kw) -> float:
        return float(len(parser.parse_answer(completion) or "") <= 20)

    rubric = vf.Rubric(funcs=[reversed_word, short], weights=[1.0, 0.2], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        system_prompt="Answer with the reversed word only.",
        parser=parser,
        rubric=rubric,
        **kwargs,
    )
