"""The one interface every rollout engine offers to online RL, its episodes and distillation's on-policy
steps: `TransformersEngine` (transformers' `generate`, the default), `ContinuousBatchingEngine` (transformers'
continuous batching, cb_engine.py) and `VLLMEngine` (a colocated vLLM engine, rl.generator: vllm) satisfy it.
Every draw is keyed (training.generation.keyed): what a request draws depends on its key alone, not on which
requests share its batch or how many processes generate.
"""

from __future__ import annotations

from typing import Protocol

from training.generation.keyed import Completions, Request


class Engine(Protocol):
    seed: int
    eos_token_ids: list[int]
    pad_token_id: int
    synced: bool  # ranks step generation together (ZeRO-3/FSDP): each rank makes as many calls as the most

    def batch(self, model, requests: list[Request], device, version=None, prefixes=None) -> Completions:
        """The completions of `requests`, in order, in one call (an episode's turns, a window's groups);
        `version`: the step the policy is at, for an engine that holds its own copy of the weights;
        `prefixes`: a PrefixStore the caller keeps between its calls (an episode run's turns), where an engine
        that can keep the rows' keys and values for the next call does (prefix_cache.py; the others ignore it,
        vLLM caches prefixes on its own)."""

    def group(self, model, prompt_ids: list[int], step: int, row: int | str, n: int, device) -> Completions:
        """`n` completions of one prompt, keyed (seed, step, row, 0..n-1)."""

    def groups(
        self, model, prompts: list[list[int]], step: int, rows: list, n: int, device
    ) -> list[Completions]:
        """`group` of each prompt (of its row), in one call."""

    def greedy(self, model, prompts: list[list[int]], device, version=None) -> Completions:
        """One greedy completion per prompt (held-out evaluation)."""

    def idle(self, model, device) -> None:
        """A call whose result is dropped, so that every synced rank makes as many calls as the others."""
