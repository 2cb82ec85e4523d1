"""The bundled RL task's own reward function (named in training/recipes/grpo.yaml as
data/rl/rewards.py:concise): an example of a user reward, called as TRL calls them."""

from __future__ import annotations

import re


def concise(prompts, completions, answer, **kwargs) -> list[float]:
    """How much of the reply is the expected answer: len(answer) / len(reply) when the reply contains the
    answer as a word (any case), else 0 (an empty reply too). "Paris" scores 1.0, "Paris." 0.83, "The capital of France is
    Paris." 0.16: a graded signal towards the answer alone."""
    out = []
    for reply, want in zip(completions, answer):
        if isinstance(reply, list):  # a conversational prompt's completion: [{"role": "assistant", ...}]
            reply = "".join(m["content"] for m in reply)
        reply, want = reply.strip(), str(want)
        found = re.search(rf"\b{re.escape(want)}\b", reply, flags=re.IGNORECASE) is not None
        out.append(len(want) / len(reply) if found and reply else 0.0)
    return out
