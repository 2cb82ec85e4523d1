"""Our training loop vs a plain transformers Trainer, side by side in one run, on CPU.

Same model (the bundled SmolLM2-135M-Instruct with LoRA r16 on all linear layers), same tokenized
data (the bundled date task), same batches in the same order, same padding (pad to the longest in
the batch), same batch size, optimizer and fp32 precision. Reported: real (non-padding) tokens per
second over the steps after a warm-up. A third row runs our loop with `data.packing: true`.

    python -m benchmarks.vs_trainer [--steps N]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import (
    ROOT,
    TOKENIZER,
    read_rows,
    save_result,
    steady_tokens_per_s,
    table,
    tempdir,
    train_inprocess,
    write_recipe,
)

WARMUP = 2


def recipe_dict(run_dir, steps: int, packing: bool = False) -> dict:
    return {
        "output_dir": str(run_dir),
        "seed": 0,
        "resume": "none",
        "model": {"name_or_path": TOKENIZER, "attn_implementation": "sdpa"},
        "data": {
            "train": str(ROOT / "data/dates/train.jsonl"),
            "format": "chat",
            "max_length": 128,
            "packing": packing,
        },
        "method": {
            "type": "lora",
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        },
        "train": {
            "lr": 1e-4,
            "scheduler": "constant",
            "batch_size": 8,
            "max_steps": steps,
            "max_grad_norm": 1.0,
        },
        "eval": {"at_start": False},
    }


def ours(folder, steps: int, packing: bool) -> float:
    name = "packed" if packing else "padded"
    path = write_recipe(recipe_dict(folder / name, steps, packing), folder, f"{name}.yaml")
    assert train_inprocess(path) == 0
    return steady_tokens_per_s(read_rows(folder / name), WARMUP)


def trainer(folder, steps: int) -> float:
    """transformers.Trainer on the same model, batches (same sampler and collator) and optimizer."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from training.config import parse_recipe
    from training.data import build_datasets
    from training.data.loader import Collator, EpochSampler
    from training.models import build_model, load_tokenizer

    recipe = parse_recipe(recipe_dict(folder / "trainer", steps))
    tok = load_tokenizer(recipe.model)
    train_ds, _ = build_datasets(recipe, tok)
    torch.manual_seed(0)
    model = build_model(recipe, tok, torch.device("cpu"))
    order = list(EpochSampler(len(train_ds), recipe.seed))
    b = recipe.train.batch_size
    tokens = [sum(len(train_ds[i]["input_ids"]) for i in order[s * b : (s + 1) * b]) for s in range(steps)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    class SameOrderTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return EpochSampler(len(train_ds), recipe.seed)

    clock = Clock()
    args = TrainingArguments(
        output_dir=str(folder / "trainer"),
        per_device_train_batch_size=b,
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
        dataloader_drop_last=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=0,
    )
    SameOrderTrainer(
        model=model,
        args=args,
        train_dataset=train_ds.with_format(None),
        data_collator=Collator(tok.pad_token_id),
        callbacks=[clock],
    ).train()
    seconds = clock.ends[-1] - clock.ends[WARMUP - 1]
    return sum(tokens[WARMUP:]) / seconds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vs_trainer")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    folder = tempdir("vs-trainer")
    base = trainer(folder, args.steps)
    padded = ours(folder, args.steps, packing=False)
    packed = ours(folder, args.steps, packing=True)
    rows = [
        ["transformers Trainer (padded)", base, 1.0],
        ["llm-forge loop (padded)", padded, padded / base],
        ["llm-forge loop (data.packing: true)", packed, packed / base],
    ]
    print(
        f"## Our loop vs transformers Trainer: SmolLM2-135M LoRA r16, batch 8, max_length 128, fp32, CPU, "
        f"{args.steps} steps ({WARMUP} warm-up)\n"
    )
    print(table(["run", "real tokens/s", "vs Trainer"], [[n, round(v, 1), round(x, 2)] for n, v, x in rows]))
    result = {
        "steps": args.steps,
        "warmup": WARMUP,
        "trainer_tokens_per_s": base,
        "ours_tokens_per_s": padded,
        "ours_packed_tokens_per_s": packed,
        "speedup_padded": padded / base,
        "speedup_packed": packed / base,
    }
    print(f"\nresults: {save_result('vs_trainer', result)}")
    return result


if __name__ == "__main__":
    main()
