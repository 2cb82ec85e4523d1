"""Layer 4, generation: every `generate` of the project: the rollout engines behind one interface (engine.py:
transformers' generate or its continuous batching, a colocated vLLM), keyed sampling, and the chat library
(models loaded for generation, replies whole or streamed) that the chat CLI, the app, the demo and the
benchmarks use.

Rule: one device's generation: imports core, config, run, data and model only; never torch.distributed,
accelerate's collectives, objectives or anything above.
"""

from training.data.tokenize import probe_tools
from training.data.turns import parse_reply, parse_tools
from training.generation.cb_engine import ContinuousBatchingEngine
from training.generation.chat import (
    ChatOptions,
    complete,
    generate,
    parse_template_kwargs,
    read_tools,
    rendered_prompt,
    run_template_kwargs,
    stream,
)
from training.generation.engine import Engine
from training.generation.keyed import Completions, Request, sample_seed
from training.generation.load import load_for_chat, load_processor, read_image, takes_images, with_image
from training.generation.prefix_cache import PrefixStore
from training.generation.transformers_engine import TransformersEngine

__all__ = [
    "ChatOptions",
    "Completions",
    "ContinuousBatchingEngine",
    "Engine",
    "PrefixStore",
    "Request",
    "TransformersEngine",
    "complete",
    "generate",
    "load_for_chat",
    "load_processor",
    "parse_reply",  # the app's Chat tab reads replies with it
    "parse_tools",
    "parse_template_kwargs",
    "probe_tools",
    "read_image",
    "read_tools",
    "rendered_prompt",
    "run_template_kwargs",
    "sample_seed",
    "stream",
    "takes_images",
    "with_image",
]
