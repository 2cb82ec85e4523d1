"""Tokenizing: raw records -> input_ids with aligned labels (the model shifts them).

IGNORE (-100) marks a token without loss. Chat-like formats are rendered with the chat template (with the
record's tools and data.chat_template_kwargs) and carry labels on the assistant turns that data.train_on
picks (their reasoning traces masked out with data.reasoning: mask; tool results never); examples longer
than data.max_length are truncated or dropped (data.too_long), and examples left with nothing to learn
are dropped. Text documents are joined with
EOS and cut into blocks of data.max_length tokens, every token labelled.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field

import datasets
from transformers import PreTrainedTokenizerBase

from training.config import DataSection
from training.core.batch import IGNORE
from training.core.errors import DataError
from training.data import images, turns
from training.data.formats import RecordFormat, ensure_chat_template

PROGRESS_MIN_ROWS = 5000  # show datasets' progress bars when a split is at least this long
datasets.disable_progress_bars()


@contextlib.contextmanager
def progress(n_rows: int):
    """datasets' progress bars for long preprocessing only (short runs and tests stay quiet)."""
    if n_rows < PROGRESS_MIN_ROWS:
        yield
        return
    datasets.enable_progress_bars()
    try:
        yield
    finally:
        datasets.disable_progress_bars()


@dataclass(frozen=True)
class ChatOptions:
    """How chats are rendered and which of their tokens carry labels (the data section's chat keys)."""

    train_on: str = "all"  # data.train_on (turns.trained_turns)
    reasoning: str = "train"  # data.reasoning: train on traces, or mask them
    template_kwargs: dict = field(default_factory=dict)  # data.chat_template_kwargs
    template: str | None = None  # data.chat_template, named in messages


def chat_options(data: DataSection) -> ChatOptions:
    return ChatOptions(data.train_on, data.reasoning, dict(data.chat_template_kwargs), data.chat_template)


PLAIN = ChatOptions()


