"""The transformers engine: completions drawn with transformers' `generate` (KV cache), keyed (keyed.py).

Completions are drawn in batches (`batch`): every group of a window, or every live episode's next turn, in
one left-padded `generate` call. Each row draws from its own key's generator and is cut at its own budget,
so what a request draws does not depend on what shares its batch (tests/unit/generation/test_batching.py
checks it token for token against drawing each alone).

Under ZeRO-3 and FSDP every rank must run as many forward passes as the others (each one gathers the
shards): `synced` passes transformers' `synced_gpus`, which keeps a finished rank stepping until all are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList

from training.generation.keyed import Completions, KeyedSampler, Request, end_mask, sample_seed, sampled


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
    synced: bool = False  # ZeRO-3/FSDP: every rank steps until all are done (transformers' synced_gpus)

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
    def batch(self, model, requests: list[Request], device, version=None) -> Completions:
        """The completions of `requests`, in order, drawn in one left-padded `generate` call: each row keyed by
        its own seed (or all greedy) and cut at its own budget, so a request draws the same tokens whatever
        shares its batch. `version` (the step the policy is at) matters to an engine that holds its own copy
        of the weights."""
        width = max(len(r.ids) for r in requests)
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r.ids)) + r.ids for r in requests], device=device)
        mask = torch.tensor([[0] * (width - len(r.ids)) + [1] * len(r.ids) for r in requests], device=device)
        generators = [torch.Generator().manual_seed(r.seed) for r in requests] if sampled(requests) else None
        sampler = KeyedSampler(generators, self.temperature, self.top_p)  # no generators: greedy
        c = self._generate(model, ids, mask, sampler, max(r.max_new_tokens for r in requests))
        budget = torch.tensor([r.max_new_tokens for r in requests], device=c.ids.device)
        c.mask = (
            c.mask * (torch.arange(c.ids.shape[1], device=c.ids.device)[None, :] < budget[:, None]).long()
        )
        c.ids = c.ids.masked_fill(c.mask == 0, pad)
        return c

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
        self._generate(model, t, torch.ones_like(t), KeyedSampler(None, 1.0, 1.0), 1)

    def _generate(
        self, model, ids, attention_mask, sampler: KeyedSampler, max_new_tokens=None
    ) -> Completions:
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=ids,
                attention_mask=attention_mask,
                generation_config=self.config(max_new_tokens),
                logits_processor=LogitsProcessorList([sampler]),
                synced_gpus=self.synced,
            )
        finally:
            model.train(was_training)
        completion = out[:, ids.shape[1] :]
        mask = end_mask(completion, self.eos_token_ids)
        completion = completion.masked_fill(mask == 0, self.pad_token_id)
        return Completions(completion, mask, time.perf_counter() - start)


def split_groups(c: Completions, n: int) -> list[Completions]:
    """A batch of groups of `n` rows as one Completions per group; the batch's time shared among them."""
    k = c.ids.shape[0] // n
    seconds = c.seconds / max(k, 1)
    return [Completions(c.ids[i * n : (i + 1) * n], c.mask[i * n : (i + 1) * n], seconds) for i in range(k)]
