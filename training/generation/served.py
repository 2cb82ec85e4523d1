"""Models served by name (python -m training.serve) and the draws that answer a request: `n` completions of one
prompt, keyed by a seed, with each token's log-probability, stopped at the end token, a stop string or
max_tokens, and reported step by step to whoever streams them.

Adapters of one base share it: the base is loaded once, each adapter attached under its name (peft), and the
lock of that model is held while `set_adapter` (or `disable_adapter`, for the base served beside its
adapters) and the generation run. One model on one device runs one draw at a time (a draw may hold several
requests: training.generation.chat_batching).

A draw is transformers' `generate` over logits that `KeyedSampler` has already decided (as the RL engine
draws): choice i of a request with seed s is drawn from sample_seed(s, 0, 0, i), so the same seed gives the
same completion; temperature 0 is greedy, the same reply as training.generation.generate.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from training.generation.chat import run_template_kwargs
from training.generation.keyed import KeyedSampler, sample_seed
from training.generation.load import (
    adapter_base_key,
    load_adapters,
    load_for_chat,
    ready_for_chat,
    refuse_reward_model,
)
from training.generation.transformers_engine import TransformersEngine
from training.run.rundir import resolve_source
from training.run.sources import pretrained_source

FALLBACK_CONTEXT = 2048  # a model whose config names no context length


@dataclass
class Served:
    """One model name: its model (shared by the adapters of one base, with its lock), tokenizer, the peft
    adapter it generates with (None: the model itself, or the base of the adapters loaded on it), template
    variables, context length, and for an adapter loaded while serving the name of its base."""

    name: str
    source: str
    model: object
    tokenizer: object
    lock: threading.Lock
    adapter: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    context: int = FALLBACK_CONTEXT
    # an adapter loaded while serving: the served model it attaches to (vLLM's field)
    parent: str | None = None

    @contextlib.contextmanager
    def active(self):
        """The model generating as this name: its adapter set, or the adapters disabled for the base."""
        if not hasattr(self.model, "peft_config"):
            yield
        elif self.adapter is not None:
            self.model.set_adapter(self.adapter)
            yield
        else:
            with self.model.disable_adapter():
                yield

    @property
    def eos_token_ids(self) -> list[int]:
        """The end tokens: the model's generation config's (what `generate` stops at) and the tokenizer's."""
        ids = []
        for eos in (getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            ids += [eos] if isinstance(eos, int) else list(eos or [])
        return list(dict.fromkeys(ids))


def default_name(source: str) -> str:
    """A source's model name: a run's (or its final/'s) directory name, `<run>-step-N` for a checkpoint, the
    bundled model's name, a hub name as given, else the directory's name."""
    if source.startswith("bundled:"):
        return source.split(":", 1)[1]
    p = Path(source).expanduser()
    if not p.exists():
        return source
    found = resolve_source(source)
    if found.run is not None:
        if found.kind == "checkpoint":
            return f"{found.run.root.name}-{Path(found.path).name}"
        if Path(found.path).resolve() == found.run.final.resolve():
            return found.run.root.name
    return p.resolve().name


def context_length(model, tokenizer) -> int:
    """How many tokens the model attends over: its config's max_position_embeddings, else the tokenizer's
    model_max_length where it names one, else FALLBACK_CONTEXT."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "max_position_embeddings", None)
    if isinstance(n, int) and n > 0:
        return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10_000_000 else FALLBACK_CONTEXT


def load_served(
    named: dict[str, str],
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Served]:
    """{name: Served} for {name: source}. Adapters whose base is the same load it once and are switched by
    name; a model source that is that base is served by the same model with its adapters disabled. Other
    sources load on their own (load_for_chat). `chat_template` (Jinja text) replaces every model's template;
    `template_kwargs` apply over each run's own data.chat_template_kwargs."""
    found = {name: resolve_source(source) for name, source in named.items()}
    for name, f in found.items():
        refuse_reward_model(named[name], f)
    groups: dict[tuple[str, str], dict] = {}
    for name, f in found.items():
        if f.kind == "adapter":
            groups.setdefault(adapter_base_key(f), {})[name] = f
    bases = {_model_path(key[0]): key for key in groups if not key[1]}  # a base config changed: not the base
    served = {}
    for key, adapters in groups.items():
        model, tokenizers = load_adapters(adapters, device, dtype)
        lock = threading.Lock()
        for name in adapters:
            served[name] = Served(name, named[name], model, tokenizers[name], lock, adapter=name)
        for name, f in found.items():  # the base itself, asked for by name beside its adapters
            if f.kind == "model" and bases.get(_model_path(str(f.path))) == key:
                tokenizer = _tokenizer(named[name])
                served[name] = Served(name, named[name], model, tokenizer, lock, adapter=None)
    for name, source in named.items():
        if name not in served:
            model, tokenizer = load_for_chat(source, device, dtype)
            served[name] = Served(name, source, model, tokenizer, threading.Lock())
    out = {}
    for name in named:  # the order asked for
        s = served[name]
        if chat_template is not None:
            s.tokenizer.chat_template = chat_template
        s.template_kwargs = {**run_template_kwargs(s.source), **(template_kwargs or {})}
        s.context = context_length(s.model, s.tokenizer)
        out[name] = s
    return out


def _model_path(source: str) -> str:
    """A model source as one comparable string: the directory from_pretrained reads, resolved."""
    src = pretrained_source(source)
    return str(Path(src).resolve()) if Path(src).exists() else src


def _tokenizer(source: str):
    """The tokenizer of a model source, ready for chat (load_for_chat's, without loading the model)."""
    return ready_for_chat(AutoTokenizer.from_pretrained(pretrained_source(str(resolve_source(source).path))))


@dataclass(frozen=True)
class Sampling:
    """How a request's completions are drawn: `n` of them, greedy at temperature 0, else keyed by `seed` (a
    fresh one when None); at most `max_tokens` each, cut before the first `stop` string; `top_logprobs`: None
    for no log-probabilities, else how many alternatives beside the chosen token (0-20)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None


@dataclass
class TokenLogprob:
    """A generated token's text, its log-probability under the model's distribution at the request's
    temperature (1 when greedy), and the most likely alternatives as (token text, log-probability)."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Choice:
    """One completion as it grows: its tokens (the end token left out), text (cut before a stop string),
    log-probabilities, how many tokens were generated (the end token counted) and, once done, why: "stop"
    (end token or stop string) or "length" (max_tokens)."""

    index: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generated: int = 0
    finish_reason: str | None = None
    ended: int | None = None  # the end token that finished it

    def snapshot(self) -> Choice:
        """A copy as it is now, for another thread to read while this one grows (the tokens left out)."""
        return Choice(self.index, [], self.text, list(self.logprobs), self.generated, self.finish_reason)


class Cancelled(Exception):
    """The draw was cancelled (its client went away)."""


class _Recorder(LogitsProcessor):
    """Runs the keyed sampler and keeps, for each row, the chosen token's log-probability (and the top ones)
    under log_softmax(logits / temperature) of the step."""

    def __init__(self, sampler: KeyedSampler, temperature: float, top_logprobs: int | None):
        self.sampler, self.temperature, self.top_logprobs = sampler, temperature or 1.0, top_logprobs
        self.step: list | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        decided = self.sampler(input_ids, scores)
        if self.top_logprobs is not None:
            logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
            chosen = decided.argmax(-1)
            picked = logp.gather(-1, chosen[:, None])[:, 0]
            top = logp.topk(self.top_logprobs, dim=-1) if self.top_logprobs else None
            self.step = [
                (
                    picked[i].item(),
                    list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else [],
                )
                for i in range(len(chosen))
            ]
        return decided


class _Tracker(StoppingCriteria):
    """After each step: each unfinished choice takes its new token (an end token, a stop string or
    max_tokens finishes it), `on_step` hears the choices, and generation stops when every choice is done or
    the draw is cancelled."""

    def __init__(self, served: Served, sampling: Sampling, recorder: _Recorder, on_step, cancel):
        self.served, self.sampling, self.recorder = served, sampling, recorder
        self.on_step, self.cancel = on_step, cancel
        self.eos = set(served.eos_token_ids)
        self.choices = [Choice(i) for i in range(sampling.n)]

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        tok = self.served.tokenizer
        for c, token in zip(self.choices, input_ids[:, -1].tolist()):
            if c.finish_reason is not None:
                continue
            c.generated += 1
            if token in self.eos:
                c.finish_reason, c.ended = "stop", token
                continue
            c.tokens.append(token)
            if self.recorder.step is not None:
                logprob, top = self.recorder.step[c.index]
                c.logprobs.append(
                    TokenLogprob(tok.decode([token]), logprob, [(tok.decode([t]), v) for t, v in top])
                )
            c.text = tok.decode(c.tokens, skip_special_tokens=True)
            cut = min((i for i in (c.text.find(s) for s in self.sampling.stop) if i >= 0), default=-1)
            if cut >= 0:
                c.text, c.finish_reason = c.text[:cut], "stop"
            elif c.generated >= self.sampling.max_tokens:
                c.finish_reason = "length"
        if self.on_step is not None:
            self.on_step(self.choices)
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled
        return torch.tensor([c.finish_reason is not None for c in self.choices], device=input_ids.device)


def draw(
    served: Served,
    prompt_ids: list[int],
    sampling: Sampling,
    on_step: Callable[[list[Choice]], None] | None = None,
    cancel: threading.Event | None = None,
) -> list[Choice]:
    """`sampling.n` completions of `prompt_ids`, as one batch of identical prompts; `on_step(choices)` after
    every generated token (from this thread); `cancel` set: stops at the next token, raising Cancelled."""
    if sampling.temperature > 0:
        seed = secrets.randbits(63) if sampling.seed is None else sampling.seed
        generators = [torch.Generator().manual_seed(sample_seed(seed, 0, 0, i)) for i in range(sampling.n)]
    else:
        generators = None
    recorder = _Recorder(
        KeyedSampler(generators, sampling.temperature, sampling.top_p),
        sampling.temperature,
        sampling.top_logprobs,
    )
    tracker = _Tracker(served, sampling, recorder, on_step, cancel)
    engine = TransformersEngine(
        0,
        sampling.max_tokens,
        sampling.temperature,
        sampling.top_p,
        served.eos_token_ids,
        served.tokenizer.pad_token_id,
    )
    with served.lock, served.active(), torch.no_grad():
        model = served.model
        ids = torch.tensor([prompt_ids] * sampling.n, device=model.device)
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=engine.config(),
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=StoppingCriteriaList([tracker]),
        )
    for c in tracker.choices:  # generate stopped at max_new_tokens before the tracker heard of it
        c.finish_reason = c.finish_reason or "length"
    return tracker.choices
