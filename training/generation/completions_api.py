"""Generation for another process (python -m training.serve): POST /v1/completions, OpenAI's text completions, and
POST /v1/weights, this server's own, by which a trainer hands the served model its new weights.

/v1/completions takes one prompt, as text or as token ids (OpenAI's API allows both), with `n`, `temperature`
(0: greedy), `top_p`, `max_tokens` (OpenAI's default 16), `seed`, and vLLM's `return_token_ids` (each choice then
carries the ids of the tokens it drew). Choice 0 of a request with seed s draws from the generator seeded s itself,
choice i > 0 from sample_seed(s, 0, 0, i): a trainer that keys each completion's seed (training.generation.keyed)
gets from the server what its own engine would draw. Requests that arrive together are drawn in one batch
(`Batcher`): a keyed draw does not depend on what shares its batch (tests/unit/generation/test_batching.py).

/v1/weights takes a safetensors file in its body (the served model's own parameter names: a trainer's policy with
any LoRA adapter merged in, training.generation.server_engine.pushed_weights) and copies each tensor into the served model between
draws. It needs the API key where the server has one, as every route does.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from training.generation.keyed import Request, sample_seed
from training.generation.openai_api import MAX_N, bad_request, validated
from training.generation.served import Served
from training.generation.transformers_engine import TransformersEngine

MAX_BATCH = 64  # requests drawn together at most


class CompletionRequest(BaseModel):
    """POST /v1/completions; unknown parameters are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    return_token_ids: bool | None = None
    stream: bool | None = None
    user: str | None = None


def parse_completion(body: bytes) -> CompletionRequest:
    """The request in a POST body; APIError 400 naming the first problem."""
    request = validated(body, CompletionRequest)
    if request.stream:
        raise bad_request("stream is not supported on /v1/completions (use /v1/chat/completions)", "stream")
    return request


@dataclass
class Draw:
    """A checked completion request for one served model: its prompt ids and its choices as keyed requests."""

    served: Served
    prompt_ids: list[int]
    requests: list[Request]
    temperature: float
    top_p: float


def prepare_completion(request: CompletionRequest, served: Served) -> Draw:
    """The prompt's ids (text tokenized as is, no special tokens added) and one keyed request per choice; 400 when
    prompt + max_tokens does not fit the model's context or an id is not in its vocabulary."""
    tok = served.tokenizer
    ids = (
        request.prompt
        if isinstance(request.prompt, list)
        else tok(request.prompt, add_special_tokens=False)["input_ids"]
    )
    vocab = served.model.get_input_embeddings().num_embeddings
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"prompt: token ids must be in [0, {vocab})", "prompt")
    if len(ids) + request.max_tokens > served.context:
        raise bad_request(
            f"This model's maximum context length is {served.context} tokens; the prompt has {len(ids)} and "
            f"max_tokens asks for {request.max_tokens} more",
            "max_tokens",
            "context_length_exceeded",
        )
    temperature = 1.0 if request.temperature is None else request.temperature
    seeds: list[int | None] = [None] * request.n
    if temperature > 0:
        s = secrets.randbits(63) if request.seed is None else request.seed
        seeds = [s if i == 0 else sample_seed(s, 0, 0, i) for i in range(request.n)]
    requests = [Request(ids, seed, request.max_tokens) for seed in seeds]
    return Draw(served, ids, requests, temperature, request.top_p or 1.0)


def completion_body(draw: Draw, ids: torch.Tensor, mask: torch.Tensor, name: str, with_ids: bool) -> dict:
    """The response: each choice's text (and token ids when asked), why it stopped, the usage."""
    choices, drawn = [], 0
    eos = set(draw.served.eos_token_ids)
    for i in range(ids.shape[0]):
        tokens = ids[i, : int(mask[i].sum())].tolist()
        drawn += len(tokens)
        ended = bool(tokens) and tokens[-1] in eos
        text = draw.served.tokenizer.decode(tokens, skip_special_tokens=True)
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": "stop" if ended else "length"}
        if with_ids:
            choice["token_ids"] = tokens
        choices.append(choice)
    n_prompt = len(draw.prompt_ids)
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": name,
        "choices": choices,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": drawn, "total_tokens": n_prompt + drawn},
    }


class Batcher:
    """One served model's draws: requests that arrive while another batch is drawn are drawn together next, in
    one left-padded `generate` (those with the same temperature and top-p; at most MAX_BATCH requests)."""

    def __init__(self, served: Served):
        self.served = served
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name=f"draw-{served.name}", daemon=True)
        self.thread.start()

    def submit(self, draw: Draw) -> Future:
        future: Future = Future()
        self.jobs.put((draw, future))
        return future

    def close(self) -> None:
        """Returns once the draws asked for before are done, its thread ended (the model is no longer served)."""
        self.jobs.put(None)
        self.thread.join()

    def _serve(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:
                return
            batch = [first]
            kind = (batch[0][0].temperature, batch[0][0].top_p)
            later = []
            while not self.jobs.empty() and sum(len(d.requests) for d, _ in batch) < MAX_BATCH:
                job = self.jobs.get()
                if job is None:  # closed: after this batch
                    later.append(job)
                    break
                (batch if (job[0].temperature, job[0].top_p) == kind else later).append(job)
            for job in later:
                self.jobs.put(job)
            self._draw(batch, *kind)

    def _draw(self, batch: list, temperature: float, top_p: float) -> None:
        s = self.served
        engine = TransformersEngine(
            0, 1, temperature or 1.0, top_p, s.eos_token_ids, s.tokenizer.pad_token_id
        )
        requests = [r for d, _ in batch for r in d.requests]
        try:
            with s.lock, s.active():
                c = engine.batch(s.model, requests, s.model.device)
        except Exception as e:  # noqa: BLE001 (handed to the requests, whose handler logs it)
            for _, future in batch:
                future.set_exception(e)
            return
        at = 0
        for d, future in batch:
            k = len(d.requests)
            future.set_result((c.ids[at : at + k].cpu(), c.mask[at : at + k].cpu()))
            at += k


def load_weights(served: Served, body: bytes) -> int:
    """The tensors of a safetensors body copied into the served model (between draws); their count. 400 for a
    body that is not safetensors, a name the model does not have, or a shape it does not take."""
    if served.adapter is not None or hasattr(served.model, "peft_config"):
        raise bad_request(
            f"{served.name} is served with adapters: serve the base model alone to load weights into it",
            "model",
        )
    try:
        tensors = load_safetensors(body)
    except (SafetensorError, ValueError) as e:
        raise bad_request(f"the body is not a safetensors file ({e})") from None
    state = served.model.state_dict(keep_vars=True)
    if unknown := [n for n in tensors if n not in state]:
        raise bad_request(f"{len(unknown)} weight(s) the model does not have, e.g. {unknown[0]}")
    if wrong := [n for n, t in tensors.items() if t.shape != state[n].shape]:
        n = wrong[0]
        raise bad_request(f"{n}: shape {list(tensors[n].shape)}, the model's is {list(state[n].shape)}")
    with served.lock, torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)
    return len(tensors)
