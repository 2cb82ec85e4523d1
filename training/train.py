"""Train a causal LM from one recipe.

    python -m training.train RECIPE.yaml [dotted.key=value ...]
    accelerate launch [--config_file accelerate_configs/<backend>.yaml] -m training.train RECIPE.yaml

recipe -> accelerator -> tokenizer + data -> model -> optimizer/scheduler -> prepare -> resume -> loop
-> checkpoints + metrics.jsonl -> final/ + loss.png. The loop below is the whole trainer.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from training.checkpoint import is_checkpoint, latest_checkpoint, load_checkpoint, save_checkpoint, write_atomic
from training.config import Recipe, TrainSection, dump_recipe, load_recipe
from training.data import IGNORE, build_datasets, make_loader
from training.packing import real_tokens
from training.distributed import (
    build_accelerator,
    check_compatibility,
    mask_repeated_rows,
    model_init_context,
    no_zero3_init,
    share_tied_tensors,
)
from training import faults
from training.errors import RecipeError, UserError, cli
from training.metrics import MetricsWriter, peak_memory_gb, plot_loss
from training.models import build_model, count_parameters, load_tokenizer
from training.optim import build_optimizer
from training.preflight import check_disk_space
from training.speed import check_speed_options, mfu_postfix, speed_report

log = logging.getLogger("training")


class TrainingAborted(RuntimeError):
    """A runtime failure after which the last good checkpoint is kept (exit code 3)."""


# ----------------------------------------------------------------------------- builders


def build_scheduler(optimizer, t: TrainSection, total_steps: int):
    warmup = t.warmup_steps or int(t.warmup_ratio * total_steps)
    name = "constant_with_warmup" if t.scheduler == "constant" else t.scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


# ----------------------------------------------------------------------------- pieces of the loop


def token_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over labelled tokens, and how many there were."""
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    shift_labels = labels[:, 1:]
    loss_sum = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), shift_labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss_sum, (shift_labels != IGNORE).sum()


@torch.no_grad()
def evaluate(model, loader, accelerator: Accelerator, max_batches: int | None) -> float:
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        s, n = token_loss(model, mask_repeated_rows(batch, accelerator))  # no double-counted samples
        total += torch.stack([s.double(), n.double()])
    model.train()
    total = accelerator.reduce(total, "sum")
    return (total[0] / total[1].clamp(min=1)).item()


def batch_stream(loader, accelerator: Accelerator, start: int):
    """Endless micro-batches across epochs, starting at global micro-batch `start` (for resume)."""
    epoch, skip = divmod(start, len(loader))
    while True:
        it = accelerator.skip_first_batches(loader, skip) if skip else loader
        it.set_epoch(epoch)
        yield from it
        epoch, skip = epoch + 1, 0


