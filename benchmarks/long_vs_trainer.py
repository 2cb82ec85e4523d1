"""Long sequences on the CPU: our loop vs transformers' Trainer and TRL's SFTTrainer, each at its long-context best.

One chat example, built here from data/tiny_stories.txt (no network): a short user turn asking for stories and an
assistant reply of stories long enough that the rendered chat passes `max_length` by a few tokens, so it is
truncated to exactly `max_length` tokens (checked: the table's "tokens" column). Every side trains the bundled
SmolLM2-135M-Instruct with LoRA r16 alpha 32 on all linear layers, no dropout, batch 1, AdamW lr 1e-4 constant,
clipping 1.0, gradient checkpointing (non-reentrant) on, for `--steps` optimizer steps, each in a fresh process.
All sides train on the same tokens and the same loss tokens: the assistant reply as our chat tokenization labels
it (the Trainer and SFTTrainer get our `labels` column; SFTTrainer keeps a given `labels` as it is). Past
SmolLM2's 8192 positions every side gets the same RoPE scaling (`model.rope_scaling`: yarn, factor
max_length / 8192), as the model is built by our `build_model` on every side.

Sides (`--sides`, default all):
  ours          llm-forge: precision auto, model.gradient_checkpointing: true, train.loss_impl auto (the loss
                from the output head in chunks, no [tokens x vocab] logits)
  trainer-best  transformers.Trainer: activation_checkpointing=True (5.24's name for gradient_checkpointing;
                use_reentrant False; checked on the model after training), bf16=True only where the CPU
                multiplies bf16 natively (as `precision: auto` decides), our Collator; the model's own loss from
                full logits (the Trainer has no chunked loss; its checkpointing `offload` is for accelerators)
  trl-best      TRL's SFTTrainer with trainer-best's settings and max_length; its fused LM head (always on:
                log-probs in tiles, no full logits) and its own collator. Not used: padding_free (documented
                for FlashAttention only, and with batch 1 there is no padding to remove), packing (one
                example), activation_offloading (offloads accelerator activations to the CPU; on a CPU-only
                torch it has no accelerator to read and fails), use_liger_kernel (Triton, CUDA)

Reported per side and length: seconds of each optimizer step (step 1 includes warm-up: first-call
allocations, autocast caches), and the process's peak RSS (ru_maxrss, model load included).

    python -m benchmarks.long_vs_trainer [--lengths 8192,16384] [--steps 2] [--sides ours,trl-best]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    ROOT,
    TOKENIZER,
    machine,
    read_rows,
    save_result,
    table,
    tempdir,
    train_inprocess,
    write_recipe,
)
from benchmarks.vs_trainer import _resolved, recipe_dict, trainer_settings

SIDES = ("ours", "trainer-best", "trl-best")
CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings: longer runs scale RoPE
STORIES = ROOT / "data" / "tiny_stories.txt"
USER = "Tell me some short stories, one after another."


def long_messages(tok, length: int) -> list[dict]:
    """A user turn and an assistant reply of the first `length` tokens of the bundled stories (repeated
    if need be): with the chat template's tokens the example is a little longer than `length`."""
    text = STORIES.read_text()
    while len(tok(text, add_special_tokens=False)["input_ids"]) < length:
        text += "\n" + STORIES.read_text()
    ends = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [{"role": "user", "content": USER}, {"role": "assistant", "content": text[: ends[length - 1][1]]}]


def write_example(folder: Path, length: int) -> Path:
    from training.config import ModelSection
    from training.data.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    path = folder / f"long-{length}.jsonl"
    path.write_text(json.dumps({"messages": long_messages(tok, length)}) + "\n")
    return path


def long_recipe(run_dir: Path, steps: int, length: int, data: Path, checkpointing: bool = True) -> dict:
    raw = recipe_dict(run_dir, steps, "ours", str(data))
    raw["data"]["max_length"] = length
    raw["train"]["batch_size"] = 1
    raw["model"]["gradient_checkpointing"] = checkpointing
    if length > CONTEXT:
        raw["model"]["rope_scaling"] = {"type": "yarn", "factor": length / CONTEXT}
    return raw


def ours(folder: Path, steps: int, length: int, data: Path) -> dict:
    path = write_recipe(long_recipe(folder / "ours", steps, length, data), folder, "ours.yaml")
    assert train_inprocess(path) == 0
    rows = read_rows(folder / "ours")
    return {
        "step_s": [r["tokens"] / r["tokens_per_s"] for r in rows],
        "tokens": rows[0]["tokens"],
        "precision": _resolved(folder / "ours"),
    }


