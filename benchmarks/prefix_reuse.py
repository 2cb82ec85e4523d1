"""Agent episodes three ways: the bundled agent task's episodes (data/agent: a calculator tool, up to 3 replies)
drawn by the rollout engine turn by turn without and with reusing keys and values (training/generation/
prefix_cache.py: a group's prompt computed once, each turn going on from the last turn's cache), and by continuous
batching (rl.batching: continuous: each episode's next turn handed in as soon as its tool answers), on the bundled
SmolLM2-135M-Instruct (with a run's LoRA adapter, e.g. after training/recipes/agent_sft.yaml, the policy calls
the tool and episodes have several turns).

    python -m benchmarks.prefix_reuse [RUN] [--prompts 4] [--generations 4] [--dtype bf16] [--repeat 2]
                                      [--ways recompute,reuse,continuous] [--tool-seconds 0]

--tool-seconds makes each tool call take that long (a sandboxed program, a web request), to show what handing a
turn in without waiting for the others' turns is worth. Each way draws the same keyed episodes
(training.rl.episode.EpisodeRunner, as agent_grpo.yaml's step does); prints the seconds of each way (best of
--repeat), the turns, and how many episodes each drew token for token as the first way did; writes
benchmarks/results/prefix_reuse.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time

import torch

from benchmarks.common import ROOT, bundled_policy, machine, save_result, table
from training.generation import ContinuousBatchingEngine, TransformersEngine
from training.rl.episode import EpisodeRunner
from training.rl.tools import schema_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def calculator(seconds: float):
    """The task's calculator, taking `seconds` more per call."""
    spec = importlib.util.spec_from_file_location("agent_task", ROOT / "data/agent/task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    @functools.wraps(module.calculate)
    def calculate(*args, **kwargs):
        time.sleep(seconds)
        return module.calculate(*args, **kwargs)

    return calculate


def runner(tokenizer, way: str, tool_seconds: float) -> EpisodeRunner:
    """agent_grpo.yaml's episodes: its tool, 3 turns, 96 tokens after the prompt, temperature 1.0."""
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = TransformersEngine(0, 96, 1.0, 1.0, eos, tokenizer.pad_token_id, reuse_prefixes=way == "reuse")
    if way == "continuous":
        engine = ContinuousBatchingEngine.like(engine)
    calculate = calculator(tool_seconds)
    tools, schemas = {"calculate": calculate}, [schema_of(calculate, "rl.tools")]
    return EpisodeRunner(engine, tokenizer, tools, None, 3, 96, 2000, {}, schemas, calls_of=lambda n: n)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", help="a run directory whose final/ holds a LoRA adapter")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ways", default="recompute,reuse,continuous")
    ap.add_argument("--tool-seconds", type=float, default=0.0)
    args = ap.parse_args(argv)
    model, tokenizer = bundled_policy(args.run)
    model.to(DTYPES[args.dtype])
    tokenizer.chat_template = (ROOT / "data/tools/chatml_tools.jinja").read_text()
    lines = (ROOT / "data/agent/train.jsonl").read_text().splitlines()[: args.prompts]
    groups = [(json.loads(x)["prompt"], {}, k) for k, x in enumerate(lines)]
    results, drawn = {}, {}
    ways = args.ways.split(",")
    for way in ways:
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            episodes = runner(tokenizer, way, args.tool_seconds).run(
                model, groups, 1, args.generations, "cpu"
            )
            best = min(best, time.perf_counter() - start)
        drawn[way] = [e.tokens for e in episodes]
        calls = sum(e.tool_calls for e in episodes)
        same = sum(a == b for a, b in zip(drawn[ways[0]], drawn[way]))
        results[way] = {
            "seconds": best,
            "turns": sum(e.turns for e in episodes),
            "tool_calls": calls,
            "same": same,
        }
    first = results[ways[0]]["seconds"]
    rows = [
        [k, f"{v['seconds']:.1f}", f"{first / v['seconds']:.2f}x", v["turns"], v["tool_calls"], v["same"]]
        for k, v in results.items()
    ]
    print(
        f"{machine()}; {args.dtype}; {args.prompts} prompts x {args.generations} generations; {args.run or 'base'}; "
        f"tools take {args.tool_seconds:g} s more"
    )
    print(
        table(["way", "seconds (best)", f"vs {ways[0]}", "replies", "tool calls", f"alike {ways[0]}"], rows)
    )
    payload = {"machine": machine(), "dtype": args.dtype, "run": args.run, "tool_seconds": args.tool_seconds}
    payload["results"] = results
    save_result("prefix_reuse", payload)
    return payload


if __name__ == "__main__":
    main()
