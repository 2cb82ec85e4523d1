"""Chat replies: the prompt rendered by the model's chat template as in training (tools, template variables,
a picture for an image-text model), then a reply generated whole, streamed, or plain text continued. One
argument object (`ChatOptions`) says how, for the chat CLI, the app's Chat tab, the demo and the benchmarks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from transformers import TextIteratorStreamer

from training.core.errors import UserError
from training.data.tokenize import probe_tools
from training.data.turns import parse_tools
from training.run.rundir import resolve_source


@dataclass(frozen=True)
class ChatOptions:
    """How a reply is generated: its length and sampling (greedy when temperature is 0), the tools and
    template variables the chat template is given, and `images`: (processor, pictures) for an image-text
    model."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    tools: list[dict] | None = None
    template_kwargs: dict | None = None
    images: tuple | None = None


def _inputs(model, tokenizer, messages: list[dict], o: ChatOptions):
    tools, template_kwargs, images = o.tools, o.template_kwargs, o.images
    if images:  # processor, [pictures]: the rendered prompt with the pictures' pixels and image tokens
        processor, pictures = images
        text = rendered_prompt(tokenizer, messages, tools, template_kwargs)
        enc = processor(text=[text], images=pictures, return_tensors="pt")
        return {k: v.to(model.device) for k, v in enc.items()}
    enc = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        **(template_kwargs or {}),
    )
    return {k: v.to(model.device) for k, v in enc.items()}


def rendered_prompt(tokenizer, messages: list[dict], tools=None, template_kwargs=None) -> str:
    """The text the model is given (what --show-prompt prints)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )


def run_template_kwargs(source: str) -> dict:
    """data.chat_template_kwargs of the run `source` belongs to (its config.yaml), {} for anything else: a
    run trained with enable_thinking=false is chatted with the same way."""
    run = resolve_source(source).run
    if run is None or not run.config.is_file():
        return {}
    recipe = yaml.safe_load(run.config.read_text()) or {}
    return dict((recipe.get("data") or {}).get("chat_template_kwargs") or {})


def parse_template_kwargs(items: list[str]) -> dict:
    """--template-kwarg KEY=VALUE items; VALUE read as YAML (false, 3, a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--template-kwarg {item!r}: expected KEY=VALUE, e.g. enable_thinking=false")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def read_tools(path: str, tokenizer, template_kwargs: dict) -> list[dict]:
    """--tools FILE: a JSON list of tool definitions that this model's chat template renders."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--tools {path}: no such file; give a JSON list of tool definitions")
    tools, problem = parse_tools(p.read_text(encoding="utf-8"), f"--tools {path}")
    if problem:
        raise UserError(problem)
    if why := probe_tools(tokenizer, template_kwargs):
        raise UserError(
            f"--tools {path}: this model's chat template cannot render tools: {why}. Give one that does: "
            f"--chat-template PATH (a Jinja file, e.g. data/tools/chatml_tools.jinja)"
        )
    return tools


def _sampling(o: ChatOptions, tokenizer) -> dict:
    kw = dict(max_new_tokens=o.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    if o.temperature > 0:
        kw.update(do_sample=True, temperature=o.temperature, top_p=o.top_p)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kw


@torch.no_grad()
def generate(model, tokenizer, messages: list[dict], options: ChatOptions = ChatOptions()) -> str:
    """One reply to `messages`."""
    inputs = _inputs(model, tokenizer, messages, options)
    out = model.generate(**inputs, **_sampling(options, tokenizer))
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


@torch.no_grad()
def complete(model, tokenizer, text: str, options: ChatOptions = ChatOptions(max_new_tokens=64)) -> str:
    """Continue plain text, no chat template (base models, models pretrained from scratch)."""
    enc = tokenizer(text, return_tensors="pt").to(model.device)
    out = model.generate(**enc, **_sampling(options, tokenizer))
    return text + tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def stream(model, tokenizer, messages: list[dict], options: ChatOptions = ChatOptions()) -> Iterator[str]:
    """Yield the reply text as it grows (a background thread runs generate)."""
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(
        **_inputs(model, tokenizer, messages, options), **_sampling(options, tokenizer), streamer=streamer
    )
    thread = threading.Thread(target=torch.no_grad()(model.generate), kwargs=kwargs, daemon=True)
    thread.start()
    text = ""
    for piece in streamer:
        text += piece
        yield text
    thread.join()
