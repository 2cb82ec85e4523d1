"""Prefix reuse in agent episodes: the bundled agent task's episodes (data/agent: a calculator tool, up to 3
replies) drawn by the rollout engine with and without reusing keys and values (training/generation/
prefix_cache.py: a group's prompt computed once, each turn going on from the last turn's cache), on the bundled
SmolLM2-135M-Instruct (with a run's LoRA adapter, e.g. after training/recipes/agent_sft.yaml, the policy calls
the tool and episodes have several turns).

    python -m benchmarks.prefix_reuse [RUN] [--prompts 4] [--generations 4] [--dtype bf16] [--repeat 2]

Each way draws the same keyed episodes (training.rl.episode.EpisodeRunner, as agent_grpo.yaml's step does);
prints the seconds of each way (best of --repeat), the turns, and how many episodes the two drew token for
token alike; writes benchmarks/results/prefix_reuse.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from benchmarks.common import ROOT, bundled_policy, machine, save_result, table
from training.generation import TransformersEngine
from training.rl.episode import EpisodeRunner
from training.rl.tools import schema_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def calculator():
    spec = importlib.util.spec_from_file_location("agent_task", ROOT / "data/agent/task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.calculate


def runner(tokenizer, reuse: bool) -> EpisodeRunner:
    """agent_grpo.yaml's episodes: its tool, 3 turns, 96 tokens after the prompt, temperature 1.0."""
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = TransformersEngine(0, 96, 1.0, 1.0, eos, tokenizer.pad_token_id, reuse_prefixes=reuse)
    calculate = calculator()
    tools, schemas = {"calculate": calculate}, [schema_of(calculate, "rl.tools")]
    return EpisodeRunner(engine, tokenizer, tools, None, 3, 96, 2000, {}, schemas, calls_of=lambda n: n)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", help="a run directory whose final/ holds a LoRA adapter")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    model, tokenizer = bundled_policy(args.run)
    model.to(DTYPES[args.dtype])
    tokenizer.chat_template = (ROOT / "data/tools/chatml_tools.jinja").read_text()
    lines = (ROOT / "data/agent/train.jsonl").read_text().splitlines()[: args.prompts]
    groups = [(json.loads(x)["prompt"], {}, k) for k, x in enumerate(lines)]
    results, drawn = {}, {}
    for reuse in (False, True):
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            episodes = runner(tokenizer, reuse).run(model, groups, 1, args.generations, "cpu")
            best = min(best, time.perf_counter() - start)
        drawn[reuse] = [e.tokens for e in episodes]
        turns = sum(e.turns for e in episodes)
        results["reuse" if reuse else "recompute"] = {"seconds": best, "turns": turns}
    same = sum(a == b for a, b in zip(drawn[False], drawn[True]))
    rows = [[k, f"{v['seconds']:.1f}", v["turns"]] for k, v in results.items()]
    print(
        f"{machine()}; {args.dtype}; {args.prompts} prompts x {args.generations} generations; {args.run or 'base'}"
    )
    print(table(["way", "seconds (best)", "replies"], rows))
    print(
        f"speed-up {results['recompute']['seconds'] / results['reuse']['seconds']:.2f}x; "
        f"{same}/{len(drawn[True])} episodes token for token alike"
    )
    payload = {"machine": machine(), "dtype": args.dtype, "run": args.run, "results": results, "same": same}
    save_result("prefix_reuse", payload)
    return payload


if __name__ == "__main__":
    main()
