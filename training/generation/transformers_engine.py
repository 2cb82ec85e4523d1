"""The transformers engine: completions drawn with transformers' `generate` (KV cache), keyed (keyed.py).

A group (the num_generations completions of one prompt) is generated as one batch of identical prompts,
so no padding and no neighbour changes its numbers either.

Under ZeRO-3 and FSDP every rank must run as many forward passes as the others (each one gathers the
shards): `synced` passes transformers' `synced_gpus`, which keeps a finished rank stepping until all are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList

from training.generation.keyed import Completions, KeyedSampler, end_mask, sample_seed


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
    def group(self, model, prompt_ids: list[int], step: int, row: int | str, n: int, device) -> Completions:
        """`n` completions of one prompt, keyed (seed, step, row, 0..n-1)."""
        generators = [torch.Generator().manual_seed(sample_seed(self.seed, step, row, g)) for g in range(n)]
        ids = torch.tensor([prompt_ids] * n, device=device)
        return self._generate(
            model, ids, torch.ones_like(ids), KeyedSampler(generators, self.temperature, self.top_p)
        )

    def groups(self, model, prompts: list[list[int]], step: int, rows: list[int], n: int, device):
        """`group` of each prompt (of its row)."""
        return [self.group(model, p, step, r, n, device) for p, r in zip(prompts, rows)]

    @torch.no_grad()
    def greedy(self, model, prompts: list[list[int]], device, version=None) -> Completions:
        """One greedy completion per prompt (held-out evaluation); prompts left-padded into one batch.
        `version` (the step the policy is at) matters to a sampler that holds its own copy of the weights."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return self._generate(model, ids, mask, KeyedSampler(None, 1.0, 1.0))

    @torch.no_grad()
    def one(self, model, ids: list[int], seed: int | None, max_new_tokens: int, device) -> Completions:
        """One completion of `ids` drawn with its own seed (None: greedy), at most `max_new_tokens` long: a
        later turn of an episode, whose context is its own."""
        generators = None if seed is None else [torch.Generator().manual_seed(seed)]
        t = torch.tensor([ids], device=device)
        sampler = KeyedSampler(generators, self.temperature, self.top_p)
        return self._generate(model, t, torch.ones_like(t), sampler, max_new_tokens)

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
