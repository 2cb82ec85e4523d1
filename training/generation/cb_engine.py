"""The continuous batching engine: completions drawn by transformers' continuous batching (paged attention, a
scheduler that admits and retires requests as they go), keyed as the transformers engine draws them.

Continuous batching samples with `torch.multinomial` from the global random stream, so what it draws would
depend on the batch and its scheduling. Here it runs greedily (do_sample=False) over logits that a continuous
batching logits processor (`KeyedCBProcessor`) has already decided, with the math of `KeyedSampler`
(temperature, top-p, then the argmax of logits plus Gumbel noise). Each request's noise comes from its own
generator, seeded from its key, and is taken by position: its k-th generated token gets the generator's k-th
draw, as `generate` gives it, whichever requests share the forward pass, whatever their order and however
often the scheduler asks. The request's slot and position reach the processor through continuous batching's
per-request tensor argument (one int32 each), prepared with the batch, never through a side channel.

Each request stops at its own budget and at the end-of-sequence ids. CUDA graphs, compilation and
asynchronous batching stay off: the noise is drawn in Python from CPU generators (a captured graph would
replay one draw), and asynchronous batch preparation would prepare a request's position before its previous
token is known. tests/unit/generation/test_cb_engine.py proves it equal, token for token in fp32 on the CPU,
to the transformers engine and to drawing each request alone.

`cb_refusal` says why continuous batching cannot run a model (then rollouts fall back to batched `generate`,
named at start-up by `engine_for`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch
from transformers import ContinuousBatchingConfig, LogitsProcessorList
from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)

from training.generation.keyed import Request, gumbel, keyed_choice, sampled
from training.generation.requests_engine import padded_completions
from training.generation.transformers_engine import TransformersEngine

SLOT = "keyed_slot"  # the per-request keyword continuous batching hands the processor
PAGE = 64  # tokens per page of the paged cache
CB_ATTENTION = ("eager", "sdpa", "paged|eager", "paged|sdpa")  # and flash attention


class KeyedNoise:
    """One request's Gumbel noise by position: position k gets its generator's k-th draw (as `KeyedSampler`
    draws it, one per generated token), however often and in whatever order it is asked for."""

    def __init__(self, seed: int):
        self.seed, self.generator, self.drawn = seed, torch.Generator().manual_seed(seed), 0

    def at(self, position: int, n: int) -> torch.Tensor:
        if (
            position < self.drawn
        ):  # asked again (a request evicted and prefilled again): start the stream over
            self.generator.manual_seed(self.seed)
            self.drawn = 0
        while self.drawn < position:
            gumbel(n, self.generator)
            self.drawn += 1
        self.drawn += 1
        return gumbel(n, self.generator)


class KeyedCBProcessor(ContinuousBatchingLogitsProcessor):
    """Continuous batching's logits processor for keyed draws: each row's tensor argument is its request's slot
    and the position of the token it draws (slot << bits | position); the scores returned are 0 for the drawn
    token and -inf elsewhere, so continuous batching's argmax picks it. `noises=None`: greedy."""

    supported_kwargs = {SLOT: int}
    ignored_kwargs = ()

    def __init__(self, noises: list[KeyedNoise] | None, temperature: float, top_p: float, bits: int):
        self.noises, self.temperature, self.top_p, self.bits = noises, temperature, top_p, bits

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        codes = [
            (r.state.logit_processor_kwargs[SLOT] << self.bits) | r.state.generated_len()
            for r in requests_with_new_token
        ]
        return torch.tensor(codes, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        noise = None
        if self.noises is not None:
            codes = tensor_arg[: scores.size(0)].tolist()
            low = (1 << self.bits) - 1
            noise = [self.noises[c >> self.bits].at(c & low, scores.size(-1)) for c in codes]
        return keyed_choice(scores, noise, self.temperature, self.top_p)


@dataclass
class ContinuousBatchingEngine(TransformersEngine):
    """The Engine interface (training.generation.engine) on transformers' continuous batching: `batch` draws
    through it, and so do groups and greedy evaluation (the transformers engine's, through `batch`); never
    synced, so `idle` (the transformers engine's) is never needed."""

    max_requests_per_batch: int | None = None  # continuous batching's batch slots (None: its own choice)

    @classmethod
    def like(cls, base: TransformersEngine) -> ContinuousBatchingEngine:
        """This engine with `base`'s settings (seed, budget, temperature, top-p, end and pad ids)."""
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init})

    def __post_init__(self):
        if self.synced:
            raise ValueError("continuous batching cannot step with other ranks (ZeRO-3/FSDP): use generate")

    @torch.no_grad()
    def batch(self, model, requests: list[Request], device, version=None, prefixes=None):
        """The completions of `requests`, in order, drawn together by continuous batching: each keyed by its own
        seed (or all greedy) and stopped at its own budget or an end-of-sequence id."""
        start = time.perf_counter()
        lengths = [len(r.ids) + r.max_new_tokens for r in requests]
        budget = max(r.max_new_tokens for r in requests)
        with self.stream(model, lengths, budget, greedy=not sampled(requests)) as stream:
            for r in requests:
                stream.submit(r)
            done = dict(stream.finished() for _ in requests)
        tokens = [done[k] for k in range(len(requests))]
        c = padded_completions(tokens, self.eos_token_ids, self.pad_token_id, time.perf_counter() - start)
        return dataclasses.replace(c, ids=c.ids.to(device), mask=c.mask.to(device))

    @contextlib.contextmanager
    def stream(self, model, lengths: list[int], budget: int, greedy: bool):
        """A running continuous batching manager that takes requests while it draws others (`Stream`): room for
        requests of these total lengths (context and budget) at once, each drawing at most `budget` tokens."""
        was_training = model.training
        manager = model.init_continuous_batching(
            generation_config=self.config(budget),
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=PAGE,
                # room for every request at once (as generate's cache holds them): none is ever evicted, and
                # continuous batching does not size its cache to the machine's free memory (it zeroes it all)
                num_blocks=sum(-(-(n + 1) // PAGE) for n in lengths),
                max_requests_per_batch=self.max_requests_per_batch,
                use_cuda_graph=False,
                use_async_batching=False,
                max_memory_percent=0.8,  # continuous batching's own figure when logits are processed
            ),
        )
        stream = Stream(
            manager,
            KeyedCBProcessor(None if greedy else [], self.temperature, self.top_p, budget.bit_length()),
            self.eos_token_ids,
        )
        manager.start()
        try:
            yield stream
        finally:
            manager.stop(block=True)
            manager.destroy()
            model.train(was_training)


class Stream:
    """Requests drawn by a running continuous batching manager as they come: `submit` one (while others are being
    drawn), `finished` waits for the next to end. Request k (in submission order) is keyed by its own seed (slot k)
    whatever else runs beside it."""

    def __init__(self, manager, processor: KeyedCBProcessor, eos_token_ids: list[int]):
        self.manager, self.processor, self.eos_token_ids, self.count = manager, processor, eos_token_ids, 0
        manager.logit_processor = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([processor]))
        # one int32 argument row for it: transformers counts only the processors it converts itself
        manager.logit_processor.tensors_required = 1

    def submit(self, r: Request) -> int:
        """Start drawing `r` (its budget within the stream's); its number, which `finished` returns with it."""
        k, self.count = self.count, self.count + 1
        if (k + 1) << self.processor.bits >= 1 << 31:
            raise ValueError(
                f"{k + 1} requests of {1 << self.processor.bits} tokens overflow the int32 slot argument"
            )
        if self.processor.noises is not None:
            if r.seed is None:
                raise ValueError("a sampled stream takes keyed requests only")
            self.processor.noises.append(KeyedNoise(r.seed))
        kwargs = {SLOT: k}
        self.manager.add_request(r.ids, str(k), r.max_new_tokens, eos_token_id=self.eos_token_ids, **kwargs)
        return k

    def finished(self, timeout: float | None = None) -> tuple[int, list[int]] | None:
        """(number, generated tokens) of the next request to end, its end token kept; None if none ended within
        `timeout` seconds (None: wait for one)."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, deadline - time.perf_counter())
            result = self.manager.get_result(timeout=wait)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("continuous batching stopped before every request finished")
                if deadline is not None and time.perf_counter() >= deadline:
                    return None
                continue
            if result.error is not None:
                raise RuntimeError(f"continuous batching failed request {result.request_id}: {result.error}")
            if result.is_finished():
                return int(result.request_id), list(result.generated_tokens)


def cb_refusal(model, synced: bool = False) -> str | None:
    """Why transformers' continuous batching cannot draw this model's rollouts (None: it can)."""
    if synced:
        return "ZeRO-3/FSDP shard the weights, so every rank must step generate together"
    if getattr(model, "_device_mesh", None) is not None:
        return "its weights are split over a device mesh (tensor parallelism)"
    if not hasattr(model, "init_continuous_batching"):
        return f"{type(model).__name__} has no continuous batching"
    config = model.config.get_text_config()
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__}'s attention does not take paged attention"
    odd = sorted({t for t in getattr(config, "layer_types", None) or [] if t not in ATTN_TYPE_TO_ALLOCATOR})
    if odd:
        return f"its {', '.join(odd)} layers have no paged cache"
    attention = config._attn_implementation or "eager"
    if attention not in CB_ATTENTION and "flash" not in attention:
        return f"its attention implementation {attention!r} is not one continuous batching runs"
    return None


def engine_for(model, base: TransformersEngine, say=print) -> TransformersEngine:
    """The continuous batching engine with `base`'s settings where `model` takes it, else `base` (batched
    generate); says which, and why, once (at start-up)."""
    reason = cb_refusal(model, base.synced)
    if reason is not None:
        say(f"rollouts: batched generate (continuous batching cannot run this model: {reason})")
        return base
    say("rollouts: continuous batching (paged attention), keyed")
    return ContinuousBatchingEngine.like(base)
