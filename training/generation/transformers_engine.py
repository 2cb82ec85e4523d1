"""The transformers engine: completions drawn with transformers' `generate` (KV cache), keyed (keyed.py).

Completions are drawn in batches (`batch`): every group of a window, or every live episode's next turn, in
one left-padded `generate` call. Each row draws from its own key's generator and is cut at its own budget,
so what a request draws does not depend on what shares its batch (tests/unit/generation/test_batching.py
checks it token for token against drawing each alone). A context is computed once (prefix_cache.py): a
group's shared prompt, and an episode's last turn, whose keys and values its next turn goes on from.

Under ZeRO-3 and FSDP2 (`synced`) the weights are gathered whole once per call (`gathered`, given by the loop),
a context's prefill included, each rank then generating on its own; the ranks still make as many calls as each
other (`idle`), since each gathers collectively. Where they are left sharded (`rl.gather_for_generation: false`:
`in_step`) every rank must run as many forward passes as the others (each one gathers a layer's shards):
transformers' `synced_gpus` keeps a finished rank stepping until all are, and no context is kept between calls.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from training.generation.keyed import Completions, KeyedSampler, Request, end_mask, sample_seed, sampled
from training.generation.kv_cache import autocast_dtype, cache_for
from training.generation.merged import MergedCopy, no_room, why_not
from training.generation.prefix_cache import (
    SHARED_PREFIX_TOKENS,
    PrefixStore,
    layout,
    left_padded,
    reuse_refusal,
    rows_of,
    shared_prefix,
)
from training.generation.thinning import Generate, Places, places_of, thinned

log = logging.getLogger(__name__)


def not_gathered(model) -> contextlib.AbstractContextManager[bool]:
    """The engine's `gathered` where nothing is gathered: a context yielding False."""
    return contextlib.nullcontext(False)


