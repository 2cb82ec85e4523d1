"""The one interface every rollout engine offers to online RL, its episodes and distillation's on-policy
steps: `TransformersEngine` (transformers' `generate`, the default) and `VLLMEngine` (a colocated vLLM
engine, rl.generator: vllm) satisfy it. Every draw is keyed (training.generation.keyed), so which engine
and how many processes generate never change what a key draws on one engine.
"""

from __future__ import annotations

from typing import Protocol

from training.generation.keyed import Completions


class Engine(Protocol):
    seed: int
    eos_token_ids: list[int]
    pad_token_id: int

    def group(self, model, prompt_ids: list[int], step: int, row: int | str, n: int, device) -> Completions:
        """`n` completions of one prompt, keyed (seed, step, row, 0..n-1)."""

    def groups(
        self, model, prompts: list[list[int]], step: int, rows: list, n: int, device
    ) -> list[Completions]:
        """`group` of each prompt (of its row)."""

    def greedy(self, model, prompts: list[list[int]], device, version=None) -> Completions:
        """One greedy completion per prompt (held-out evaluation); `version`: the step the policy is at, for an
        engine that holds its own copy of the weights."""


class TurnEngine(Engine, Protocol):
    """An engine that also runs an episode's later turns and keeps sharded ranks in step (the transformers
    engine; episodes need it)."""

    synced: bool

    def one(self, model, ids: list[int], seed: int | None, max_new_tokens: int, device) -> Completions:
        """One completion of `ids` drawn with its own seed (None: greedy), at most `max_new_tokens` long."""

    def idle(self, model, device) -> None:
        """A generation whose result is dropped, so that every sharded rank runs as many `generate` calls."""
