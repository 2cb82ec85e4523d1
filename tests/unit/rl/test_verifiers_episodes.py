"""A verifiers episode as the trainer trains it (training/rl/verifiers_env.py): the first call's prompt, then each
completion the policy drew (policy 1) and what the environment added before the next call (0); where the next
prompt re-tokenized a reply, the environment's part is taken after the reply's end token and the turn counted."""

from __future__ import annotations

import pytest

from training.core.errors import RecipeError
from training.rl.verifiers_env import environment_part, episode_of, rollout_input

EOS = {2}


def answer(*steps, metrics=None):
    return {"steps": list(steps), "metrics": metrics or {"f": 1.0}, "completion": [], "error": None}


def test_an_episode_is_the_tokens_drawn_and_the_environments_between_them():
    first = {"prompt_ids": [1, 5, 6], "completion_ids": [7, 8, 2]}
    second = {"prompt_ids": [1, 5, 6, 7, 8, 2, 9, 10], "completion_ids": [11, 12]}
    e, retokenized = episode_of(answer(first, second), EOS)
    assert retokenized == 0
    assert e.prompt_ids == [1, 5, 6]
    assert e.tokens == [7, 8, 2, 9, 10, 11, 12]
    assert e.policy == [1, 1, 1, 0, 0, 1, 1]
    assert e.turns == 2 and not e.ended and e.env.metrics == {"f": 1.0}


def test_a_reply_re_tokenized_in_the_next_prompt_keeps_the_drawn_tokens_and_is_counted():
    """The template rendered the first reply as [70, 8] instead of the drawn [7, 8]; what follows its end token
    is the environment's."""
    first = {"prompt_ids": [1, 5], "completion_ids": [7, 8, 2]}
    second = {"prompt_ids": [1, 5, 70, 8, 2, 9], "completion_ids": [11, 2]}
    e, retokenized = episode_of(answer(first, second), EOS)
    assert retokenized == 1
    assert e.tokens == [7, 8, 2, 9, 11, 2] and e.policy == [1, 1, 1, 0, 1, 1] and e.ended


def test_a_later_reply_re_tokenized_is_cut_at_its_own_end_token_not_an_earlier_ones():
    """Three calls; the second reply [11, 12, 2] comes back as [110, 12, 2]: the environment's part is what follows
    that reply's end token, found from where the reply begins (the second call's prompt length), not the first
    reply's end token."""
    first = {"prompt_ids": [1, 5], "completion_ids": [7, 2]}
    second = {"prompt_ids": [1, 5, 7, 2, 9], "completion_ids": [11, 12, 2]}
    third = {"prompt_ids": [1, 5, 7, 2, 9, 110, 12, 2, 8], "completion_ids": [13]}
    e, retokenized = episode_of(answer(first, second, third), EOS)
    assert retokenized == 1
    assert e.tokens == [7, 2, 9, 11, 12, 2, 8, 13] and e.policy == [1, 1, 0, 1, 1, 1, 0, 1]


def test_a_reply_cut_at_max_tokens_takes_the_end_token_the_template_adds_as_the_environments():
    assert environment_part([1, 5, 7, 8], [1, 5, 70, 8, 2, 9], 2, EOS) == ([2, 9], 1)
    assert environment_part([1, 5, 7, 8], [1, 5, 7, 8, 2, 9], 2, EOS) == ([2, 9], 0)


def test_a_model_call_without_token_ids_is_refused_but_a_last_one_that_failed_ended_the_episode():
    step = {"prompt_ids": [1], "completion_ids": [2]}
    with pytest.raises(RecipeError, match="whose token ids did not come back"):
        episode_of(answer(None, step), EOS)
    with pytest.raises(RecipeError, match="whose token ids did not come back"):
        episode_of(answer(None), EOS)
    e, _ = episode_of(
        answer(step, None), EOS
    )  # e.g. the next prompt grew past the context: the error ended it
    assert e.tokens == [2] and e.turns == 1 and e.ended


def test_a_prompt_record_becomes_the_environments_rollout_input():
    msgs = [{"role": "user", "content": "hi"}]
    got = rollout_input(msgs, {"prompt": "x", "answer": "a", "info": {"k": 1}, "task": None}, 3)
    assert got == {"prompt": msgs, "example_id": 3, "answer": "a", "info": {"k": 1}}
    assert rollout_input(msgs, {}, "3~1")["example_id"] == "3~1"
