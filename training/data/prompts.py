"""Prompt data of online RL: checked records -> tokenized prompts -> batches of prompts.

  prompts  {"prompt": str | [messages], ...any other columns}
The prompt is rendered with the chat template (data.chat_template and data.chat_template_kwargs apply, e.g.
enable_thinking) and its generation prompt (the assistant's turn opens);
the completion is sampled during training. Every other column of the record (an `answer`, a `solution`,
test cases) is kept, as JSON, and handed to the reward functions by row (TRL passes them the same way).
A record without a prompt, with an empty one, or without a column a built-in reward reads is reported
with its file and line. Rows carry `row`, their index in the split, by which the columns are found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from training.config import DataSection
from training.data import completions
from training.data.formats import RecordFormat, ensure_chat_template
from training.data.loader import EpochSampler, pad_batch


@dataclass(frozen=True)
class PromptFormat(RecordFormat):
    """The record format of data.format=prompts; `needs`: columns the rewards read."""

    needs: tuple[str, ...] = ()

    def problem(self, rec) -> str | None:
        if not isinstance(rec, dict):
            return "expected a JSON object"
        prompt = rec.get(self.name("prompt"))
        if (why := completions.side_problem(prompt, self.label("prompt"), False)) is not None:
            return f"{why} (data.format=prompts needs a prompt: a string or a list of messages){self._present(rec)}"
        if isinstance(prompt, str) and not prompt.strip():
            return f"field {self.label('prompt')} is empty"
        if isinstance(prompt, list) and not prompt:
            return f"field {self.label('prompt')} is an empty list of messages"
        for column in self.needs:
            if rec.get(column) is None:
                return f"missing column '{column}', which a reward reads (rl.rewards){self._present(rec)}"
        return None

    def messages(self, rec: dict) -> list[dict]:
        msgs = completions.side_messages(rec[self.name("prompt")], "user")
        if self.system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs


def prompt_format(data: DataSection, needs: list[str] | tuple[str, ...] = ()) -> PromptFormat:
    return PromptFormat(data.format, dict(data.columns), data.system_prompt, needs=tuple(needs))


def tokenize_prompts(
    ds: datasets.Dataset, data: DataSection, tokenizer: PreTrainedTokenizerBase, key: str, stats: dict
) -> datasets.Dataset:
    """Records -> {input_ids (the rendered prompt), prompt (JSON), extra (the other columns, JSON), row};
    prompts longer than data.max_length are left out (counted) whatever data.too_long says: a cut prompt
    asks another question."""
    ensure_chat_template(tokenizer, data)
    fmt = prompt_format(data)
    prompt_key = fmt.name("prompt")

    def one(rec, i):
        msgs = fmt.messages(rec)
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, **data.chat_template_kwargs
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = rec[prompt_key] if isinstance(rec[prompt_key], str) else msgs
        extra = {k: v for k, v in rec.items() if k != prompt_key}
        return {"input_ids": ids, "prompt": json.dumps(prompt), "extra": json.dumps(extra), "row": i}

    out = ds.map(one, with_indices=True, remove_columns=ds.column_names, desc=f"tokenizing {key}")
    before = len(out)
    out = out.filter(lambda r: len(r["input_ids"]) <= data.max_length, desc=f"dropping long prompts in {key}")
    stats["dropped_too_long"] = before - len(out)
    return out


def row_columns(ds: datasets.Dataset) -> tuple[list, list[dict]]:
    """(prompts, extra columns) of every row of a tokenized prompt split, by `row`."""
    return [json.loads(p) for p in ds["prompt"]], [json.loads(e) for e in ds["extra"]]


@dataclass
class PromptCollator:
    """Prompts -> input_ids/attention_mask [B, L] (right-padded; `prompt_len` says where each ends), row [B]."""

    pad_token_id: int

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        seqs = [{"input_ids": r["input_ids"], "attention_mask": [1] * len(r["input_ids"])} for r in rows]
        batch = pad_batch(seqs, {"input_ids": self.pad_token_id, "attention_mask": 0})
        batch["prompt_len"] = torch.tensor([len(r["input_ids"]) for r in rows])
        batch["row"] = torch.tensor([r["row"] for r in rows])
        return batch


class RepeatedWindows(EpochSampler):
    """EpochSampler's shuffle cut into windows of `window` rows (one optimizer step's global batch of
    prompts), each window yielded `repeat` times in a row (rl.num_iterations), as TRL's RepeatSampler does
    with its repeat_count; a last partial window is left out (TRL drops it too), so every window stays whole.

    The order depends only on (seed, epoch, window, repeat): one process with batch B x N and N processes
    with batch B (accelerate deals the batches round-robin, so each rank's `grad_accum` micro-batches of a
    window come from the same `window` rows) see the same prompts at every step, and a resume that skips
    step x grad_accum micro-batches lands on the same window, in the middle of its repeats too."""

    def __init__(self, n: int, seed: int, window: int, repeat: int):
        super().__init__(n, seed, shuffle=True)
        self.window, self.repeat = window, repeat

    def __len__(self) -> int:
        return (self.n // self.window) * self.window * self.repeat

    def __iter__(self):
        order = list(super().__iter__())
        for start in range(0, len(order) - self.window + 1, self.window):
            for _ in range(self.repeat):
                yield from order[start : start + self.window]


def make_prompt_loader(
    ds, batch_size: int, tokenizer, seed: int, shuffle: bool, window: int = 0, repeat: int = 1
):
    """Like loader.make_loader (the same resumable order), for prompt rows. `repeat` > 1 (training only):
    each global window of `window` prompts comes `repeat` times in a row (RepeatedWindows)."""
    sampler = (
        RepeatedWindows(len(ds), seed, window, repeat) if repeat > 1 else EpochSampler(len(ds), seed, shuffle)
    )
    return torch.utils.data.DataLoader(
        ds.select_columns(["input_ids", "row"]).with_format(None),
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=PromptCollator(tokenizer.pad_token_id),
        drop_last=shuffle,
        generator=torch.Generator().manual_seed(seed),
    )
