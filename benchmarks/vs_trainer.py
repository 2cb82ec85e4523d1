"""Our training loop vs transformers' Trainer, each at its best documented CPU settings, same work.

Same model (the bundled SmolLM2-135M-Instruct + LoRA r16 alpha 32 on all linear layers, no dropout), same
tokenized data (data/chat: realistic lengths, 44-1024 tokens), AdamW lr 1e-4 constant, clipping 1.0,
the same number of optimizer steps. Each side runs in a fresh process, the sides round-robin (A, B, C,
A, B, C, ...) `--repeats` times, and the median is reported, with the process's peak RSS. Real tokens/s:
non-padding tokens over wall time of the steps after the first WARMUP ones.

Sides (`--sides`, default all):
  trainer         Trainer defaults: fp32, random order, 8 examples padded to the longest
  trainer-best    + the CPU options its docs offer that help here: bf16=True (autocast),
                  train_sampling_strategy="group_by_length"
  trainer-compile trainer-best + torch_compile=True
  trl-best        TRL's SFTTrainer with trainer-best's settings, on the same tokenized rows (its own
                  collator: padded to the longest)
  trl-packed      SFTTrainer's own packing: packing=True, packing_strategy="bfd", max_length 1024, 2 rows per
                  step flattened padding-free (transformers' SDPA masks each document from position_ids)
  ours            llm-forge defaults (precision: auto, train.group_by_length: auto, which groups these
                  spread-out lengths; padded)
  ours-random     + train.group_by_length: false (random order: the defaults before auto grouping)
  ours-grouped    + train.group_by_length: true (8 examples per step, exactly the Trainer's work)
  ours-packed     data.packing: true, rows of 1024 flattened padding-free with sdpa_varlen; batch_size 8
                  counts examples (data.packed_batch's default): 2 rows per step, about 7 examples
  ours-*-compile  any ours side + train.torch_compile: true (inductor); the result counts dynamo's
                  compiled graphs, recompilations and graph breaks

    python -m benchmarks.vs_trainer [--steps 12] [--repeats 2] [--sides trainer-best,ours-packed]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.common import (
    ROOT,
    TOKENIZER,
    machine,
    read_rows,
    save_result,
    steady_tokens_per_s,
    table,
    tempdir,
    train_inprocess,
    write_recipe,
)

WARMUP = 2
SIDES = (
    "trainer",
    "trainer-best",
    "trainer-compile",
    "trl-best",
    "trl-packed",
    "ours",
    "ours-random",
    "ours-grouped",
    "ours-packed",
    "ours-compile",
    "ours-grouped-compile",
    "ours-packed-compile",
)
DEFAULT_SIDES = ("trainer", "trainer-best", "ours", "ours-grouped", "ours-packed")


def recipe_dict(run_dir, steps: int, side: str = "ours", data: str = "data/chat/train.jsonl") -> dict:
    compiled = side.endswith("-compile")
    side = side.removesuffix("-compile")
    packed = side == "ours-packed"
    return {
        "output_dir": str(run_dir),
        "seed": 0,
        "resume": "none",
        "precision": "auto",
        "model": {"name_or_path": TOKENIZER, "attn_implementation": "sdpa"},
        "data": {"train": str(ROOT / data), "format": "chat", "max_length": 1024, "packing": packed},
        "method": {
            "type": "lora",
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        },
        "train": {
            "lr": 1e-4,
            "scheduler": "constant",
            "batch_size": 8,  # packed: counted in examples, 2 rows of these lengths
            "max_steps": steps,
            "max_grad_norm": 1.0,
            "group_by_length": {"ours-grouped": True, "ours-random": False}.get(side, "auto"),
            "torch_compile": compiled,
        },
        "eval": {"at_start": False},
    }


def ours(folder, steps: int, side: str, data: str) -> dict:
    path = write_recipe(recipe_dict(folder / side, steps, side, data), folder, f"{side}.yaml")
    assert train_inprocess(path) == 0
    rows = read_rows(folder / side)
    result = {"tokens_per_s": steady_tokens_per_s(rows, WARMUP), "precision": _resolved(folder / side)}
    mfus = [r["mfu"] for r in rows[WARMUP:] if r.get("mfu") is not None]
    result["mfu"] = statistics.median(mfus) if mfus else None  # against the measured matmul ceiling
    if side.endswith("-compile"):
        from torch._dynamo.utils import counters

        result["compile"] = {
            "graphs": counters["stats"].get("unique_graphs", 0),
            "recompiles": sum(counters["recompiles"].values()),
            "graph_breaks": sum(counters["graph_break"].values()),
            "first_step_s": round(rows[0]["tokens"] / rows[0]["tokens_per_s"], 1),  # compilation included
        }
    return result


def _resolved(run_dir) -> str:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["precision"]


def trainer(folder, steps: int, side: str, data: str) -> dict:
    """transformers.Trainer, or TRL's SFTTrainer (trl-* sides), on the same model, tokenized data and
    optimizer. "Best" is bf16 autocast only where the CPU multiplies bf16 natively (as `precision: auto`
    decides: elsewhere bf16 is ~100x slower than fp32), and length-grouped batches."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from training.config import parse_recipe
    from training.core.batch import real_tokens
    from training.core.machine import cpu_has_native_bf16
    from training.data import build_datasets
    from training.data.loader import Collator
    from training.data.tokenizer import load_tokenizer
    from training.model.build import build_model

    recipe = parse_recipe({**recipe_dict(folder / side, steps, "ours", data), "precision": "no"})
    tok = load_tokenizer(recipe.model)
    train_ds, _ = build_datasets(recipe, tok)
    torch.manual_seed(0)
    model = build_model(recipe, tok, torch.device("cpu"))
    tokens: list[int] = []

    def counting(collator):  # the side's collator, counting each batch's real tokens (padded or flattened)
        def collate(rows):
            batch = collator(rows)
            tokens.append(int(real_tokens(batch)))
            return batch

        return collate

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    best = side != "trainer"
    bf16 = best and cpu_has_native_bf16()
    packed = side == "trl-packed"
    clock = Clock()
    settings = trainer_settings(
        folder / side,
        steps,
        bf16,
        per_device_train_batch_size=2 if packed else 8,
        dataloader_drop_last=True,
        train_sampling_strategy="group_by_length" if best and not packed else "random",
        torch_compile=side == "trainer-compile",
    )
    if side.startswith("trl"):
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(
            **settings, max_length=1024, packing=packed, packing_strategy="bfd", dataset_num_proc=1
        )
        run = SFTTrainer(
            model=model,
            args=config,
            train_dataset=train_ds.with_format(None).select_columns(["input_ids"]),  # loss on every token
            processing_class=tok,
            callbacks=[clock],
        )
        run.data_collator = counting(run.data_collator)  # SFTTrainer's own
    else:
        args = TrainingArguments(**settings, remove_unused_columns=False)
        run = Trainer(
            model=model,
            args=args,
            train_dataset=train_ds.with_format(None),
            data_collator=counting(Collator(tok.pad_token_id)),  # ours: padded to the longest
            callbacks=[clock],
        )
    run.train()
    seconds = clock.ends[-1] - clock.ends[WARMUP - 1]
    return {"tokens_per_s": sum(tokens[WARMUP:steps]) / seconds, "precision": "bf16" if bf16 else "no"}


