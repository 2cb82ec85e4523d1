"""The rollout stage of online RL: completions sampled from the policy with transformers' `generate` (KV
cache), each completion's randomness keyed by (seed, step, prompt row, generation).

transformers draws its samples from the global torch RNG, so which completions a process draws would
depend on how many prompts it generated before: one process and two would differ, and a resumed run
would need the RNG's state. Here `generate` runs greedily over logits that `KeyedSampler` has already
decided: temperature and top-p, then a Gumbel-max draw (argmax of logits + Gumbel noise, an exact
sample of the softmax) with noise from the completion's own generator, seeded from the key. One
process and N processes, and a run resumed after kill -9, draw the same completions for the same rows.
A group (the num_generations completions of one prompt) is generated as one batch of identical prompts,
so no padding and no neighbour changes its numbers either.

Under ZeRO-3 and FSDP every rank must run as many forward passes as the others (each one gathers the
shards): `synced` passes transformers' `synced_gpus`, which keeps a finished rank stepping until all are.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList


def sample_seed(seed: int, step: int, row: int | str, generation: int, turn: int = 0) -> int:
    """A 63-bit seed of one completion (turn 0) or of one later turn of an episode, from its key (stable across
    processes, runs and machines). `row` may be a string: a replacement prompt's key (dynamic sampling)."""
    key = f"{seed}/{step}/{row}/{generation}" + (f"/{turn}" if turn else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class KeyedSampler(LogitsProcessor):
    """Temperature, top-p, then one Gumbel-max draw per sequence from its own generator: the returned scores
    are 0 for the drawn token and -inf elsewhere, so greedy decoding picks it. `generators=None`: greedy."""

    def __init__(self, generators: list[torch.Generator] | None, temperature: float, top_p: float):
        self.generators, self.temperature, self.top_p = generators, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float()
        if self.generators is not None:
            logits = logits / self.temperature
            if self.top_p < 1.0:
                logits = top_p_filter(logits, self.top_p)
            noise = torch.stack([gumbel(logits.shape[-1], g) for g in self.generators]).to(logits.device)
            logits = logits + noise
        choice = logits.argmax(-1)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(choice)), choice] = 0.0
        return out


def gumbel(n: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=generator, dtype=torch.float64).clamp(min=1e-300)
    return (-torch.log(-torch.log(u))).float()


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside the smallest set of most likely tokens whose probability reaches top_p (one at least)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p  # the mass before this token already reached top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def end_mask(ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 up to and including each row's first end-of-sequence token, 0 after it."""
    is_end = torch.isin(ids, torch.tensor(eos_token_ids, device=ids.device)).int()
    return (is_end.cumsum(-1) - is_end == 0).long()


@dataclass
class Completions:
    """One batch of generated completions: ids [N, T] (padded after the end), mask [N, T] (1 up to and
    including the end-of-sequence token), and the seconds the generation took."""

    ids: torch.Tensor
    mask: torch.Tensor
    seconds: float

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)


@dataclass
class Sampler:
    """How completions are drawn (the recipe's rl section and the run's seed)."""

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
