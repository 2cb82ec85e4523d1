"""Packing benchmark: packing efficiency and training throughput (real tokens/s) of the ways to batch.

    python -m benchmarks.packing                     # data/chat (realistic lengths), SmolLM2-135M + LoRA, CPU
    python -m benchmarks.packing --precision no --repeats 3 --steps 4
    python -m benchmarks.packing --data data/dates/train.jsonl --max-length 512

Prints figures; it is not a timed test. The same examples batched four ways, each for the same
number of optimizer steps of about the same real tokens per step (`--batch-size` examples, or that many
examples' worth of packed rows):
  padded-dyn     random order, padded to the longest example of each batch (the loop's default)
  grouped        length-grouped order (train.group_by_length), padded to the longest of each batch
  packed-mask    packed rows padded to the longest row, attention kept inside each example by a dense
                 block-diagonal mask (the packed path before sdpa_varlen; still used by eager attention)
  packed-varlen  packed rows flattened padding-free, one causal SDPA call per example (data.packing: true)
The modes run round-robin (A, B, C, D, A, B, ...) `--repeats` times and the median is reported, so a
noisy machine slows all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time

import torch

from benchmarks.common import ROOT, machine, save_result, table
from training.config import ModelSection, parse_recipe
from training.core.batch import real_tokens
from training.data import build_datasets
from training.data.loader import Collator, EpochSampler, PackedCollator
from training.data.packing import pack_dataset, packing_efficiency
from training.data.tokenizer import load_tokenizer
from training.model.attention import VARLEN_SDPA

MODES = ("padded-dyn", "grouped", "packed-mask", "packed-varlen")


def efficiency_table(examples, lengths=(256, 512, 1024, 2048, 4096)) -> list[tuple[int, int, float]]:
    rows = []
    for n in lengths:
        fits = examples.select([i for i, ids in enumerate(examples["input_ids"]) if len(ids) <= n])
        packed = pack_dataset(fits, n)
        rows.append((n, len(packed), packing_efficiency(packed, n)))
    return rows


def run_steps(model, optimizer, batches, precision: str) -> tuple[int, float]:
    """(real tokens, seconds) over the batches after the first (a warm-up step)."""
    from training.objectives.next_token import token_loss

    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    )
    model.train()
    n_tok, t0 = 0, 0.0
    for i, batch in enumerate(batches):
        if i == 1:
            t0 = time.perf_counter()
        with autocast:
            s, n, _ = token_loss(model, batch)
        (s / n.clamp(min=1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 1:
            n_tok += int(real_tokens(batch))
    return n_tok, time.perf_counter() - t0


def make_batches(examples, packed, args, pad: int) -> dict[str, list[dict]]:
    k, b = args.steps + 1, args.batch_size
    lens = [len(x) for x in examples["input_ids"]]
    rows_per_step = max(1, round(b * sum(lens) / len(lens) / args.max_length))

    def take(ds, order, i, n):
        part = ds[order[i * n : (i + 1) * n]]
        return [dict(zip(part, v)) for v in zip(*part.values())]

    random_order = list(EpochSampler(len(examples), seed=0))
    grouped_order = list(EpochSampler(len(examples), seed=0, lengths=lens, batch_size=b))
    # grouped: the batches of one mega-batch run from long to short; take every 25th so the sample spans them
    spread = [grouped_order[j * b : (j + 1) * b] for j in range(0, len(grouped_order) // b, 25)][:k]
    porder = list(EpochSampler(len(packed), seed=0))
    return {
        "padded-dyn": [Collator(pad)(take(examples, random_order, i, b)) for i in range(k)],
        "grouped": [Collator(pad)(take(examples, sum(spread, []), i, b)) for i in range(k)],
        "packed-mask": [PackedCollator(pad)(take(packed, porder, i, rows_per_step)) for i in range(k)],
        "packed-varlen": [
            PackedCollator(pad, padding_free=True)(take(packed, porder, i, rows_per_step)) for i in range(k)
        ],
    }, rows_per_step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.packing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "data/chat/train.jsonl"))
    ap.add_argument("--format", default="chat")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--max-length", type=int, default=1024, help="packed row length (and truncation)")
    ap.add_argument("--batch-size", type=int, default=8, help="examples per padded batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode and repeat (plus one warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="round-robin repeats; the median is reported")
    ap.add_argument("--precision", default="auto", choices=["auto", "no", "bf16"])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")

    recipe = parse_recipe(
        {
            "output_dir": "/tmp/unused",
            "precision": args.precision,
            "model": {"name_or_path": args.model},
            "data": {"train": args.data, "format": args.format, "max_length": args.max_length},
            "method": {"type": "lora", "lora": {"dropout": 0.0}},
        }
    )
    tok = load_tokenizer(ModelSection(name_or_path=args.model))
    examples, _ = build_datasets(recipe, tok)
    lens = sorted(len(x) for x in examples["input_ids"])
    q = lambda p: lens[int(p * (len(lens) - 1))]  # noqa: E731
    print(
        f"{args.data}: {len(lens)} examples, {sum(lens)} tokens, length {lens[0]}..{lens[-1]} "
        f"(10/50/90%: {q(0.1)}/{q(0.5)}/{q(0.9)}, mean {sum(lens) / len(lens):.0f})"
    )
    print("packing efficiency (real tokens / token slots, best-fit decreasing):")
    eff = efficiency_table(examples)
    for n, rows, e in eff:
        print(f"  max_length {n:>5}: {rows:>5} rows  {100 * e:5.1f}%")

    packed = pack_dataset(examples, args.max_length)
    batches, rows_per_step = make_batches(examples, packed, args, tok.pad_token_id)

    from transformers import AutoModelForCausalLM

    from training.model.adapters import add_lora
    from training.run.sources import pretrained_source

    base = AutoModelForCausalLM.from_pretrained(
        pretrained_source(args.model), dtype=torch.float32, attn_implementation="sdpa"
    )
    model = add_lora(base, recipe)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    print(
        f"\nthroughput: {args.model} + LoRA r=16 all-linear, precision {recipe.precision}, "
        f"{args.steps} timed steps of {args.batch_size} examples "
        f"(padded) or {rows_per_step} row(s) of {args.max_length} (packed), median of {args.repeats} "
        f"round-robin repeats; {machine()}"
    )
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for m in modes:
            base.set_attn_implementation(VARLEN_SDPA if m == "packed-varlen" else "sdpa")
            n_tok, secs = run_steps(model, optimizer, batches[m], recipe.precision)
            runs[m].append(n_tok / secs)
            shape = tuple(batches[m][-1]["input_ids"].shape)
            print(
                f"  repeat {r + 1} {m:<14} {n_tok / secs:7.1f} real tokens/s  (last batch {shape})",
                flush=True,
            )
    speed = {m: statistics.median(v) for m, v in runs.items()}
    slots = {m: sum(b["input_ids"].numel() for b in batches[m][1:]) for m in modes}
    real = {m: sum(int(real_tokens(b)) for b in batches[m][1:]) for m in modes}
    print()
    print(
        table(
            ["mode", "real tokens/s (median)", "runs", "real / computed tokens"],
            [
                [m, round(speed[m], 1), " ".join(f"{v:.0f}" for v in runs[m]), f"{real[m] / slots[m]:.2f}"]
                for m in modes
            ],
        )
    )
    ref = speed.get("padded-dyn")
    if ref and "packed-varlen" in speed:
        print(f"\npacked-varlen vs padded-dyn: {speed['packed-varlen'] / ref:.2f}x (target >= 1.2x)")
    result = {
        "data": args.data,
        "precision": recipe.precision,
        "max_length": args.max_length,
        "tokens_per_s": speed,
        "runs": runs,
        "efficiency": {n: e for n, _, e in eff},
    }
    print(f"results: {save_result('packing', result)}")
    return result


if __name__ == "__main__":
    main()