@dataclass
class TransformersEngine:
    """How completions are drawn (the recipe's rl or distill section and the run's seed), with transformers'
    `generate`: the default engine (training.generation.engine.Engine)."""

    seed: int
    max_new_tokens: int
    temperature: float
    top_p: float
    eos_token_ids: list[int]
    pad_token_id: int
    synced: bool = False  # ZeRO-3/FSDP: every rank makes as many calls as the others (`idle`)
    # ZeRO-3/FSDP: a model -> a context in which its sharded weights are whole for a call, yielding whether it
    # gathered (training.parallel.frozen.whole_for_generation, given by the loop); by default nothing is gathered
    gathered: Callable[[torch.nn.Module], contextlib.AbstractContextManager[bool]] = field(
        default=not_gathered, repr=False
    )
    reuse_prefixes: bool = True  # a context's keys and values computed once (prefix_cache.py)
    # the mixed precision the policy trains in (accelerate's autocast), entered around each `generate` in the
    # calling thread: `generate` calls the inner model, not the forward accelerate wraps, so without it a bf16
    # run would draw its rollouts in fp32 (slower, and not the policy it trains)
    autocast: Callable[[], contextlib.AbstractContextManager] = field(
        default=contextlib.nullcontext, repr=False
    )
    merge_lora: bool = True  # a LoRA policy generates through its merged copy under autocast (merged.py)
    _copy: MergedCopy | None = field(default=None, init=False, repr=False, compare=False)
    _unmerged: tuple = field(default=(None, None), init=False, repr=False, compare=False)  # (model, why not)

    def config(self, max_new_tokens: int | None = None) -> GenerationConfig:
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            # the model's own generation defaults (sampling, penalties) must not change the draw
            temperature=None,
            top_p=None,
            top_k=None,
        )

    @torch.no_grad()
    def batch(
        self, model, requests: list[Request], device, version=None, prefixes: PrefixStore | None = None
    ) -> Completions:
        """The completions of `requests`, in order, drawn in one left-padded `generate` call: each row keyed by
        its own seed (or all greedy) and cut at its own budget, so a request draws the same tokens whatever
        shares its batch. `version` (the step the policy is at) matters to an engine that holds its own copy
        of the weights; `prefixes`: where the keys and values of each row are kept for the caller's next call
        (an episode's next turn), and looked up (prefix_cache.py)."""
        generators = [torch.Generator().manual_seed(r.seed) for r in requests] if sampled(requests) else None
        sampler = KeyedSampler(generators, self.temperature, self.top_p)  # no generators: greedy
        budgets = [r.max_new_tokens for r in requests]
        with self.gathered(model):  # a context's prefill and its `generate` on the same whole weights
            if self.reuses(model, requests, prefixes):
                return self._reusing(model, requests, sampler, budgets, prefixes, device)
            ids, mask = left_padded([r.ids for r in requests], self.pad_token_id, device)
            c, _ = self._generate(model, ids, mask, sampler, max(budgets), budgets=budgets)
        return self._cut(c, requests)

    @property
    def in_step(self) -> bool:
        """Whether the ranks run each forward pass together (ZeRO-3/FSDP with their weights left sharded while
        they generate: transformers' `synced_gpus`), rather than each on its own."""
        return self.synced and self.gathered is not_gathered

    def _cut(self, c: Completions, requests: list[Request]) -> Completions:
        """Each row cut at its own budget."""
        budget = torch.tensor([r.max_new_tokens for r in requests], device=c.ids.device)
        c.mask = (
            c.mask * (torch.arange(c.ids.shape[1], device=c.ids.device)[None, :] < budget[:, None]).long()
        )
        c.ids = c.ids.masked_fill(c.mask == 0, self.pad_token_id)
        return c

    def reuses(self, model, requests: list[Request], prefixes: PrefixStore | None) -> bool:
        """Whether this batch is drawn reusing prefixes: where a caller keeps them, or rows share a context
        (a group's generations), on a model with a plain cache, on ranks that do not generate in step."""
        shared = prefixes is not None or len({tuple(r.ids) for r in requests}) < len(requests)
        return self.reuse_prefixes and shared and reuse_refusal(model, self.in_step) is None

    def _reusing(self, model, requests, sampler, budgets: list[int], prefixes, device) -> Completions:
        """`batch` (cut at the budgets) with each distinct new context computed once and the stored prefixes
        given to `generate` as its cache."""
        start = time.perf_counter()
        contexts = [r.ids for r in requests]
        store = prefixes if prefixes is not None else PrefixStore()
        stored = [store.longest(ids) for ids in contexts]
        fresh = list(dict.fromkeys(tuple(x) for x, (n, _) in zip(contexts, stored) if n == 0 and len(x) > 1))
        if fresh:  # each distinct new context computed once, but its last token (fed by `generate` below)
            filled = dict(zip(fresh, self._prefill(model, [list(f[:-1]) for f in fresh], device)))
            stored = [
                (len(x) - 1, filled[tuple(x)]) if tuple(x) in filled and not n else (n, kv)
                for x, (n, kv) in zip(contexts, stored)
            ]
        lay = layout(contexts, stored, self.pad_token_id, device)
        c, places = self._generate(model, lay.ids, lay.mask, sampler, max(budgets), lay.kv, budgets)
        c = self._cut(c, requests)
        if prefixes is not None:
            self._keep(prefixes, contexts, c, places, lay.ids.shape[1])
        c.seconds = time.perf_counter() - start
        return c

    def _prefill(self, model, contexts: list[list[int]], device):
        """The keys and values of each context, computed in one call (its one drawn token is dropped), a prefix they
        all share (a system prompt and its tools: 143 of the agent task's 175-181 tokens) computed once first."""
        shared = shared_prefix(contexts)
        stored = [(0, None)] * len(contexts)
        if len(shared) >= SHARED_PREFIX_TOKENS:
            stored = [(len(shared), self._prefill(model, [shared], device)[0])] * len(contexts)
        lay = layout(contexts, stored, self.pad_token_id, device)
        _, places = self._generate(model, lay.ids, lay.mask, KeyedSampler(None, 1.0, 1.0), 1, lay.kv)
        width = lay.ids.shape[1]
        return rows_of(places, [(width - len(x), width) for x in contexts])

    @staticmethod
    def _keep(prefixes: PrefixStore, contexts, c: Completions, places, width: int) -> None:
        """Each row's keys and values (its context and reply, less the reply's last token) for the next call."""
        ends = [max(int(n), 1) - 1 for n in c.mask.sum(-1)]
        spans = [(width - len(x), width + e) for x, e in zip(contexts, ends)]
        keys = [tuple(x + c.ids[i, :e].tolist()) for i, (x, e) in enumerate(zip(contexts, ends))]
        prefixes.entries = dict(zip(keys, rows_of(places, spans)))

    def group(self, model, prompt_ids: list[int], step: int, row: int | str, n: int, device) -> Completions:
        """`n` completions of one prompt, keyed (seed, step, row, 0..n-1)."""
        return self.groups(model, [prompt_ids], step, [row], n, device)[0]

    def groups(
        self, model, prompts: list[list[int]], step: int, rows: list, n: int, device
    ) -> list[Completions]:
        """`group` of each prompt (of its row), all drawn in one batch."""
        requests = [
            Request(p, sample_seed(self.seed, step, r, g), self.max_new_tokens)
            for p, r in zip(prompts, rows)
            for g in range(n)
        ]
        return split_groups(self.batch(model, requests, device), n)

    def greedy(self, model, prompts: list[list[int]], device, version=None) -> Completions:
        """One greedy completion per prompt (held-out evaluation), in one batch."""
        return self.batch(model, [Request(p, None, self.max_new_tokens) for p in prompts], device, version)

    @torch.no_grad()
    def idle(self, model, device) -> None:
        """A generation whose result is dropped: under ZeRO-3/FSDP (`synced`) a rank with fewer generations to
        run than another runs these, so every rank runs as many `generate` calls (each steps together)."""
        t = torch.tensor([[self.pad_token_id]], device=device)
        with self.gathered(model):
            self._generate(model, t, torch.ones_like(t), KeyedSampler(None, 1.0, 1.0), 1)

    def _generate(
        self, model, ids, attention_mask, sampler: KeyedSampler, max_new_tokens=None, kv=None, budgets=None
    ) -> tuple[Completions, Places | None]:
        """(the completions after `ids`, each row's place in the cache it ends with: None where the model's cache is
        not the engine's); `kv`: per decoder layer, the keys and values of the first positions of `ids` (prefix
        reuse); `budgets`: each row's own (by default `max_new_tokens` each). Where the engine holds the cache and
        the ranks do not step together, a row done is set aside while the others go on (thinning.py)."""
        start = time.perf_counter()
        config = self.config(max_new_tokens)
        config.return_dict_in_generate = True  # with the cache it ends with (prefix reuse keeps it)
        budgets = budgets or [config.max_new_tokens] * ids.shape[0]
        was_training = model.training
        model.eval()
        try:
            with self.autocast():
                generating = self._generating(model, ids.device.type)  # `merges` reads the autocast
                cache = cache_for(generating, ids, config.max_new_tokens, kv)
                call = self._caller(generating, config)
                with frozen_casts_cached(generating, ids.device.type, not self.synced):
                    if cache is None or self.in_step or ids.shape[0] == 1:
                        completion, after = call(ids, attention_mask, cache, sampler, config.max_new_tokens)
                        places = None if cache is None else places_of(after)
                    else:
                        args = (ids, attention_mask, cache, sampler, budgets, self.eos_token_ids)
                        completion, places = thinned(call, *args, self.pad_token_id)
        finally:
            model.train(was_training)
        mask = end_mask(completion, self.eos_token_ids)
        completion = completion.masked_fill(mask == 0, self.pad_token_id)
        return Completions(completion, mask, time.perf_counter() - start), places

    def _caller(self, generating, config: GenerationConfig) -> Generate:
        """`generate` of `generating` as thinning.py calls it: (ids, mask, cache, sampler, budget, stopping
        criterion or None) -> (the new tokens, the cache it ends with)."""

        def call(ids, mask, cache, sampler, budget: int, stop=None):
            config.max_new_tokens = budget
            out = generating.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([stop] if stop else []),
                synced_gpus=self.in_step,
                cache=cache,
            )
            return out.sequences[:, ids.shape[1] :], out.cache

        return call

    def merges(self, model, device_type: str) -> bool:
        """Whether `generate` runs a merged copy of `model` (merged.py) here: a plain LoRA adapter, under a
        mixed-precision autocast (entered by the caller), on the main thread (rl.async's draws run beside
        training), for a whole model (not ZeRO-3's or FSDP's shards) and, on a GPU, where the copy has room."""
        on = autocast_dtype(device_type) not in (None, torch.float32)
        main = threading.current_thread() is threading.main_thread()
        if not (self.merge_lora and on and main and not self.synced):
            return False
        if self._unmerged[0] is not model:
            reason = why_not(model)
            if reason is None and (reason := no_room(model)) is not None:
                log.warning("the LoRA policy generates through its adapter, slower: %s", reason)
            self._unmerged = (model, reason)
        return self._unmerged[1] is None

    def _generating(self, model, device_type: str):
        """The model `generate` runs for `model`: its merged copy where `merges`, refreshed where training has
        changed the adapter since; else `model` itself."""
        if not self.merges(model, device_type):
            return model
        dtype = autocast_dtype(device_type)  # the copy's linear layers are kept in it (merged.linears_in)
        if self._copy is None or self._copy.source is not model or self._copy.dtype != dtype:
            self._copy = MergedCopy(model, dtype)
        self._copy.refresh()
        return self._copy.model


