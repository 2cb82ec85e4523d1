"""Keyed sampling: each completion's randomness comes from its key (seed, step, prompt row, generation, turn),
never from a shared random stream.

transformers draws its samples from the global torch RNG, so which completions a process draws would
depend on how many prompts it generated before: one process and two would differ, and a resumed run
would need the RNG's state. Here `generate` runs greedily over logits that `KeyedSampler` has already
decided: temperature and top-p, then a Gumbel-max draw (argmax of logits + Gumbel noise, an exact
sample of the softmax) with noise from the completion's own generator, seeded from the key. One
process and N processes, and a run resumed after kill -9, draw the same completions for the same rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor


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
        noise = None
        if self.generators is not None:
            noise = [gumbel(scores.shape[-1], g) for g in self.generators]
        return keyed_choice(scores, noise, self.temperature, self.top_p)

    def rows(self, kept: list[int]) -> KeyedSampler:
        """The sampler of the rows `kept` only, each with its own generator as it stands."""
        generators = None if self.generators is None else [self.generators[i] for i in kept]
        return KeyedSampler(generators, self.temperature, self.top_p)


def keyed_choice(
    scores: torch.Tensor, noise: list[torch.Tensor] | None, temperature: float, top_p: float
) -> torch.Tensor:
    """Each row's draw as scores (0 for the drawn token, -inf elsewhere): temperature, top-p, then the argmax of
    the logits plus the row's Gumbel noise (`noise=None`: the argmax of the logits, greedy)."""
    logits = scores.float()
    if noise is not None:
        if temperature != 1.0:  # x / 1 is x: no pass over the batch's [N, vocabulary] logits
            logits = logits / temperature
        if top_p < 1.0:
            logits = top_p_filter(logits, top_p)
        logits = logits + torch.stack(noise).to(logits.device)
    choice = logits.argmax(-1)
    out = torch.full_like(scores, float("-inf"))
    out[torch.arange(len(choice)), choice] = 0.0
    return out


def gumbel(n: int, generator: torch.Generator) -> torch.Tensor:
    """n Gumbel draws, -log(-log(u)) of the generator's next n uniforms in float64 (in place: no copies)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return u.clamp_(min=1e-300).log_().neg_().log_().neg_().float()


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


def sampled(requests: list[Request]) -> bool:
    """Whether a batch of requests is sampled (every one keyed) or greedy (none); a mix is refused."""
    greedy = [r.seed is None for r in requests]
    if any(greedy) and not all(greedy):
        raise ValueError("a batch is sampled or greedy, not both")
    return not any(greedy)


@dataclass(frozen=True)
class Request:
    """One completion to draw: its context, its key's seed (None: greedy) and its own length budget. Requests
    drawn together in one batch draw what each would alone: each row's noise comes from its own seed, and a
    row is cut at its own budget."""

    ids: list[int]
    seed: int | None
    max_new_tokens: int
