"""Generation speed: tokens/s of each way this project (and transformers) can draw completions, at 1, 8 and 32
concurrent requests of 64 new tokens each, on the bundled SmolLM2-135M-Instruct in fp32.

    python -m benchmarks.generation [--concurrency 1,8,32] [--tokens 64] [--ways one,engine,keyed-cb,cb]
                                    [--model SOURCE] [--device cpu|cuda] [--dtype fp32|bf16]
                                    [--lora R] [--autocast bf16]

--lora R wraps the model in a LoRA adapter of rank R on all linear layers (its B matrices drawn small, as after
some training), as a LoRA run's policy; --autocast bf16 generates under bf16 autocast, as a run with
`precision: bf16` does (the weights stay in --dtype: fp32 for a LoRA run's base).

--model takes any source the chat CLI takes (a model directory, a run); the default is the bundled model.
On a machine without the bundled package, a directory of the same shape with random weights measures the same
speed (every request draws a fixed number of tokens, whatever the weights).

Ways:
  one      transformers' `generate`, one request at a time (how episodes' later turns were drawn before)
  engine   the rollout engine (training.generation.TransformersEngine.batch): every request in one
           left-padded `generate` call, each keyed by its own seed (what rollouts and episodes use); with --lora
           and --autocast it generates on a copy of the base with the adapter merged
           (training/generation/merged.py)
  adapter  the same engine through peft's LoRA layers (merge_lora=False): what it did before the merged copy
  keyed-cb the continuous batching engine (training.generation.cb_engine.ContinuousBatchingEngine.batch):
           transformers' continuous batching, each request keyed by its own seed (the engine's draws)
  cb       transformers' continuous batching (`model.generate_batch`, paged attention), greedy; not keyed
  vllm     a vLLM engine (CUDA only; skipped without it)
Every request runs its full 64 tokens (no end-of-sequence stop), so each way generates the same count. The
chat prompts are the bundled date task's held-out questions (data/dates/test.jsonl), rendered by the chat
template. Where both `engine` and `keyed-cb` run, it also prints how many requests the two drew token for token
alike. Prints a table and writes benchmarks/results/generation.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks.common import ROOT, machine, save_result, table
from training.generation import Request, TransformersEngine, load_for_chat, sample_seed
from training.generation.cb_engine import ContinuousBatchingEngine


def prompts(tokenizer, n: int) -> list[list[int]]:
    lines = (ROOT / "data/dates/test.jsonl").read_text().splitlines()
    chats = [json.loads(x)["messages"][:-1] for x in lines if x.strip()]
    out = []
    for k in range(n):
        text = tokenizer.apply_chat_template(
            chats[k % len(chats)], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def keyed(ids, tokens) -> list[Request]:
    return [Request(p, sample_seed(0, 0, k, 0), tokens) for k, p in enumerate(ids)]


def way_one(model, engine, ids, tokens, device):
    for r in keyed(ids, tokens):
        engine.batch(model, [r], device)


def way_engine(model, engine, ids, tokens, device):
    return engine.batch(model, keyed(ids, tokens), device)


def way_adapter(model, engine, ids, tokens, device):
    return dataclasses.replace(engine, merge_lora=False).batch(model, keyed(ids, tokens), device)


def way_keyed_cb(model, engine, ids, tokens, device):
    return ContinuousBatchingEngine.like(engine).batch(model, keyed(ids, tokens), device)


def way_cb(model, engine, ids, tokens, device):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=ids, generation_config=config, progress_bar=False)


WAYS = {"one": way_one, "engine": way_engine, "adapter": way_adapter, "keyed-cb": way_keyed_cb, "cb": way_cb}


def with_lora(model, rank: int):
    """`model` under a LoRA adapter of rank `rank` on every linear layer, its B matrices small and not zero."""
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    return policy


def same_draws(a, b) -> int:
    """How many requests two keyed ways drew token for token alike."""
    return sum(
        a.ids[k, : int(a.mask[k].sum())].tolist() == b.ids[k, : int(b.mask[k].sum())].tolist()
        for k in range(a.ids.shape[0])
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generation")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ways", default="one,engine,keyed-cb,cb")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--lora", type=int, default=0, help="wrap the model in a LoRA adapter of this rank")
    ap.add_argument("--autocast", choices=["bf16"], default=None, help="generate under this autocast")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load_for_chat(args.model, args.device, DTYPES[args.dtype])
    model.generation_config.eos_token_id = None
    if args.lora:
        model = with_lora(model, args.lora)
    # no end-of-sequence token: every request generates exactly --tokens tokens, whichever way draws it
    engine = TransformersEngine(0, args.tokens, 1.0, 1.0, [-1], tokenizer.pad_token_id)
    if args.autocast:
        engine.autocast = lambda: torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16)
    rows, results, equal = [], [], {}
    for n in [int(x) for x in args.concurrency.split(",")]:
        ids = prompts(tokenizer, n)
        base, drawn = None, {}
        for name in args.ways.split(","):
            WAYS[name](model, engine, ids[:1], 4, args.device)  # warm-up (kernels, the paged cache's set-up)
            seconds, drawn[name] = timed(WAYS[name], model, engine, ids, args.tokens, args.device)
            speed = n * args.tokens / seconds
            base = base or (speed if name == "one" else None)
            ratio = f"{speed / base:.1f}x" if base else ""
            rows.append([n, name, f"{seconds:.1f}", f"{speed:.1f}", ratio])
            results.append({"concurrency": n, "way": name, "seconds": seconds, "tokens_per_s": speed})
            print(f"{n} requests, {name}: {speed:.1f} tokens/s", flush=True)
        if drawn.get("engine") is not None and drawn.get("keyed-cb") is not None:
            alike = same_draws(drawn["engine"], drawn["keyed-cb"])
            equal[n] = alike
            print(f"{n} requests: keyed-cb drew what engine drew for {alike} of {n}", flush=True)
    how = (
        f"{args.dtype}"
        + (f", LoRA r={args.lora}" if args.lora else "")
        + (f", {args.autocast} autocast" if args.autocast else "")
    )
    print(f"\n{args.tokens} new tokens per request, {args.model} {how} ({machine()})\n")
    print(table(["requests", "way", "seconds", "tokens/s", "vs one at a time"], rows))
    out = {"tokens": args.tokens, "model": args.model, "dtype": args.dtype, "device": args.device}
    out |= {"lora": args.lora, "autocast": args.autocast}
    out |= {"machine": machine(), "runs": results, "keyed_cb_equal_to_engine": equal}
    save_result("generation", out)
    return out


if __name__ == "__main__":
    main()
