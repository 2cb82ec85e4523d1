"""A small verifiers environment (verifiers 0.3's classic API), as the Environments Hub publishes them: each
prompt asks for a word, the environment answers the first reply with a second question, and the rubric scores
the episode with two weighted functions. `load_environment(size=, turns=)` returns it.

    python -m training.verifiers_data data/environments/echo_verifiers.py --out prompts.jsonl
"""

import verifiers as vf
from datasets import Dataset

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "lemon"]
HELD_OUT = ["piano", "wagon", "candle", "forest", "silver", "rabbit", "garden", "pencil"]  # its eval dataset


class TwoTurnEnv(vf.MultiTurnEnv):
    """After the first reply the environment asks again; the episode ends after `max_turns` replies."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Say the word once more.")]


def says_word(completion, answer, **kwargs) -> float:
    replies = [m["content"] or "" for m in completion if m["role"] == "assistant"]
    return float(bool(replies) and all(answer in r.lower() for r in replies))


def brevity(completion, **kwargs) -> float:
    replies = [m["content"] or "" for m in completion if m["role"] == "assistant"]
    return 1.0 / (1.0 + sum(len(r) for r in replies) / 40)


def rows(words: list[str], size: int) -> Dataset:
    return Dataset.from_list(
        [{"question": f"Say the word {w}.", "answer": w} for w in (words * (size // len(words) + 1))[:size]]
    )


def load_environment(size: int = 8, turns: int = 2, **kwargs) -> vf.Environment:
    rubric = vf.Rubric(funcs=[says_word, brevity], weights=[1.0, 0.5])
    return TwoTurnEnv(
        dataset=rows(WORDS, size),
        eval_dataset=rows(HELD_OUT, len(HELD_OUT)),
        rubric=rubric,
        max_turns=turns,
        **kwargs,
    )
