"""The rollout stage on vLLM (rl.generator: vllm): the same interface as the transformers engine
(training.generation.engine.Engine),
with completions drawn by a vLLM engine colocated in each training process instead of transformers'
`generate`.

The engine and the weight sync are TRL's (`trl.generation.vllm_generation.VLLMGeneration`, colocate mode:
`LLM(..., distributed_executor_backend="external_launcher")` in every rank, the policy's weights pushed into
it with `load_weights`, gathered one parameter at a time under ZeRO-3 and FSDP, a LoRA adapter merged for
the push and unmerged after). Here only the draw differs from TRL's: each completion is its own request
whose `SamplingParams.seed` is the completion's key (seed, step, prompt row, generation), as the
transformers sampler keys its Gumbel noise, so one process and N processes ask vLLM for the same draws of
the same rows. vLLM's numbers are not transformers' (other kernels, bf16), so a vLLM run does not equal a
transformers run step for step, and the loss's log-probabilities are the training model's own.

The weights are pushed when the policy may have changed since the last push: before the first rollout
of each step that samples, and before each held-out evaluation (every rank at the same points: the
gathers are collective).
"""

from __future__ import annotations

import importlib.util
import time

import torch

from training.core.errors import RecipeError
from training.generation.keyed import Completions, Request
from training.generation.requests_engine import RequestEngine, padded_completions
from training.generation.transformers_engine import TransformersEngine


def check_vllm_installed() -> None:
    """rl.generator=vllm needs the vllm package (and TRL, whose colocated engine and weight sync it uses)."""
    missing = [p for p in ("vllm", "trl") if importlib.util.find_spec(p) is None]
    if missing:
        raise RecipeError(
            f"rl.generator=vllm needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}: "
            "pip install 'llm-forge[vllm]' on a CUDA machine, or use rl.generator=transformers"
        )


class VLLMEngine(RequestEngine):
    """The Engine interface on a colocated vLLM engine, made on first use."""

    def __init__(
        self,
        base: TransformersEngine,
        accelerator,
        tokenizer,
        *,
        gpu_memory_utilization: float,
        max_model_len: int,
    ):
        self.base, self.accelerator, self.tokenizer = base, accelerator, tokenizer
        self.gpu_memory_utilization, self.max_model_len = gpu_memory_utilization, max_model_len
        self.engine = None
        self._pushed = None  # the key of the policy the engine holds

    synced = False  # each process's engine generates on its own; the weight push gathers collectively

    def _engine(self, model, key):
        if self.engine is None:
            from trl.generation.vllm_generation import VLLMGeneration

            self.engine = VLLMGeneration(
                model,
                self.accelerator,
                self.tokenizer,
                mode="colocate",
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_length=self.max_model_len,
                max_completion_length=self.base.max_new_tokens,
            )
        if key != self._pushed:
            self.engine.sync_weights()
            self._pushed = key
        return self.engine.llm

    def _draw(self, model, key, prompts: list[list[int]], params: list) -> Completions:
        llm = self._engine(model, key)
        start = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False
        )
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return padded_completions(tokens, self.eos_token_ids, self.pad_token_id, time.perf_counter() - start)

    def _params(self, seed: int | None, max_tokens: int | None = None):
        from vllm import SamplingParams

        b = self.base
        common = dict(
            n=1, max_tokens=max_tokens or b.max_new_tokens, stop_token_ids=b.eos_token_ids, detokenize=False
        )
        if seed is None:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=b.temperature, top_p=b.top_p, seed=seed, **common)

    @torch.no_grad()
    def batch(self, model, requests: list[Request], device, version=None, prefixes=None) -> Completions:
        """The completions of `requests` in one vLLM call, each its own request seeded by its key (greedy
        where it has none) with its own budget: an episode's turns too. `version`: the step the policy is
        at (the weights are pushed when it changes)."""
        kind = "eval" if all(r.seed is None for r in requests) else "rollout"
        params = [self._params(r.seed, r.max_new_tokens) for r in requests]
        c = self._draw(model, (kind, version), [r.ids for r in requests], params)
        return Completions(c.ids.to(device), c.mask.to(device), c.seconds)

    def idle(self, model, device) -> None:
        """Nothing: each process's vLLM engine generates on its own (no rank waits for another's steps)."""