def prepared(folder: Path, side: str, steps: int, length: int, data: Path):
    """The recipe (precision off: the Trainer's bf16 flag decides), tokenizer, tokenized example and the model
    (our build_model: LoRA, RoPE scaling) for a Trainer side; gradient checkpointing is left to the Trainer."""
    from training.config import parse_recipe
    from training.data import build_datasets
    from training.data.tokenizer import load_tokenizer
    from training.model.build import build_model

    raw = long_recipe(folder / side, steps, length, data, checkpointing=False)
    recipe = parse_recipe({**raw, "precision": "no"})
    tok = load_tokenizer(recipe.model)
    train_ds, _ = build_datasets(recipe, tok)
    torch.manual_seed(0)
    return recipe, tok, train_ds.with_format(None), build_model(recipe, tok, torch.device("cpu"))


def trainer(folder: Path, steps: int, length: int, data: Path, side: str) -> dict:
    """transformers.Trainer (trainer-best) or TRL's SFTTrainer (trl-best) on the same model and example."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from training.core.machine import cpu_has_native_bf16
    from training.data.loader import Collator

    _, tok, train_ds, model = prepared(folder, side, steps, length, data)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    bf16 = cpu_has_native_bf16()
    settings = trainer_settings(
        folder / side,
        steps,
        bf16,
        per_device_train_batch_size=1,
        activation_checkpointing=True,  # transformers 5.24's name for gradient_checkpointing
        activation_checkpointing_kwargs={"use_reentrant": False},
    )
    if side == "trl-best":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**settings, max_length=length, dataset_num_proc=1)
        rows = train_ds.select_columns(["input_ids", "labels"])  # our labels: the assistant reply
        run = SFTTrainer(
            model=model, args=config, train_dataset=rows, processing_class=tok, callbacks=[Clock()]
        )
    else:
        args = TrainingArguments(**settings, remove_unused_columns=False)
        collator = Collator(tok.pad_token_id)
        run = Trainer(
            model=model, args=args, train_dataset=train_ds, data_collator=collator, callbacks=[Clock()]
        )
    run.train()
    return {
        "step_s": [b - a for a, b in zip(times, times[1:])],
        "tokens": len(train_ds[0]["input_ids"]),
        "precision": "bf16" if bf16 else "no",
        "checkpointing": model.get_base_model().is_activation_checkpointing,  # set by the Trainer
    }


def one_side(side: str, length: int, steps: int) -> dict:
    folder = tempdir(f"long-vs-trainer-{side}-{length}")
    data = write_example(folder, length)
    if side == "ours":
        result = ours(folder, steps, length, data)
    else:
        result = trainer(folder, steps, length, data, side)
    result["loss_tokens"] = loss_tokens(folder, steps, length, data)
    return {**result, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def loss_tokens(folder: Path, steps: int, length: int, data: Path) -> int:
    """Labelled tokens of the tokenized example (our tokenization, from the cache: every side's labels)."""
    from training.config import parse_recipe
    from training.data import build_datasets
    from training.data.tokenizer import load_tokenizer

    recipe = parse_recipe(long_recipe(folder / "count", steps, length, data))
    train_ds, _ = build_datasets(recipe, load_tokenizer(recipe.model))
    return sum(1 for t in train_ds.with_format(None)[0]["labels"] if t != -100)


def run_side(side: str, length: int, steps: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.long_vs_trainer", "--side", side]
    cmd += ["--lengths", str(length), "--steps", str(steps)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{side} at {length} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.long_vs_trainer", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--lengths", default="8192,16384", help="comma-separated max_length values")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process, print JSON
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.side:
        print("RESULT " + json.dumps(one_side(args.side, lengths[0], args.steps)), flush=True)
        return {}
    runs: dict[str, dict[str, dict]] = {}
    for length in lengths:
        for side in args.sides.split(","):
            result = run_side(side, length, args.steps)
            if result["tokens"] != length or result.get("checkpointing") is False:
                raise RuntimeError(
                    f"{side} at {length}: {result['tokens']} tokens, or no checkpointing: {result}"
                )
            runs.setdefault(str(length), {})[side] = result
            print(f"  {length} {side:<13} {result}", flush=True)
    report(runs, args.steps)
    return {"steps": args.steps, "runs": runs}


def report(runs: dict[str, dict[str, dict]], steps: int) -> None:
    print(
        f"\n## Long sequences: SmolLM2-135M LoRA r16 all-linear, one chat example, batch 1, gradient checkpointing, "
        f"{steps} steps (step 1 includes warm-up), {machine()}\n"
    )
    rows = [
        [
            int(length),
            side,
            r["precision"],
            r["tokens"],
            r["loss_tokens"],
            " ".join(f"{s:.1f}" for s in r["step_s"]),
            round(r["peak_rss_gib"], 2),
        ]
        for length, sides in runs.items()
        for side, r in sides.items()
    ]
    print(
        table(
            ["max_length", "side", "precision", "tokens", "loss tokens", "s per step", "peak RSS GiB"], rows
        )
    )
    print(f"\nresults: {save_result('long_vs_trainer', {'steps': steps, 'runs': runs})}")


if __name__ == "__main__":
    main()
