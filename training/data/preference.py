"""Preference data: checked records -> tokenized pairs -> batches of two sequences per example.

  pairwise  {"prompt"?, "chosen", "rejected"}        strings, or message lists (UltraFeedback-style:
                                                     whole conversations without a prompt share their
                                                     common prefix as the prompt)
  unpaired  {"prompt", "completion", "label": bool}  KTO
`data.columns` maps these names as for the other formats. Every example becomes two sequences, each
rendered with the chat template, labels on the completion's assistant tokens only:
  pairwise  input_ids/labels = prompt + chosen,      other_input_ids/other_labels = prompt + rejected
  unpaired  input_ids/labels = prompt + completion,  other_* = prompt + the NEXT record's completion
            (KTO's mismatched pair that estimates the KL reference point; fixed by the data, so the
            estimate does not depend on the batch size or the number of processes)
plus `row` (the example's index in its split: precomputed reference log-probabilities are looked up
by it) and, for KTO, `label`. A batch stacks the first sequences over the second ones: [2B, L].
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from training.config import DataSection
from training.core.batch import IGNORE
from training.data import completions
from training.data.formats import RecordFormat, ensure_chat_template
from training.data.loader import EpochSampler, pad_batch
from training.data.tokenize import (
    ChatOptions,
    apply_too_long,
    chat_options,
    drop_unlearnable,
    learns,
    tokenize_chat,
)

PAIR_COLUMNS = ("input_ids", "labels", "other_input_ids", "other_labels")


@dataclass(frozen=True)
class PreferenceFormat(RecordFormat):
    """The record format of data.format=pairwise or unpaired (same interface as RecordFormat)."""

    def problem(self, rec) -> str | None:
        if not isinstance(rec, dict):
            return "expected a JSON object"
        prompt = rec.get(self.name("prompt"))
        if self.format == "unpaired":
            sides = (("prompt", prompt, False), ("completion", rec.get(self.name("completion")), True))
        else:
            sides = (
                ("chosen", rec.get(self.name("chosen")), True),
                ("rejected", rec.get(self.name("rejected")), True),
            )
            if prompt is not None or all(isinstance(v, str) for _, v, _ in sides):
                sides = (("prompt", prompt, False), *sides)
        for side, value, completion in sides:
            if (why := completions.side_problem(value, self.label(side), completion)) is not None:
                hint = (
                    "data.format=unpaired needs prompt, completion and label"
                    if self.format == "unpaired"
                    else "data.format=pairwise needs chosen and rejected (and prompt unless they are message lists)"
                )
                return f"{why} ({hint}){self._present(rec) if value is None else ''}"
        if self.format == "unpaired":
            label = rec.get(self.name("label"))
            if not isinstance(label, bool):
                return f"field {self.label('label')} must be true or false, not {label!r:.40}"
            prompt_msgs, completion = self.example(rec)
            if not completions.learns_something(completion, 0):
                return f"no assistant message in {self.label('completion')}, so nothing to learn from"
            return None
        prompt_msgs, chosen, rejected = self.pair(rec)
        if chosen == rejected:
            return f"{self.label('chosen')} and {self.label('rejected')} are identical, so there is no preference"
        for side, msgs in (("chosen", chosen), ("rejected", rejected)):
            if not completions.learns_something(msgs, 0):
                return f"no assistant message in {self.label(side)} after the shared prompt"
        return None

    def pair(self, rec: dict) -> tuple[list[dict], list[dict], list[dict]]:
        """(prompt, chosen completion, rejected completion) as chat messages."""
        chosen = completions.side_messages(rec[self.name("chosen")], "assistant")
        rejected = completions.side_messages(rec[self.name("rejected")], "assistant")
        prompt = rec.get(self.name("prompt"))
        if prompt is None:
            return completions.split_shared_prompt(chosen, rejected)
        return completions.side_messages(prompt, "user"), chosen, rejected

    def example(self, rec: dict) -> tuple[list[dict], list[dict]]:
        """(prompt, completion) of an unpaired record, as chat messages."""
        prompt = completions.side_messages(rec[self.name("prompt")], "user")
        return prompt, completions.side_messages(rec[self.name("completion")], "assistant")


def is_preference(data: DataSection) -> bool:
    return data.format in ("pairwise", "unpaired")


def preference_format(data: DataSection) -> PreferenceFormat:
    return PreferenceFormat(data.format, dict(data.columns), data.system_prompt)


def _system(fmt: RecordFormat, prompt: list[dict]) -> list[dict]:
    if fmt.system_prompt and not (prompt and prompt[0]["role"] == "system"):
        return [{"role": "system", "content": fmt.system_prompt}, *prompt]
    return prompt


def _sequence(tokenizer, prompt: list[dict], completion: list[dict], options: ChatOptions) -> dict:
    return tokenize_chat(prompt + completion, tokenizer, train_from=len(prompt), options=options)


def tokenize_preference(
    ds: datasets.Dataset,
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    key: str,
    stats: dict,
) -> datasets.Dataset:
    """Records -> rows of two tokenized sequences (see the module doc); data.too_long applied per row."""
    ensure_chat_template(tokenizer, data)
    fmt, options = preference_format(data), chat_options(data)
    if fmt.format == "unpaired":
        completions_ = [fmt.example(r)[1] for r in ds]  # the KL pair takes the next record's completion

    def one(rec, i):
        if fmt.format == "pairwise":
            prompt, chosen, rejected = fmt.pair(rec)
            prompt = _system(fmt, prompt)
            a, b = (
                _sequence(tokenizer, prompt, chosen, options),
                _sequence(tokenizer, prompt, rejected, options),
            )
            extra = {}
        else:
            prompt, completion = fmt.example(rec)
            prompt = _system(fmt, prompt)
            a = _sequence(tokenizer, prompt, completion, options)
            b = _sequence(tokenizer, prompt, completions_[(i + 1) % len(completions_)], options)
            extra = {"label": int(rec[fmt.name("label")])}
        return {
            "input_ids": a["input_ids"],
            "labels": a["labels"],
            "other_input_ids": b["input_ids"],
            "other_labels": b["labels"],
            "row": i,
            "length": max(len(a["input_ids"]), len(b["input_ids"])),
            **extra,
        }

    out = ds.map(one, with_indices=True, remove_columns=ds.column_names, desc=f"tokenizing {key}")
    out = apply_too_long(out, data, PAIR_COLUMNS, key, stats)
    # both sequences keep a labelled token after the first one
    out = drop_unlearnable(out, lambda r: learns(r["labels"]) and learns(r["other_labels"]), key, stats)
    # `row` indexes the rows that are left (precomputed reference log-probabilities are looked up by it)
    return out.remove_columns(["length", "row"]).add_column("row", list(range(len(out))))


@dataclass
class PreferenceCollator:
    """Rows of two sequences -> one padded batch: input_ids/attention_mask/labels [2B, L] (the B first
    sequences, then the B second ones), `row` [B] and, for KTO, `label` [B]."""

    pad_token_id: int

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        seqs = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
        seqs += [{"input_ids": r["other_input_ids"], "labels": r["other_labels"]} for r in rows]
        seqs = [{**s, "attention_mask": [1] * len(s["input_ids"])} for s in seqs]
        batch = pad_batch(seqs, {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE})
        batch["row"] = torch.tensor([r["row"] for r in rows])
        if "label" in rows[0]:
            batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
        return batch


def make_preference_loader(ds, batch_size: int, tokenizer, seed: int, shuffle: bool):
    """Like loader.make_loader (the same resumable order), for preference rows."""
    return torch.utils.data.DataLoader(
        ds.with_format(None),
        batch_size=batch_size,
        sampler=EpochSampler(len(ds), seed, shuffle),
        collate_fn=PreferenceCollator(tokenizer.pad_token_id),
        drop_last=shuffle,
        generator=torch.Generator().manual_seed(seed),
    )