def trainer_settings(out, steps: int, bf16: bool, **side) -> dict:
    """The TrainingArguments every Trainer side shares (our recipe's optimizer and schedule, CPU, no logging
    or saving), with the side's own."""
    return dict(
        output_dir=str(out),
        max_steps=steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        bf16=bf16,
        **side,
    )


def one_side(side: str, steps: int, data: str) -> dict:
    folder = tempdir(f"vs-trainer-{side}")
    result = (ours if side.startswith("ours") else trainer)(folder, steps, side, data)
    return {**result, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vs_trainer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--sides", default=",".join(DEFAULT_SIDES), help=f"comma-separated, of {', '.join(SIDES)}"
    )
    ap.add_argument("--data", default="data/chat/train.jsonl")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process, print JSON
    args = ap.parse_args(argv)
    if args.side:
        print("RESULT " + json.dumps(one_side(args.side, args.steps, args.data)), flush=True)
        return {}
    sides = args.sides.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.repeats):
        for side in sides:
            cmd = [sys.executable, "-m", "benchmarks.vs_trainer", "--side", side, "--steps", str(args.steps)]
            out = subprocess.run(
                [*cmd, "--data", args.data], cwd=ROOT, capture_output=True, text=True, check=False
            )
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                raise RuntimeError(f"{side} failed:\n{out.stderr[-3000:]}")
            runs[side].append(json.loads(lines[-1][7:]))
            print(f"  repeat {r + 1} {side:<16} {runs[side][-1]}", flush=True)
    med = {s: statistics.median(x["tokens_per_s"] for x in v) for s, v in runs.items()}
    mem = {s: max(x["peak_rss_gib"] for x in v) for s, v in runs.items()}
    base = med.get("trainer-best") or next(iter(med.values()))
    mfu = {s: statistics.median(x["mfu"] for x in v) for s, v in runs.items() if v[0].get("mfu") is not None}
    # the Trainer's sides do the same work per real token (same model, data, sequence lengths): their MFU
    # is ours scaled by tokens/s, from the ours side with the same batches (grouped) where it ran
    ref = next((s for s in ("ours-grouped", "ours", *mfu) if s in mfu), None)
    for s in sides:
        if ref and s not in mfu and not s.startswith("ours"):
            mfu[s] = mfu[ref] * med[s] / med[ref]
    print(
        f"\n## Our loop vs transformers Trainer: SmolLM2-135M LoRA r16 all-linear, {args.data}, {args.steps} steps "
        f"({WARMUP} warm-up), median of {args.repeats} round-robin repeats, {machine()}\n"
    )
    print(
        table(
            ["run", "precision", "real tokens/s", "vs Trainer best", "MFU", "peak RSS GiB", "runs"],
            [
                [
                    s,
                    runs[s][0]["precision"],
                    round(med[s], 1),
                    round(med[s] / base, 2),
                    f"{mfu[s]:.1%}" if s in mfu else "-",
                    round(mem[s], 2),
                    " ".join(f"{x['tokens_per_s']:.0f}" for x in runs[s]),
                ]
                for s in sides
            ],
        )
    )
    result = {"steps": args.steps, "warmup": WARMUP, "tokens_per_s": med, "mfu": mfu, "peak_rss_gib": mem}
    result["runs"] = runs
    ours_best = max(((v, s) for s, v in med.items() if s.startswith("ours")), default=None)
    if "trainer-best" in med and ours_best:
        result["speedup_best"] = ours_best[0] / med["trainer-best"]
        print(
            f"\nbest of ours ({ours_best[1]}) vs Trainer at its best: {result['speedup_best']:.2f}x (target >= 1.3x, "
            f"peak RSS {mem[ours_best[1]]:.2f} vs {mem['trainer-best']:.2f} GiB)"
        )
    if ours_best and ours_best[1] in mfu:
        print(
            f"best of ours ({ours_best[1]}): MFU {mfu[ours_best[1]]:.1%} of the measured ceiling (aim >= 85%)"
        )
    print(f"\nresults: {save_result('vs_trainer', result)}")
    return result


if __name__ == "__main__":
    main()