@contextlib.contextmanager
def frozen_casts_cached(model, device_type: str, whole: bool):
    """Under a mixed-precision autocast, the frozen fp32 weights (a LoRA run's base) marked as requiring gradients
    while `generate` runs: autocast keeps its cast of a leaf tensor for the whole call only where the tensor requires
    gradients, so each frozen matrix was cast to bf16 again at every decoding step. The cast is the same, so the
    draws are bit for bit the same; nothing records gradients (`generate` runs without them). On the main thread
    only (rl.async's copy shares the frozen weights with the policy training beside it), and for a `whole` model
    only (not ZeRO-3's or FSDP's shards, whose wrappers read the flag)."""
    alone = threading.current_thread() is threading.main_thread()
    if not (whole and alone and torch.is_autocast_enabled(device_type)):
        yield
        return
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32 and p.is_leaf]
    try:
        for p in frozen:
            p.requires_grad_(True)
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def split_groups(c: Completions, n: int) -> list[Completions]:
    """A batch of groups of `n` rows as one Completions per group; the batch's time shared among them."""
    k = c.ids.shape[0] // n
    seconds = c.seconds / max(k, 1)
    return [Completions(c.ids[i * n : (i + 1) * n], c.mask[i * n : (i + 1) * n], seconds) for i in range(k)]
