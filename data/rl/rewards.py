"""The bundled RL task's own reward function (named in training/recipes/grpo.yaml as
data/rl/rewards.py:mentions_answer): an example of a user reward, called as TRL calls them."""

from __future__ import annotations

import re


def mentions_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the reply contains the expected answer as a word (any case), else 0.0."""
    return [
        float(re.search(rf"\b{re.escape(str(want))}\b", reply, flags=re.IGNORECASE) is not None)
        for reply, want in zip(completions, answer)
    ]
