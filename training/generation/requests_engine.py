"""What the engines that draw each completion as its own keyed request share (a colocated vLLM, a server): the
groups of a window, one prompt's group and the greedy held-out draws, each built on the engine's `batch`, and the
drawn token lists made into one padded Completions."""

from __future__ import annotations

import torch

from training.generation.keyed import Completions, Request, end_mask, sample_seed
from training.generation.transformers_engine import TransformersEngine, split_groups


def padded_completions(token_lists: list[list[int]], eos_token_ids: list[int], pad: int, seconds: float):
    """Drawn token lists (the end token kept where one ended them) as a padded Completions."""
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), pad, dtype=torch.long)
    for k, t in enumerate(token_lists):
        ids[k, : len(t)] = torch.tensor(t, dtype=torch.long)
    mask = end_mask(ids, eos_token_ids)
    lengths = torch.tensor([len(t) for t in token_lists])
    mask = mask * (torch.arange(width)[None, :] < lengths[:, None]).long()  # nothing past what was drawn
    return Completions(ids.masked_fill(mask == 0, pad), mask, seconds)


class RequestEngine:
    """The Engine interface's group draws on a subclass's `batch(model, requests, device, version)`; `base`: the
    transformers engine whose settings (seed, budget, temperature, top-p, end and pad tokens) it draws with."""

    base: TransformersEngine

    # the fields the objective reads from an engine
    seed = property(lambda self: self.base.seed)
    eos_token_ids = property(lambda self: self.base.eos_token_ids)
    pad_token_id = property(lambda self: self.base.pad_token_id)

    def batch(self, model, requests: list[Request], device, version=None, prefixes=None) -> Completions:
        raise NotImplementedError

    def groups(
        self, model, prompts: list[list[int]], step: int, rows: list, n: int, device
    ) -> list[Completions]:
        """The completions of several prompts, `n` each, keyed (seed, step, row, 0..n-1): one call."""
        requests = [
            Request(p, sample_seed(self.seed, step, r, g), self.base.max_new_tokens)
            for p, r in zip(prompts, rows)
            for g in range(n)
        ]
        return split_groups(self.batch(model, requests, device, version=step), n)

    def group(self, model, prompt_ids: list[int], step: int, row: int, n: int, device) -> Completions:
        return self.groups(model, [prompt_ids], step, [row], n, device)[0]

    def greedy(self, model, prompts: list[list[int]], device, version=None) -> Completions:
        return self.batch(
            model, [Request(p, None, self.base.max_new_tokens) for p in prompts], device, version
        )