def tokenize_chat(
    messages: list[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    train_from: int = 0,
    tools: list[dict] | None = None,
    options: ChatOptions = PLAIN,
) -> dict:
    """Render with the chat template (tools and options.template_kwargs passed to it, as transformers
    does); labels only on the assistant turns that turns.trained_turns picks from message `train_from` on
    (a prompt-completion record's completion), found by rendering prefixes; with options.reasoning=mask,
    not on their reasoning traces. Tool results never carry labels.

    With max_length the result is truncated; without, the caller applies data.too_long.
    """
    kwargs = options.template_kwargs
    if tools or any(m.get("tool_calls") for m in messages):
        check_renders_tools(tokenizer, options)
    traces = [turns.trace_of(m) for m in messages]
    if any(traces) and not renders_reasoning(tokenizer, kwargs):
        messages = [turns.inline_trace(m) for m in messages]
    shown = [{k: v for k, v in m.items() if k != "train"} for m in messages]

    def render(msgs: list[dict], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(
            msgs, tools=tools or None, tokenize=False, add_generation_prompt=gen, **kwargs
        )

    full = render(shown)
    spans, masked = [], []
    for i in turns.trained_turns(messages, train_from, options.train_on):
        # where the turn starts: after the generation prompt (or where the prompt and the chat part ways)
        start = len(os.path.commonprefix([render(shown[:i], gen=True), full]))
        upto = render(shown[: i + 1])
        if not full.startswith(upto):
            raise DataError(
                f"the chat template of {template_name(tokenizer, options)} renders assistant message {i} "
                f"differently once later messages follow (e.g. it drops the reasoning of earlier turns), so "
                f"the tokens to train on cannot be found: bring a prefix-preserving template: "
                f"data.chat_template: PATH (such as TRL's *_training.jinja templates), or set "
                f"data.train_on: last"
            )
        spans.append((start, len(upto)))
        if options.reasoning == "mask" and traces[i]:
            masked.append(trace_span(full, traces[i], start, len(upto), i, tokenizer, options))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        tok if any(s <= a < e for s, e in spans) and not any(s <= a < e for s, e in masked) else IGNORE
        for tok, (a, _) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    ids = enc["input_ids"]
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "labels": labels}


def template_name(tokenizer: PreTrainedTokenizerBase, options: ChatOptions) -> str:
    if options.template:
        return f"data.chat_template {options.template}"
    return f"tokenizer {tokenizer.name_or_path or type(tokenizer).__name__}"


def trace_span(full: str, trace: str, start: int, end: int, i: int, tokenizer, options) -> tuple[int, int]:
    """Where a reasoning trace lies in the rendered turn [start, end), with its <think> tags."""
    at = full.find(trace.strip(), start, end)
    if at < 0:
        raise DataError(
            f"data.reasoning: mask: the chat template of {template_name(tokenizer, options)} does not show "
            f"the reasoning of assistant message {i} in its turn, so it cannot be masked; bring a template "
            f"that renders reasoning_content: data.chat_template: PATH"
        )
    stop = at + len(trace.strip())
    if opening := re.search(r"<think>\s*$", full[start:at]):
        at = start + opening.start()
    if closing := re.match(r"\s*</think>\s*", full[stop:end]):
        stop += closing.end()
    return at, stop


# Probes: a tiny chat that uses a feature, rendered once per template and keyword arguments.
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "llm_forge_probe",
        "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
PROBE_CALL = [
    {"type": "function", "function": {"name": "llm_forge_probe", "arguments": {"q": "probe-value"}}}
]
PROBE_TRACE = "llm-forge-probe-trace"
_PROBED: dict = {}


def _probe(tokenizer, kwargs: dict, what: str):
    key = (tokenizer.chat_template, json.dumps(kwargs, sort_keys=True, default=str), what)
    if key not in _PROBED:
        _PROBED[key] = (probe_tools if what == "tools" else probe_reasoning)(tokenizer, kwargs)
    return _PROBED[key]


def probe_tools(tokenizer, kwargs: dict) -> str | None:
    """Why the template cannot render tool definitions and calls (None if it can)."""
    user = [{"role": "user", "content": "Look up x."}]
    call = {"role": "assistant", "content": "", "tool_calls": PROBE_CALL}
    chat = user + [call, {"role": "tool", "content": "found"}, {"role": "assistant", "content": "Done."}]
    try:
        prompt = tokenizer.apply_chat_template(user, tools=[PROBE_TOOL], tokenize=False, **kwargs)
        asked = tokenizer.apply_chat_template(
            user, tools=[PROBE_TOOL], tokenize=False, add_generation_prompt=True, **kwargs
        )
        text = tokenizer.apply_chat_template(chat, tools=[PROBE_TOOL], tokenize=False, **kwargs)
    except Exception as e:  # a template may raise on what it does not know
        first = str(e).splitlines()[0] if str(e) else ""
        return f"rendering a chat with tools fails ({type(e).__name__}: {first})"
    if "llm_forge_probe" not in prompt:
        return "the tool definitions passed as tools= do not appear in the text"
    if "probe-value" not in text[len(os.path.commonprefix([asked, text])) :]:
        return "an assistant message's tool_calls do not appear in its turn"
    return None


def probe_reasoning(tokenizer, kwargs: dict) -> bool:
    """Whether the template renders an assistant message's reasoning_content itself."""
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": PROBE_TRACE},
    ]
    try:
        return PROBE_TRACE in tokenizer.apply_chat_template(chat, tokenize=False, **kwargs)
    except Exception:  # a template that chokes on the key does not render it
        return False


def check_renders_tools(tokenizer, options: ChatOptions) -> None:
    """Refuse a template that would silently drop tools or tool calls."""
    if why := _probe(tokenizer, options.template_kwargs, "tools"):
        raise DataError(
            f"the data has tool calls, but the chat template of {template_name(tokenizer, options)} cannot "
            f"render them: {why}; training on it would teach a chat without its tools. Bring a template that "
            f"renders tools and tool_calls: data.chat_template: PATH (a Jinja file, e.g. the model family's "
            f"template with tool support)"
        )


def renders_reasoning(tokenizer, kwargs: dict) -> bool:
    return _probe(tokenizer, kwargs, "reasoning")


def text_blocks(
    ds: datasets.Dataset, fmt: RecordFormat, tokenizer: PreTrainedTokenizerBase, block: int, desc: str
) -> datasets.Dataset:
    """Documents joined with EOS and cut into full blocks of `block` tokens.

    The tail of each 1000 documents (less than one block) is dropped.
    """
    eos, column = tokenizer.eos_token_id, fmt.name("text")
    if eos is None:
        raise DataError(
            "model.tokenizer: the tokenizer has no EOS token to separate documents (format: text)"
        )

    def to_blocks(batch):
        ids: list[int] = []
        for text in batch[column]:
            if text.strip():
                ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return ds.map(to_blocks, batched=True, batch_size=1000, remove_columns=ds.column_names, desc=desc)