class GracefulStop:
    """SIGTERM/SIGINT ask the loop to finish the current step, save a checkpoint and exit 0."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = True


def export_final(accelerator: Accelerator, model, tokenizer, run_dir: Path) -> Path:
    """save_pretrained output (full model or adapter) + tokenizer, written atomically to final/."""
    state_dict = accelerator.get_state_dict(model)  # collective: gathers FSDP/ZeRO-3 shards
    state_dict = share_tied_tensors(state_dict, accelerator.unwrap_model(model))
    final, tmp = run_dir / "final", run_dir / ".tmp-final"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        base = getattr(unwrapped, "base_model", unwrapped)
        getattr(base, "config", unwrapped.config).use_cache = True
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def find_resume(recipe: Recipe, run_dir: Path) -> Path | None:
    if recipe.resume == "none":
        return None
    if recipe.resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(recipe.resume)
    if not is_checkpoint(path):
        raise RecipeError(f"resume: {path} is not a complete checkpoint (expected a checkpoints/step-N directory)")
    return path


def prepare_run_dir(run_dir: Path, recipe: Recipe) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RecipeError(f"output_dir: cannot write to {run_dir} ({e.strerror})") from None
    write_atomic(run_dir / "config.yaml", dump_recipe(recipe))


def write_status(run_dir: Path, **fields) -> None:
    write_atomic(run_dir / "status.json", json.dumps({"pid": os.getpid(), "time": time.time(), **fields}))


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.lr=1e-4")
    return ap.parse_args(argv)


def setup_logging(accelerator: Accelerator) -> None:
    import transformers

    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
    transformers.logging.set_verbosity_error()


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    run_dir = Path(recipe.output_dir)
    accelerator = build_accelerator(recipe)
    setup_logging(accelerator)
    check_compatibility(recipe, accelerator)
    check_speed_options(recipe, accelerator.device)
    if accelerator.is_main_process:
        prepare_run_dir(run_dir, recipe)
    accelerator.wait_for_everyone()
    set_seed(recipe.seed)

    tokenizer = load_tokenizer(recipe.model)
    with accelerator.main_process_first():
        train_ds, eval_ds = build_datasets(recipe, tokenizer)
    with no_zero3_init():  # its meta-device model must not be built inside deepspeed.zero.Init
        check_disk_space(recipe, run_dir, tokenizer)  # fail now, not at the first save
    with model_init_context(recipe):  # same initial weights under every backend
        model = build_model(recipe, tokenizer, accelerator.device)
    trainable, total = count_parameters(model)
    log.info("model: %.1fM parameters, %.2fM trainable (%s)", total / 1e6, trainable / 1e6, recipe.method.type)
    speed = speed_report(model, recipe, accelerator)  # attention impl., compile, FLOPs/token, device peak
    run_info = speed.as_row()  # written once, into the first metrics row of this run
    optimizer = build_optimizer(model, recipe.train, accelerator.device)
    t = recipe.train
    flat = model.config._attn_implementation == "flash_attention_2"  # packed rows go padding-free (varlen)
    train_dl = make_loader(train_ds, t.batch_size, tokenizer, recipe.seed, shuffle=True, padding_free=flat)
    eval_dl = make_loader(eval_ds, recipe.eval.batch_size or t.batch_size, tokenizer, recipe.seed, shuffle=False, padding_free=flat) if eval_ds else None
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
    if len(train_dl) == 0:
        raise UserError(
            f"data.train: {len(train_ds)} examples give no full batch of train.batch_size={t.batch_size} "
            f"x {accelerator.num_processes} processes; lower the batch size or add data"
        )
    total_steps = t.max_steps or max(1, int(t.epochs * len(train_dl)) // t.grad_accum)
    scheduler = build_scheduler(optimizer, t, total_steps)
    accelerator.register_for_checkpointing(scheduler)

    step, skipped = 0, 0
    ckpt = find_resume(recipe, run_dir)
    if ckpt is not None:
        state = load_checkpoint(accelerator, ckpt)
        step, skipped = state["step"], state.get("skipped_steps", 0)
        log.info("resumed from %s at step %d", ckpt, step)
    metrics = MetricsWriter(run_dir / "metrics.jsonl", resume_step=step if ckpt else None, enabled=accelerator.is_main_process)
    log.info(
        "training %d steps: %d examples, global batch %d x %d accumulation, %d process(es), %s",
        total_steps, len(train_ds), t.batch_size * accelerator.num_processes, t.grad_accum,
        accelerator.num_processes, accelerator.distributed_type.value,
    )
    if accelerator.is_main_process:
        write_status(run_dir, state="running", step=step, total_steps=total_steps)

    stop = GracefulStop()
    batches = batch_stream(train_dl, accelerator, step * t.grad_accum)
    world_scale = accelerator.num_processes * t.grad_accum
    bar = tqdm(total=total_steps, initial=step, disable=not accelerator.is_main_process, dynamic_ncols=True, desc="train")
    start_time = last_time = time.time()
    model.train()

    def save(step: int) -> None:
        save_checkpoint(accelerator, run_dir, step, {"step": step, "skipped_steps": skipped, "total_steps": total_steps}, recipe.checkpoint.keep_last)

    def run_eval(step: int) -> None:
        eval_loss = evaluate(model, eval_dl, accelerator, recipe.eval.max_batches)
        ppl = math.exp(min(eval_loss, 50))
        metrics.write({"step": step, "eval_loss": eval_loss, "eval_ppl": ppl})
        log.info("step %d: eval loss %.4f (perplexity %.2f)", step, eval_loss, ppl)

    if eval_dl is not None and recipe.eval.at_start and step == 0:
        run_eval(0)

    while step < total_steps:
        # One optimizer step = grad_accum micro-batches. The loss is normalised by the number of
        # labelled tokens in the whole global window, so every backend and batch split agrees.
        window = [next(batches) for _ in range(t.grad_accum)]
        counts = torch.stack([sum(b["labels"][:, 1:].ne(IGNORE).sum() for b in window), sum(real_tokens(b) for b in window)])
        n_labels, n_tokens = accelerator.reduce(counts.to(accelerator.device), "sum").tolist()
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in window:
            with accelerator.accumulate(model):
                s, _ = token_loss(model, batch)
                s = faults.corrupt("loss", step + 1, s)
                accelerator.backward(s * world_scale / max(n_labels, 1))
                loss_sum += s.detach()
            faults.point("mid_step", step + 1)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"))
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        reduced = accelerator.reduce(torch.stack([loss_sum.float(), torch.tensor(float(stop.requested), device=accelerator.device)]), "sum")
        loss, stop_requested = reduced[0].item() / max(n_labels, 1), reduced[1].item() > 0

        if not (math.isfinite(loss) and (math.isfinite(grad_norm) or accelerator.distributed_type == DistributedType.DEEPSPEED)):
            if t.on_nonfinite == "stop":
                optimizer.zero_grad(set_to_none=True)
                raise TrainingAborted(
                    f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step + 1}; "
                    f"the last good checkpoint is kept (train.on_nonfinite=skip would skip such steps)"
                )
            skipped += 1
            log.warning("step %d: non-finite loss/grad norm, step skipped (%d so far)", step + 1, skipped)
        else:
            optimizer.step()
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)

        if step % t.log_every == 0 or step == total_steps:
            now = time.time()
            row = {
                "step": step, "total_steps": total_steps, "loss": loss, "lr": scheduler.get_last_lr()[0],
                "grad_norm": grad_norm, "tokens": int(n_tokens), "tokens_per_s": n_tokens / max(now - last_time, 1e-9),
                "elapsed_s": now - start_time, "peak_mem_gb": peak_memory_gb(accelerator.device), "skipped_steps": skipped,
            }
            row["mfu"] = speed.mfu(row["tokens_per_s"])  # None on CPU / unknown GPU
            metrics.write({**row, **run_info})
            run_info = {}
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", **mfu_postfix(row["mfu"]))

        if eval_dl is not None and recipe.eval.every_steps and step % recipe.eval.every_steps == 0 and step < total_steps:
            run_eval(step)
        if recipe.checkpoint.every_steps and step % recipe.checkpoint.every_steps == 0 and step < total_steps:
            save(step)
        if stop_requested and step < total_steps:
            save(step)
            bar.close()
            if accelerator.is_main_process:
                write_status(run_dir, state="stopped", step=step, total_steps=total_steps)
                print(f"stopped at step {step}; checkpoint saved. Resume with the same command (resume: auto).", flush=True)
            return 0
        last_time = time.time()
    bar.close()

    if eval_dl is not None:
        run_eval(step)
    if recipe.checkpoint.every_steps:
        save(step)
    final = export_final(accelerator, model, tokenizer, run_dir)
    if accelerator.is_main_process:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
        write_status(run_dir, state="finished", step=step, total_steps=total_steps)
        log.info("done: %s (metrics %s, plot %s)", final, run_dir / "metrics.jsonl", run_dir / "loss.png")
    accelerator.end_training()
    return 0


def entry() -> None:
    try:
        code = main()
    except TrainingAborted as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 3
    sys.exit(code)


if __name__ == "__main__":
    entry()
