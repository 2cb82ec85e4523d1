"""The loop: step, log, evaluate, checkpoint, stop; then final/ and loss.png (litgpt's fit).

train(run)    fit(run); a lost peer -> one line, exit 3
fit(run)      batches -> train_step (training.loop.step) -> log_row / evaluate / save -> finish
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from accelerate import Accelerator
from tqdm.auto import tqdm

from training.core.errors import TrainingAborted
from training.core.fs import atomic_dir, write_atomic
from training.data.images import image_processor
from training.data.streaming import StreamLoader, stream_metrics
from training.evals.harness import evaluate_after_training
from training.loop.run import GracefulStop, Run, StepStats
from training.loop.step import train_step
from training.loop.validate import evaluate
from training.model.adapter_reload import save_reloadable
from training.model.rope import keep_scaled_base_config
from training.model.speed import mfu_postfix
from training.model.vision import checkpoint_processor, processor_for
from training.objectives.router_balance import plain_router_outputs
from training.parallel.collectives import (
    effective_timeout_s,
    lost_peer,
    lost_peer_message,
    set_collective_timeout,
)
from training.parallel.sequence_parallel import skip_first_batches
from training.parallel.state_dict import plain_module_classes
from training.parallel.tensor_parallel import saved_as_plain_model
from training.run.metrics import peak_memory_gb, plot_loss
from training.run.modelcard import write_model_card
from training.run.processors import save_processor
from training.run.resume import GLOBAL_BATCH, STATE_KEY, global_batch

log = logging.getLogger("training")


def write_status(run: Run, state: str, reason: str | None = None, timing: dict | None = None) -> None:
    """status.json for the app: state, step (written every step, whatever log_every), and the trainer's own
    timing while it runs (`timing`: elapsed_s over every attempt of the run, remaining_s from the bar's rate)."""
    if run.accelerator.is_main_process:
        status = {
            "pid": os.getpid(),
            "time": time.time(),
            "state": state,
            "step": run.step,
            "total_steps": run.total_steps,
            **(timing or {}),
        }
        if reason:
            status["reason"] = reason
        write_atomic(run.run_dir.status, json.dumps(status))


def timing(bar: tqdm, start: float) -> dict:
    """The trainer's own clock: seconds since the run first started (a resumed run goes on from the time its
    checkpoint's rows had reached) and the bar's estimate of the rest (tqdm's smoothed rate of this attempt's
    steps; until the bar has redrawn, which it does at most every 0.1 s, their plain mean rate), None before a
    step of this attempt is done."""
    f = bar.format_dict
    done, left = f.get("n", 0) - f.get("initial", 0), (f.get("total") or 0) - f.get("n", 0)
    rate = f.get("rate") or (done / f["elapsed"] if done > 0 and f.get("elapsed") else None)
    return {"elapsed_s": time.time() - start, "remaining_s": left / rate if rate else None}


def batch_stream(loader, accelerator: Accelerator, start: int):
    """Endless micro-batches across epochs, starting at global micro-batch `start` (for resume)."""
    if isinstance(loader, StreamLoader):  # resumes from its own checkpointed position
        yield from loader
        return
    epoch, skip = divmod(start, len(loader))
    while True:
        it = skip_first_batches(accelerator, loader, skip) if skip else loader
        it.set_epoch(epoch)
        yield from it
        epoch, skip = epoch + 1, 0


def save(run: Run, *, wait: bool = False) -> None:
    """Checkpoint step-N; with checkpoint.async_save it completes in the background unless `wait`."""
    state = {"step": run.step, "skipped_steps": run.skipped, "total_steps": run.total_steps}
    state[STATE_KEY] = run.recipe.model_dump(mode="json")  # what a resume must match (training.run.resume)
    state[GLOBAL_BATCH] = global_batch(run.recipe, run.mesh.batch_replicas)
    pairs = run.executor.checkpoint_pairs(run.optimizer)  # pipeline stages: saved by torch DCP
    run.checkpointer.save(run.step, state, pairs, wait=wait)


def log_row(
    run: Run, stats: StepStats, seconds: float, elapsed: float, first: bool, remaining: float | None = None
) -> dict:
    row = {
        "step": run.step,
        "total_steps": run.total_steps,
        "loss": stats.loss,
        "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": stats.grad_norm,
        "tokens": stats.tokens,
        "tokens_per_s": stats.tokens / max(seconds, 1e-9),
        "elapsed_s": elapsed,
        "remaining_s": remaining,  # the trainer's own estimate (its progress bar's)
        "peak_mem_gb": peak_memory_gb(run.accelerator.device),
        "skipped_steps": run.skipped,
        **stats.moe,
        **stream_metrics(run.train_dl),  # streamed/mixed data: tokens drawn per source, records read
        **stats.metrics,
    }
    row["mfu"] = run.speed.mfu(stats.flops / max(seconds, 1e-9))  # None on an unlisted GPU
    setup_row = {**run.speed.as_row(), **run.executor.first_row()} if first else {}
    run.metrics.write({**row, **setup_row})  # the run's set-up, once per run
    return row


def export_final(run: Run) -> Path:
    """save_pretrained output (full model or adapter) + tokenizer, written atomically to final/."""
    acc = run.accelerator
    unwrapped, state_dict = run.executor.whole_model(), run.executor.full_state_dict()  # collective
    if acc.is_main_process:
        base = getattr(unwrapped, "base_model", unwrapped)
        getattr(base, "config", unwrapped.config).use_cache = True
        with (
            atomic_dir(run.run_dir.final) as tmp,
            saved_as_plain_model(unwrapped),
            plain_module_classes(unwrapped),
            plain_router_outputs(unwrapped),
        ):
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            adapter_reloadable(unwrapped, tmp)
            run.tokenizer.save_pretrained(tmp)
            keep_scaled_base_config(unwrapped, run.recipe, tmp)
            if run.recipe.image_text_checkpoint:  # AutoProcessor: the checkpoint's, with the run's tokenizer
                save_processor(checkpoint_processor(run.recipe, run.tokenizer), tmp)
            elif run.recipe.composes_image_text:  # AutoProcessor: the tokenizer and image processor
                image_size = run.recipe.model.vision.image_size
                processor_for(run.recipe, run.tokenizer, image_processor(image_size)).save_pretrained(tmp)
            write_model_card(tmp, run.recipe, run.run_dir)  # README.md: the Hub's model card
    acc.wait_for_everyone()
    return run.run_dir.final


def adapter_reloadable(model, saved: Path) -> None:
    """final/'s adapter keys written so that peft loads them back onto their layers (save_reloadable: transformers'
    key conversion, which peft applies to adapter keys on load, renames some families' current names); a warning
    names those that no form brings back (the file holds them, the run's checkpoints too)."""
    if lost := save_reloadable(model, saved):
        log.warning(
            "final/: peft will not load %d of the adapter's weights back: transformers' key conversion for this family "
            "renames them on load (%s, ...), so a PeftModel.from_pretrained of final/ runs those layers without "
            "their adapters; adapter_model.safetensors holds them all",
            len(lost),
            lost[0],
        )


def finish(run: Run) -> None:
    if run.eval_dls:
        evaluate(run)
    if run.recipe.checkpoint.every_steps:
        save(run, wait=True)
    run.checkpointer.wait()  # a background save still in flight
    final = export_final(run)
    if run.accelerator.is_main_process:
        plot_loss(run.run_dir.metrics, run.run_dir.loss_plot)
        write_status(run, "finished")
        log.info("done: %s (metrics %s, plot %s)", final, run.run_dir.metrics, run.run_dir.loss_plot)
        evaluate_after_training(run.recipe)  # eval.harness_tasks, if any
    run.accelerator.end_training()


def stop_early(run: Run) -> int:
    """SIGTERM/SIGINT on any rank: the step is done; save, say how to resume, exit 0."""
    save(run, wait=True)
    write_status(run, "stopped")
    run.accelerator.end_training()
    if run.accelerator.is_main_process:
        print(
            f"stopped at step {run.step}; checkpoint saved. Resume with the same command (resume: auto).",
            flush=True,
        )
    return 0


# ----------------------------------------------------------------------------- the loop


def every(n: int | None, step: int) -> bool:
    return bool(n) and step % n == 0


def train(run: Run) -> int:
    """The loop (`fit`); a collective that lost another process ends it with one line, exit 3 (see
    training.parallel.collectives), and the status file says failed."""
    try:
        set_collective_timeout(run.recipe.train.collective_timeout_s)  # from the first step to the last
        return fit(run)
    except RuntimeError as e:
        if run.accelerator.num_processes == 1 or not lost_peer(e):
            raise
        timeout_s = effective_timeout_s(run.recipe.train.collective_timeout_s)
        message = lost_peer_message(run.step + 1, e, timeout_s, run.run_dir.latest_checkpoint())
        write_status(run, "failed", message)
        raise TrainingAborted(message) from None


def fit(run: Run) -> int:
    recipe, t, acc = run.recipe, run.recipe.train, run.accelerator
    write_status(run, "running")
    stop = GracefulStop()
    run.windows.start(batch_stream(run.train_dl, acc, run.step * t.grad_accum))
    bar = tqdm(
        total=run.total_steps,
        initial=run.step,
        disable=not acc.is_main_process,
        dynamic_ncols=True,
        desc="train",
    )
    start = time.time() - run.metrics.resumed_elapsed_s  # a resumed run's clock goes on
    last = time.time()
    first_row = True
    run.model.train()
    if run.eval_dls and recipe.eval.at_start and run.step == 0:
        evaluate(run)

    while run.step < run.total_steps:
        stats = train_step(run, run.windows.next(), stop)
        run.checkpointer.poll()  # a background save that failed ends the run here (exit 3)
        bar.update(1)
        clock = timing(bar, start)
        write_status(run, "running", timing=clock)  # every step: the app follows with log_every > 1
        last_step = run.step == run.total_steps
        if every(t.log_every, run.step) or last_step:
            now = time.time()
            row = log_row(run, stats, now - last, clock["elapsed_s"], first_row, clock["remaining_s"])
            first_row = False
            bar.set_postfix(
                loss=f"{stats.loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", **mfu_postfix(row["mfu"])
            )
        if run.eval_dls and every(recipe.eval.every_steps, run.step) and not last_step:
            evaluate(run)
        if every(recipe.checkpoint.every_steps, run.step) and not last_step:
            save(run)
        if stats.stop_requested and not last_step:
            bar.close()
            return stop_early(run)
        last = time.time()
    bar.close()
    set_collective_timeout(None)  # the final save and export on rank 0: torch's default wait again
    finish(run)
    return 0
