"""Reward functions of online RL: the built-ins, the user's own (loaded by file path or module), and the
checked call that turns their answers into a [completions, functions] tensor.

Every function is called as TRL calls its reward functions:
    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> [number, ...]
with one entry per completion; `prompts` repeats each prompt for each completion of its group, and every
extra column of the prompt records comes as a keyword argument holding a list of the same length.
A conversational prompt (a list of messages) gets completions as [{"role": "assistant", "content": ...}].
A function that raises, returns the wrong number of values, or a value that is not a finite number
stops the run with the function's name and the offending value (RewardError, exit code 2): the last
good checkpoint was written before the step began, so it stays intact.

The built-in `reward_model` scores with a sequence-classification checkpoint (num_labels 1) as TRL's
GRPOTrainer scores with reward models: a conversational prompt and its assistant completion rendered with
the reward model's own chat template, a plain prompt and completion concatenated; right-padded batches, no
special tokens added, the score is the logit of the last real token. Loaded once, on the training device.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from training.config import RewardSpec, RLSection
from training.core.errors import RecipeError, UserError
from training.data import procedural
from training.rl.code_refs import import_code

log = logging.getLogger(__name__)


class RewardError(UserError):
    """A reward function failed or answered wrongly (exit code 2, no traceback)."""


# ----------------------------------------------------------------------------- built-ins


def completion_text(completion) -> str:
    """The text of a completion: a string, or the content of its last assistant message (an episode's final
    reply; tool results are not the policy's answer)."""
    if isinstance(completion, str):
        return completion
    replies = [m for m in completion if m.get("role", "assistant") == "assistant"]
    return (replies[-1].get("content") or "") if replies else ""


def normalise(text: str) -> str:
    """Lower case, inner whitespace collapsed, surrounding spaces and final punctuation dropped."""
    return re.sub(r"\s+", " ", str(text)).strip().strip(".!").strip().lower()


def answer_of(text: str, tag: str | None) -> str | None:
    """The text inside the last <tag>...</tag>, or the whole text without a tag (None: tag missing)."""
    if not tag:
        return text
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return found[-1] if found else None


def exact_match(completions, column: str = "answer", answer_tag: str | None = None, **kw) -> list[float]:
    """1.0 where the completion (or its <answer_tag> part) equals the record's `column` after
    normalisation (case, spaces, final punctuation), else 0.0."""
    out = []
    for c, want in zip(completions, kw[column]):
        got = answer_of(completion_text(c), answer_tag)
        out.append(float(got is not None and normalise(got) == normalise(want)))
    return out


def math_equal(completions, column: str = "answer", answer_tag: str | None = None, **kw) -> list[float]:
    """1.0 where the completion's final answer is mathematically equal to `column` (math-verify: numbers,
    fractions, LaTeX, sets), else 0.0."""
    from math_verify import parse, verify  # here: its LaTeX parser costs ~0.3 s of every run's start-up

    out = []
    for c, want in zip(completions, kw[column]):
        got = answer_of(completion_text(c), answer_tag)
        gold = parse(str(want) if "$" in str(want) else f"${want}$")
        out.append(float(got is not None and bool(verify(gold, parse(got)))))
    return out


def reasoning_gym(completions, reasoning_gym, answer_tag: str | None = None, **kw) -> list[float]:
    """The task's own score_answer(answer, entry) for the records data.train: reasoning_gym:TASK makes (their
    `reasoning_gym` column: task, config, entry); the answer is the completion (or its last <answer_tag>
    part), stripped as reasoning-gym's extract_answer strips it; None where the tag is missing (the task
    scores that: 0.0)."""
    out = []
    for c, column in zip(completions, reasoning_gym):
        made = json.loads(column) if isinstance(column, str) else column
        got = answer_of(completion_text(c), answer_tag)
        out.append(float(procedural.scorer(made)(got.strip() if got is not None else None, made["entry"])))
    return out


def regex(completions, pattern: str, **kw) -> list[float]:
    """1.0 where the whole completion (surrounding spaces aside) matches `pattern`, else 0.0: a format check."""
    rx = re.compile(pattern, flags=re.DOTALL)
    return [float(rx.fullmatch(completion_text(c).strip()) is not None) for c in completions]


def length_penalty(completions, max_chars: int = 200, **kw) -> list[float]:
    """0 up to `max_chars` characters, then falling linearly to -1 at twice that length (and staying there)."""
    return [-min(1.0, max(0, len(completion_text(c)) - max_chars) / max_chars) for c in completions]


def overlong_penalty(completion_ids, max_tokens: int, buffer: int | None = None, **kw) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then falling linearly to -1 at
    max_tokens (rl.max_new_tokens: a completion cut there gets -1)."""
    buffer = buffer or max(1, max_tokens // 4)
    start = max_tokens - buffer
    return [-min(1.0, max(0, len(ids) - start) / buffer) for ids in completion_ids]


BUILTINS: dict[str, Callable] = {
    "exact_match": exact_match,
    "math_equal": math_equal,
    "math_verify": math_equal,  # the name the issue gives it: it scores with math-verify
    "reasoning_gym": reasoning_gym,
    "regex": regex,
    "length_penalty": length_penalty,
    "overlong_penalty": overlong_penalty,
}


# ----------------------------------------------------------------------------- a reward model

REWARD_MODEL_BATCH = 32  # texts per forward of the reward model


@dataclass
class RewardModel:
    """A sequence-classification model with one label as a reward function (see the module doc)."""

    model: torch.nn.Module
    tokenizer: object
    device: torch.device | str

    def text(self, prompt, completion) -> str:
        if isinstance(prompt, list):  # messages: the conversation with the assistant's completion
            return self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        return prompt + completion

    @torch.no_grad()
    def __call__(self, prompts, completions, **kw) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        scores = []
        for i in range(0, len(texts), REWARD_MODEL_BATCH):
            batch = self.tokenizer(
                texts[i : i + REWARD_MODEL_BATCH],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(self.device)
            scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores


def load_reward_model(path: str, key: str, device) -> RewardModel:
    """The checkpoint at `path` (a directory, or a model in the Hugging Face cache) with its tokenizer,
    checked to be a sequence-classification model with num_labels 1 (RecipeError naming `key` and the path)."""
    what = f"{key}: reward model {path}"
    wanted = (
        "a sequence-classification checkpoint (AutoModelForSequenceClassification, num_labels=1) "
        "with its tokenizer"
    )
    local = Path(path).expanduser()
    if local.exists():
        path = str(local)
    elif local.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1:  # not a hub model id
        raise RecipeError(f"{what} does not exist; give {wanted}")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RecipeError(f"{what} cannot be read ({str(e).splitlines()[0]}); give {wanted}") from None
    architectures = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RecipeError(
            f"{what} is not a sequence-classification model (architectures: "
            f"{', '.join(architectures) or 'none'}); give {wanted}"
        )
    if config.num_labels != 1:
        raise RecipeError(
            f"{what} has num_labels={config.num_labels}: a reward model gives one score (num_labels=1)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RecipeError(f"{what} cannot be loaded ({str(e).splitlines()[0]}); give {wanted}") from None
    if tokenizer.pad_token_id is None:  # as TRL: pad with the end-of-sequence token
        if tokenizer.eos_token is None:
            raise RecipeError(f"{what}: its tokenizer has neither a pad nor an end-of-sequence token")
        tokenizer.pad_token = tokenizer.eos_token
    # the score is read at the last token that is not padding: the model must know the tokenizer's pad token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    return RewardModel(model.to(device).eval(), tokenizer, device)


# ----------------------------------------------------------------------------- the user's own


def load_function(spec: RewardSpec, key: str, max_new_tokens: int = 0) -> Callable:
    """The function a reward names: a built-in, `path/to/file.py:name`, or `package.module:name`."""
    if spec.function in BUILTINS:
        fn, args = BUILTINS[spec.function], spec.args.given()
        if spec.function == "overlong_penalty":
            args["max_tokens"] = max_new_tokens
        return lambda **kw: fn(**kw, **args)
    return import_code(spec.function, key, "reward")


@dataclass
class Reward:
    name: str
    weight: float
    fn: Callable
    key: str  # rl.rewards[i], for messages


def load_rewards(cfg: RLSection, device="cpu") -> list[Reward]:
    """The recipe's reward functions, loaded once (a reward model on `device`, the training device)."""
    out = []
    for i, s in enumerate(cfg.rewards):
        if s.function == "reward_model":
            fn = load_reward_model(s.args.path, f"rl.rewards[{i}].args.path", device)
        else:
            fn = load_function(s, f"rl.rewards[{i}].function", cfg.max_new_tokens)
        out.append(Reward(s.name, s.weight, fn, f"rl.rewards[{i}] ({s.name})"))
    return out


def score(
    rewards: list[Reward], prompts: list, completions: list, completion_ids: list, columns: dict
) -> torch.Tensor:
    """[completions, functions] float64 rewards, each function's answers checked (RewardError)."""
    n = len(completions)
    out = torch.zeros(n, len(rewards), dtype=torch.float64)
    for j, r in enumerate(rewards):
        try:
            values = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # noqa: BLE001 (the user's function may raise anything)
            raise RewardError(f"{r.key} raised {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"{r.key} returned {type(values).__name__} ({values!r:.60}), not a list of numbers"
            ) from None
        if len(values) != n:
            raise RewardError(
                f"{r.key} returned {len(values)} values for {n} completions (one per completion)"
            )
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise RewardError(
                    f"{r.key} returned {v!r:.60} ({type(v).__name__}) for completion {i}, not a finite number"
                )
            out[i, j] = float(v)
    return out


def weights(rewards: list[Reward]) -> torch.Tensor:
    return torch.tensor([r.weight for r in rewards], dtype=torch.float64)
