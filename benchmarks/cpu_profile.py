"""Where a CPU training step's time goes: torch.profiler's operators by their own time, over one step
(forward with the chunked loss, backward, optimizer step) of benchmarks.vs_trainer's model, the bundled
SmolLM2-135M with LoRA r16, at `--batch` rows of `--length` tokens, in the recipe's precision (bf16 autocast
by default), after two warm-up steps. Against this machine's measured matmul ceiling (the one the loop's MFU
uses): the step's MFU, and how fast its matrix multiplies alone run (their FLOPs counted by the profiler in a
second profiled step, over their own time in the first) -- what separates the two is the time spent in
attention's kernels and in element-wise work.

    python -m benchmarks.cpu_profile [--batch 8] [--length 512] [--precision bf16] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import ROOT, TOKENIZER, machine, save_result, table, tempdir


def main(argv=None) -> dict:
    from training.config import parse_recipe
    from training.data.tokenizer import load_tokenizer
    from training.model.build import build_model
    from training.model.optim import build_optimizer
    from training.model.speed import device_peak, model_training_flops
    from training.objectives.next_token import choose_loss, token_loss

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_profile", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "no"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model.dtype")
    args = ap.parse_args(argv)
    recipe = parse_recipe(
        {
            "output_dir": str(tempdir("cpu-profile") / "run"),
            "precision": args.precision,
            "model": {"name_or_path": TOKENIZER, "dtype": args.dtype},
            "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
            "data": {
                "train": str(ROOT / "data/chat/train.jsonl"),
                "format": "chat",
                "max_length": args.length,
            },
            "train": {"batch_size": args.batch, "max_steps": 1, "lr": 1e-4},
        }
    )
    cpu = torch.device("cpu")
    model = build_model(recipe, load_tokenizer(recipe.model), cpu)
    choose_loss(model, recipe.train.loss_impl, cpu)
    optimizer = build_optimizer(model, recipe.train)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            s, n, _ = token_loss(model, batch)
        (s / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(), step()  # warm-up: allocator, kernels' first calls
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    # counting FLOPs slows every operator down, so the counts come from a step of their own
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as counted:
        step()
    matmuls = ("aten::mm", "aten::addmm", "aten::bmm")
    mm_flops = sum(e.flops for e in counted.key_averages() if e.key in matmuls)
    mm_s = sum(e.self_cpu_time_total for e in ops if e.key in matmuls) / 1e6
    attention_s = sum(e.self_cpu_time_total for e in ops if "scaled_dot_product" in e.key) / 1e6
    tokens = args.batch * args.length
    model_flops = float(model_training_flops(model).of(tokens, tokens, args.batch * args.length**2))
    ceiling, how = device_peak(cpu, args.precision, args.dtype, model.config, tokens)
    top = [
        {
            "op": e.key,
            "self_s": e.self_cpu_time_total / 1e6,
            "share_pct": 100 * e.self_cpu_time_total / total,
            "calls": e.count,
        }
        for e in ops[:12]
    ]
    print(
        f"## One LoRA step of SmolLM2-135M, {args.batch} x {args.length} tokens, precision {args.precision}"
    )
    print(f"{machine()}\n\nstep {seconds:.2f} s ({tokens / seconds:.0f} tokens/s)")
    print(f"ceiling: {how}")
    print(
        f"MFU {model_flops / seconds / ceiling:.0%} ({model_flops / 1e12:.2f} TFLOP of model FLOPs per step); "
        f"the matrix multiplies alone: {mm_flops / 1e12:.2f} TFLOP in {mm_s:.2f} s of their own time, "
        f"{mm_flops / mm_s / ceiling:.0%} of the ceiling ({mm_s / (total / 1e6):.0%} of the profiled step); "
        f"attention's kernels {attention_s / (total / 1e6):.0%} of it\n"
    )
    print(
        table(
            ["operator", "own time s", "share %", "calls"],
            [[r["op"], r["self_s"], round(r["share_pct"], 1), r["calls"]] for r in top],
        )
    )
    result = {
        "machine": machine(),
        **vars(args),
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "ceiling_flops": ceiling,
        "mfu": model_flops / seconds / ceiling,
        "matmul_flops": mm_flops,
        "matmul_s": mm_s,
        "matmul_share_of_ceiling": mm_flops / mm_s / ceiling,
        "attention_s": attention_s,
        "top": top,
    }
    print(f"\nresults: {save_result('cpu_profile', result)}")
    return result


if __name__ == "__main__":
    main()