def chat_examples(
    ds: datasets.Dataset,
    fmt: RecordFormat,
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    key: str,
    stats: dict,
) -> datasets.Dataset:
    """Records -> tokenized chats, data.too_long applied, examples without a labelled token removed.

    Counts what was truncated or dropped into `stats`.
    """
    ensure_chat_template(tokenizer, data)
    options = chat_options(data)
    expand = images.ImageExpander(data.images, tokenizer) if data.images else None
    one = chat_tokenizer(fmt, tokenizer, options, expand, key)
    out = ds.map(one, remove_columns=ds.column_names, desc=f"tokenizing {key}")
    out = apply_too_long(out, data, ("input_ids", "labels"), key, stats)
    if expand is not None:
        out = whole_images(out, data, key, stats)
    out = drop_unlearnable(out, lambda r: learns(r["labels"]), key, stats)
    return out.remove_columns("length")


def chat_tokenizer(fmt: RecordFormat, tokenizer, options: ChatOptions, expand, key: str):
    """The function that tokenizes one record's chat (tokenize_chat, untruncated) and adds its `length`; for
    an image-text run (`expand`, an images.ImageExpander) with its image tokens expanded (image_end)."""

    def one(rec):
        msgs, start = fmt.messages(rec), fmt.completion_start(rec)
        enc = tokenize_chat(msgs, tokenizer, train_from=start, tools=fmt.tools(rec), options=options)
        if expand is not None:
            enc = expanded_images(enc, rec, expand, tokenizer, options, key)
        n = len(enc["input_ids"])
        return {**enc, "length": n}

    return one


def expanded_images(enc: dict, rec: dict, expand, tokenizer, options: ChatOptions, key: str) -> dict:
    """A tokenized chat with each image placeholder replaced by the model's image tokens (no loss on them);
    the record's files ride along, and `image_end` is where the last picture's tokens end. Every image must appear in
    the rendered text."""
    found = enc["input_ids"].count(expand.token_id)
    if found != len(rec["images"]):
        raise DataError(
            f"{key}: the chat template of {template_name(tokenizer, options)} shows {found} of a "
            f"record's {len(rec['images'])} {expand.spec.expanded} placeholder(s) (the record's first image is "
            f"{rec['images'][0] if rec['images'] else 'none'}); every image must appear in the text"
        )
    ids, labels, end = expand(enc["input_ids"], enc["labels"], rec["images"])
    return {"input_ids": ids, "labels": labels, "images": rec["images"], "image_end": end}


def whole_images(out: datasets.Dataset, data: DataSection, key: str, stats: dict):
    """After data.too_long: an image cut by truncation cannot be fed to the model, so its example goes
    (counted as stats["dropped_cut_images"]): one cut shorter than where its last picture's tokens end
    (markers included: Gemma 3's start- and end-of-image around its soft tokens). The image_end column is
    removed."""
    if data.too_long != "drop":
        before = len(out)
        out = out.filter(
            lambda r: len(r["input_ids"]) >= r["image_end"],
            desc=f"dropping examples whose images truncation cut in {key}",
        )
        stats["dropped_cut_images"] = before - len(out)
    return out.remove_columns("image_end")


def apply_too_long(
    out: datasets.Dataset, data: DataSection, columns: tuple[str, ...], key: str, stats: dict
) -> datasets.Dataset:
    """data.too_long on tokenized rows with a `length` column: the rows longer than data.max_length dropped
    (counted as stats["dropped_too_long"]), or each of `columns` cut to it (stats["truncated"])."""
    n_max = data.max_length
    too_long = sum(n > n_max for n in out["length"])
    if data.too_long == "drop":
        out = out.filter(lambda r: r["length"] <= n_max, desc=f"dropping long examples in {key}")
        stats["dropped_too_long"] = too_long
    else:
        out = out.map(lambda r: {c: r[c][:n_max] for c in columns}, desc=f"truncating {key}")
        stats["truncated"] = too_long
    return out


def learns(labels: list[int]) -> bool:
    """Whether a sequence has a labelled token after the first one (the first is never predicted)."""
    return any(t != IGNORE for t in labels[1:])


def drop_unlearnable(out: datasets.Dataset, keep, key: str, stats: dict) -> datasets.Dataset:
    """The rows `keep` says still have something to learn (learns); the others counted as
    stats["dropped_no_labels"]."""
    before = len(out)
    out = out.filter(keep, desc=f"checking labels in {key}")
    stats["dropped_no_labels"] = before - len(out)
    return out
