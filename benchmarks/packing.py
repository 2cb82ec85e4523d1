"""Packing benchmark: packing efficiency and training throughput (real tokens/s), packed vs padded.

    python -m benchmarks.packing                       # bundled chat data (data/dates), SmolLM2-135M + LoRA, CPU
    python -m benchmarks.packing --max-length 1024 --batch-size 16 --steps 6

Prints figures; it is not a timed test. Three ways to batch the same examples, each run for the
same number of optimizer steps of about the same token slots per step (batch of `--batch-size`
examples vs rows of max_length):
  padded-max   every example padded to --padded-length (the classic fixed-shape batch; 128 = the demo's max_length)
  padded-dyn   padded to the longest example of each batch (what the trainer does without packing)
  packed       best-fit-decreasing packing into rows of max_length (data.packing: true)
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from training.config import ModelSection, parse_recipe
from training.data import IGNORE, build_datasets, pad_batch, real_tokens
from training.data.loader import Collator, PackedCollator
from training.data.packing import pack_dataset, packing_efficiency
from training.models import load_tokenizer


def padded_to_multiple(rows: list[dict], pad: int, multiple: int) -> dict:
    """Rows right-padded (with attention_mask) to the smallest multiple of `multiple` that holds the longest."""
    n = -(-max(len(r["input_ids"]) for r in rows) // multiple) * multiple
    rows = [{**r, "attention_mask": [1] * len(r["input_ids"])} for r in rows]
    return pad_batch(rows, {"input_ids": pad, "attention_mask": 0, "labels": IGNORE}, n)


def efficiency_table(examples, lengths=(128, 256, 512, 1024, 2048, 4096)) -> list[tuple[int, int, float]]:
    rows = []
    for n in lengths:
        fits = examples.select([i for i, ids in enumerate(examples["input_ids"]) if len(ids) <= n])
        packed = pack_dataset(fits, n)
        rows.append((n, len(packed), packing_efficiency(packed, n)))
    return rows


def throughput(model, optimizer, batches, label: str) -> float:
    """Real tokens/s over the batches (after one warm-up batch)."""
    from training.loss import token_loss

    model.train()
    n_tok, t0 = 0, None
    for i, batch in enumerate(batches):
        if i == 1:
            t0 = time.perf_counter()
        s, n, _ = token_loss(model, batch)
        (s / n.clamp(min=1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 1:
            n_tok += int(real_tokens(batch))
    secs = time.perf_counter() - t0
    shape = tuple(batches[-1]["input_ids"].shape)
    print(
        f"  {label:<11} {n_tok:>7} real tokens in {secs:6.1f} s = {n_tok / secs:7.1f} real tokens/s   (last batch {shape})"
    )
    return n_tok / secs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.packing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/dates/train.jsonl")
    ap.add_argument("--format", default="chat")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--max-length", type=int, default=512, help="packed row length")
    ap.add_argument(
        "--padded-length",
        type=int,
        default=128,
        help="padded-max pads to this (the demo recipe's max_length)",
    )
    ap.add_argument("--batch-size", type=int, default=8, help="examples per padded batch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (plus one warm-up)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    recipe = parse_recipe(
        {
            "output_dir": "/tmp/unused",
            "model": {"name_or_path": args.model},
            "data": {"train": args.data, "format": args.format, "max_length": args.max_length},
        }
    )
    tok = load_tokenizer(ModelSection(name_or_path=args.model))
    examples, _ = build_datasets(recipe, tok)
    lens = [len(x) for x in examples["input_ids"]]
    print(
        f"{args.data}: {len(lens)} examples, {sum(lens)} tokens, length {min(lens)}..{max(lens)} (mean {sum(lens) / len(lens):.1f})"
    )
    print("packing efficiency (real tokens / token slots, best-fit decreasing):")
    for n, rows, eff in efficiency_table(examples):
        print(f"  max_length {n:>5}: {rows:>5} rows  {100 * eff:5.1f}%")

    packed = pack_dataset(examples, args.max_length)
    rows_per_step = max(1, round(args.batch_size * sum(lens) / len(lens) / args.max_length))
    pad = tok.pad_token_id
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(examples), generator=g).tolist()
    porder = torch.randperm(len(packed), generator=g).tolist()
    k = args.steps + 1
    ex = [examples[order[i * args.batch_size : (i + 1) * args.batch_size]] for i in range(k)]
    ex = [[{"input_ids": a, "labels": b} for a, b in zip(e["input_ids"], e["labels"])] for e in ex]
    modes = {
        "padded-max": [padded_to_multiple(e, pad, args.padded_length) for e in ex],
        "padded-dyn": [Collator(pad)(e) for e in ex],
        "packed": [
            PackedCollator(pad)([packed[j] for j in porder[i * rows_per_step : (i + 1) * rows_per_step]])
            for i in range(k)
        ],
    }

    from transformers import AutoModelForCausalLM

    from training.methods import add_lora
    from training.models import pretrained_source

    model = AutoModelForCausalLM.from_pretrained(
        pretrained_source(args.model), dtype=torch.float32, attn_implementation="sdpa"
    )
    lora_recipe = parse_recipe(
        {
            "output_dir": "/tmp/unused",
            "model": {"name_or_path": args.model},
            "data": {"train": args.data},
            "method": {"type": "lora"},
        }
    )
    model = add_lora(model, lora_recipe)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    print(
        f"throughput: {args.model} + LoRA r=16, fp32, sdpa, {torch.get_num_threads()} CPU threads, "
        f"{args.steps} timed steps of {args.batch_size} examples (padded) or {rows_per_step} row(s) of {args.max_length} (packed)"
    )
    speed = {m: throughput(model, optimizer, b, m) for m, b in modes.items()}
    print(
        f"packed vs padded-max: {speed['packed'] / speed['padded-max']:.2f}x   "
        f"packed vs padded-dyn: {speed['packed'] / speed['padded-dyn']:.2f}x"
    )


if __name__ == "__main__":
    main()
