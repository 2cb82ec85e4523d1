"""Train a causal LM from one recipe.

    python -m training.train RECIPE.yaml [dotted.key=value ...]
    accelerate launch [--config_file accelerate_configs/<backend>.yaml] -m training.train RECIPE.yaml

Three parts, read top to bottom:
  setup(recipe) -> Run         accelerator, run directory, tokenizer + data, model, optimizer,
                               scheduler, resume: everything the loop needs, built once
  train_step(run, window)      one optimizer step over `grad_accum` micro-batches -> StepStats
  train(run)                   the loop: step, log, evaluate, checkpoint, stop; then final/ + loss.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from training import faults, pipeline
from training.attention import VARLEN
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import Recipe, TrainSection, dump_recipe, load_recipe
from training.data import build_datasets, eval_split_names, make_loader, real_tokens
from training.data.preference import PreferenceCollator, is_preference, make_preference_loader
from training.data.scale import scale_lines
from training.data.streaming import StreamLoader, stream_metrics
from training.distributed import (
    apply_tensor_parallel,
    build_accelerator,
    check_compatibility,
    check_model_parallelism,
    data_parallel,
    describe_mesh,
    full_state_dict,
    full_tensor,
    lean_start,
    mask_repeated_rows,
    model_init_context,
    no_zero3_init,
    prepare_model,
    saved_as_plain_model,
    tp_size,
)
from training.errors import RecipeError, UserError, cli
from training.evaluate import check_harness_tasks, evaluate_after_training
from training.expert_parallel import apply_expert_parallel
from training.flops import SpeedReport, mfu_postfix, speed_report
from training.fs import atomic_dir, write_atomic
from training.loss import choose_loss, token_loss
from training.metrics import MetricsWriter, peak_memory_gb, plot_loss
from training.modelcard import write_model_card
from training.models import build_model, count_parameters, load_tokenizer
from training.moe import RouterBalance, plain_router_outputs, router_balance
from training.optim import build_optimizer
from training.preference import PreferenceObjective, build_objective
from training.preflight import check_disk_space
from training.rundir import RunDir, is_checkpoint
from training.sequence_parallel import (
    resumable,
    sequence_shards,
    skip_first_batches,
    split_ready,
    ulysses_size,
    window_counts,
)
from training.speed import check_speed_options
from training.trackers import start as start_trackers

log = logging.getLogger("training")


class TrainingAborted(RuntimeError):
    """A runtime failure after which the last good checkpoint is kept (exit code 3)."""


@dataclass
class Run:
    """Everything one training run holds between set-up and the end of the loop."""

    recipe: Recipe
    accelerator: Accelerator
    run_dir: RunDir
    tokenizer: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_dl: object
    eval_dls: dict  # held-out set name -> loader ({} without held-out data)
    train_examples: int
    total_steps: int
    speed: SpeedReport
    metrics: MetricsWriter
    step: int = 0
    skipped: int = 0  # non-finite steps skipped (train.on_nonfinite=skip)
    preference: PreferenceObjective | None = None  # the recipe's preference section; None: SFT
    router: RouterBalance | None = None  # Mixture-of-Experts: load-balancing loss and expert load
    pipeline: pipeline.Pipeline | None = None  # this process's pipeline stage (training/pipeline.py)


@dataclass
class StepStats:
    loss: float  # mean next-token loss over the labelled tokens of the global window
    grad_norm: float
    tokens: int  # real (non-padding) tokens in the global window
    stop_requested: bool  # any rank got SIGTERM/SIGINT
    moe: dict | None = None  # MoE: aux_loss and expert load of the global window (training.moe)
    metrics: dict = field(default_factory=dict)  # preference tuning: rewards and preference accuracy


# ----------------------------------------------------------------------------- set-up


def build_scheduler(optimizer, t: TrainSection, total_steps: int):
    warmup = t.warmup_steps or int(t.warmup_ratio * total_steps)
    name = "constant_with_warmup" if t.scheduler == "constant" else t.scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def find_resume(recipe: Recipe, run_dir: RunDir) -> Path | None:
    if recipe.resume == "none":
        return None
    if recipe.resume == "auto":
        return run_dir.latest_checkpoint()
    path = Path(recipe.resume)
    if not is_checkpoint(path):
        raise RecipeError(
            f"resume: {path} is not a complete checkpoint (expected a checkpoints/step-N directory)"
        )
    return path


def prepare_run_dir(run_dir: RunDir, recipe: Recipe) -> None:
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir.config, dump_recipe(recipe))
    except OSError as e:
        raise RecipeError(f"output_dir: cannot write to {run_dir.root} ({e.strerror})") from None


def write_status(run: Run, state: str) -> None:
    if run.accelerator.is_main_process:
        status = {
            "pid": os.getpid(),
            "time": time.time(),
            "state": state,
            "step": run.step,
            "total_steps": run.total_steps,
        }
        write_atomic(run.run_dir.status, json.dumps(status))


def setup_logging(accelerator: Accelerator) -> None:
    import transformers

    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True
    )
    transformers.logging.set_verbosity_error()


def setup(recipe: Recipe) -> Run:
    """recipe -> accelerator -> run dir -> tokenizer + data -> model -> optimizer/scheduler -> prepare -> resume."""
    run_dir = RunDir(recipe.output_dir)
    accelerator = build_accelerator(recipe)
    setup_logging(accelerator)
    check_compatibility(recipe, accelerator)
    check_speed_options(recipe, accelerator.device)
    check_harness_tasks(recipe)  # eval.harness_tasks: an unknown task fails now, not after training
    if accelerator.is_main_process:
        prepare_run_dir(run_dir, recipe)
    accelerator.wait_for_everyone()
    set_seed(recipe.seed)

    tokenizer = load_tokenizer(recipe.model)
    with accelerator.main_process_first():
        train_ds, eval_sets = build_datasets(recipe, tokenizer)
    with no_zero3_init():  # its meta-device model must not be built inside deepspeed.zero.Init
        check_disk_space(recipe, run_dir.root, tokenizer)  # fail now, not at the first save
    check_model_parallelism(recipe, tokenizer)  # e.g. a tensor-parallel plan and divisible heads
    lean = lean_start(recipe, accelerator)  # FSDP: no process holds the whole model at start-up
    with model_init_context(recipe):  # same initial weights under every backend
        model = build_model(recipe, tokenizer, accelerator.device, hollow=lean is not None and lean.hollow)
    model = apply_tensor_parallel(model, accelerator)  # the model's own TP plan, when the mesh has tp > 1
    model = apply_expert_parallel(model, accelerator)  # MoE experts sharded over the ranks (ep.yaml)
    router = router_balance(recipe, model)  # MoE models: the router's load-balancing loss; None if dense
    trainable, total = count_parameters(model)
    log.info(
        "model: %.1fM parameters, %.2fM trainable (%s)", total / 1e6, trainable / 1e6, recipe.method.type
    )
    if recipe._precision_auto:  # with the model's other settings, once the data and model are good
        log.info(recipe._precision_auto)
    loss = choose_loss(model, recipe.train.loss_impl, accelerator.device, recipe.train.torch_compile)
    speed = speed_report(
        model, recipe, accelerator, loss
    )  # attention impl., loss, compile, FLOPs/token, peak
    pipe = pipeline.build(model, recipe, accelerator, tokenizer)  # None unless the launch asks for stages
    optimizer = build_optimizer(pipe.module if pipe else model, recipe.train, accelerator.device)

    t = recipe.train
    flat = model.config._attn_implementation in VARLEN and not pipe  # packed rows go padding-free (varlen)
    if train_ds is None:  # data.streaming or a mixture: read on the fly; its position is checkpointed
        train_dl = StreamLoader(recipe, tokenizer, accelerator, padding_free=flat)
    elif is_preference(recipe.data):  # pairs: two sequences per example, never packed
        train_dl = make_preference_loader(train_ds, t.batch_size, tokenizer, recipe.seed, shuffle=True)
    else:
        train_dl = make_loader(
            train_ds, t.batch_size, tokenizer, recipe.seed, True, flat, group_by_length=t.group_by_length
        )
        train_dl = split_ready(train_dl, accelerator, recipe.data.max_length)  # SP/CP: rows ready to be split
    eval_bs = t.batch_size if pipe else recipe.eval.batch_size or t.batch_size  # stages: one shape
    eval_dls = {
        name: make_preference_loader(ds, eval_bs, tokenizer, recipe.seed, shuffle=False)
        if is_preference(recipe.data)
        else make_loader(ds, eval_bs, tokenizer, recipe.seed, shuffle=False, padding_free=flat)
        for name, ds in eval_sets.items()
    }
    if pipe:  # the stages were split above; data sharded over the data-parallel replicas only
        model, train_dl = pipe.module, pipeline.prepare_loader(pipe, accelerator, train_dl)
        eval_dls = {name: pipeline.prepare_loader(pipe, accelerator, dl) for name, dl in eval_dls.items()}
    else:
        model, optimizer, train_dl = prepare_model(accelerator, lean, model, optimizer, train_dl)
        train_dl = resumable(train_dl, accelerator)  # DeepSpeed Ulysses wrapped it: keep it resumable
        eval_dls = {name: accelerator.prepare(dl) for name, dl in eval_dls.items()}
    preference = None
    if recipe.preference is not None:  # before resuming: a precomputed reference uses the initial weights
        splits = {"train": train_ds} | {s: eval_sets[n] for s, n in eval_split_names(recipe.data).items()}
        collate = PreferenceCollator(tokenizer.pad_token_id)
        preference = build_objective(recipe, accelerator, model, run_dir, splits, collate)
    if train_ds is not None and len(train_dl) == 0:
        raise UserError(
            f"data.train: {len(train_ds)} examples give no full batch of train.batch_size={t.batch_size} "
            f"x {data_parallel(accelerator)[1]} data-parallel ranks; lower the batch size or add data"
        )
    total_steps = t.max_steps or max(1, int(t.epochs * len(train_dl)) // t.grad_accum)
    if accelerator.is_main_process:  # tokens in the corpus, per step, steps per epoch, preprocessing time
        for line in scale_lines(recipe, tokenizer, data_parallel(accelerator)[1], total_steps, train_ds):
            log.info(line)
    scheduler = build_scheduler(optimizer, t, total_steps)
    accelerator.register_for_checkpointing(scheduler)
    if train_ds is None:
        accelerator.register_for_checkpointing(train_dl)

    step, skipped = 0, 0
    ckpt = find_resume(recipe, run_dir)
    if ckpt is not None:
        state = load_checkpoint(accelerator, ckpt, pairs=[(model, optimizer)] if pipe else None)
        step, skipped = state["step"], state.get("skipped_steps", 0)
        log.info("resumed from %s at step %d", ckpt, step)
    start_trackers(accelerator, recipe)  # report_to: the recipe as hyper-parameters
    metrics = MetricsWriter(
        run_dir.metrics,
        resume_step=step if ckpt else None,
        enabled=accelerator.is_main_process,
        tracker_log=accelerator.log if recipe.report_to else None,
    )
    log.info(
        "training %d steps: %d examples, global batch %d x %d accumulation, %d process(es), %s%s",
        total_steps,
        len(train_ds) if train_ds is not None else 0,
        t.batch_size * (pipe.dp_size if pipe else data_parallel(accelerator)[1] // ulysses_size(accelerator)),
        t.grad_accum,
        accelerator.num_processes,
        accelerator.distributed_type.value,
        f", {mesh}" if (mesh := describe_mesh(accelerator)) else "",
    )
    return Run(
        recipe=recipe,
        accelerator=accelerator,
        run_dir=run_dir,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dl=train_dl,
        eval_dls=eval_dls,
        train_examples=len(train_ds) if train_ds is not None else 0,
        total_steps=total_steps,
        speed=speed,
        metrics=metrics,
        step=step,
        skipped=skipped,
        preference=preference,
        router=router,
        pipeline=pipe,
    )


# ----------------------------------------------------------------------------- one step


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


def train_step(run: Run, window: list[dict], stop: GracefulStop) -> StepStats:
    """One optimizer step over the micro-batches of `window` (this rank's share of the global window).

    The loss is normalised by the number of labelled tokens in the whole global window, so gradient
    accumulation, DDP, ZeRO and FSDP all give the loss of one process seeing the global batch. (Under
    tensor parallelism the ranks of one group count the same rows: numerator and denominator both
    carry the factor, and so does `world_scale`, while TP does not average gradients; it cancels.
    Under sequence/context parallelism each rank computes the loss of its shard of the sequences and
    `window_counts` counts every token once over the group.)
    The step ends with one host synchronisation (`.item()` on a reduced tensor): the non-finite guard
    must know the loss and gradient norm before deciding to step, and every rank must agree on a
    graceful stop before the next step starts.
    """
    if run.pipeline is not None:
        return apply_step(run, pipeline.train_step(run, window, stop))
    acc, model, step, pref = run.accelerator, run.model, run.step + 1, run.preference
    if pref:  # preference tuning: the loss is a mean over the examples (pairs) of the global window
        counts = torch.stack([sum(pref.count(b) for b in window), sum(real_tokens(b) for b in window)])
        counts = counts.to(acc.device, torch.float64)
        pref.start_window(model, window)  # reference log-probabilities (and KTO's KL point)
    else:
        counts = window_counts(acc, window)  # each token once, also when sequences are split over ranks
    n_labels, n_tokens = acc.reduce(counts, "sum").tolist()
    world_scale = acc.num_processes * len(window)  # undoes DDP's and accumulation's averaging
    loss_sum = torch.zeros((), device=acc.device)
    balance = run.router.begin(acc, model, window) if run.router else None  # MoE: exact over the window
    for i, batch in enumerate(window):
        with acc.accumulate(model), sequence_shards(acc, batch):  # context parallel: shards the batch
            s, _, outputs = pref.loss(model, batch, i) if pref else token_loss(model, batch)
            s = faults.inject(step, s)  # test-only: NaN loss, SIGKILL or SIGTERM mid-step (LLM_FORGE_FAULT)
            objective = s * world_scale / max(n_labels, 1)
            if balance is not None:  # + this micro-batch's share of the router's load-balancing loss
                objective = objective + balance.loss(outputs, batch) * world_scale
            acc.backward(objective)
            loss_sum += s.detach()
    grad_norm = acc.clip_grad_norm_(model.parameters(), run.recipe.train.max_grad_norm or float("inf"))
    grad_norm = float(full_tensor(grad_norm)) if grad_norm is not None else float("nan")
    flags = torch.stack([loss_sum.float(), torch.tensor(float(stop.requested), device=acc.device)])
    loss_total, stops = acc.reduce(flags, "sum").tolist()
    stats = StepStats(loss_total / max(n_labels, 1), grad_norm, int(n_tokens) // tp_size(acc), stops > 0)
    stats.moe = balance.finish() if balance is not None else None
    stats.metrics = pref.step_metrics() if pref else {}
    return apply_step(run, stats)


def apply_step(run: Run, stats: StepStats) -> StepStats:
    """The optimizer and scheduler step of a computed window, unless the loss or norm is not finite."""
    acc, step, grad_norm = run.accelerator, run.step + 1, stats.grad_norm
    finite = math.isfinite(stats.loss) and (
        math.isfinite(grad_norm) or acc.distributed_type == DistributedType.DEEPSPEED
    )
    if finite:
        run.optimizer.step()
        if not acc.optimizer_step_was_skipped:
            run.scheduler.step()
    elif run.recipe.train.on_nonfinite == "stop":
        run.optimizer.zero_grad(set_to_none=True)
        raise TrainingAborted(
            f"non-finite loss ({stats.loss}) or gradient norm ({grad_norm}) at step {step}; "
            f"the last good checkpoint is kept (train.on_nonfinite=skip would skip such steps)"
        )
    else:
        run.skipped += 1
        log.warning("step %d: non-finite loss/grad norm, step skipped (%d so far)", step, run.skipped)
    run.optimizer.zero_grad(set_to_none=True)
    run.step = step
    return stats


# ----------------------------------------------------------------------------- around the step


@torch.no_grad()
def evaluate(run: Run) -> None:
    """Eval loss (and perplexity, or the reward metrics) over the held-out data (each set's first
    eval.max_batches), logged as a row. Named sets (data.eval: {web: ..., code: ...}) are scored on
    their own as eval_loss/NAME, ...; eval_loss itself covers the tokens (pairs) of all of them."""
    acc, model, limit = run.accelerator, run.model, run.recipe.eval.max_batches
    named = isinstance(run.recipe.data.eval, dict)
    split_of = {name: split for split, name in eval_split_names(run.recipe.data).items()}  # reference keys
    model.eval()
    balance = run.router.begin(acc, model, []) if run.router else None  # MoE: expert load on eval text
    totals = {}
    for name, loader in run.eval_dls.items():
        batches = itertools.islice(loader, limit)
        if run.preference is not None:
            totals[name] = run.preference.eval_sums(model, batches, split_of[name])
        elif run.pipeline is not None:
            totals[name] = pipeline.eval_totals(run, batches)
        else:
            total = torch.zeros(2, device=acc.device, dtype=torch.float64)
            for batch in batches:
                batch = mask_repeated_rows(batch, acc)  # no double-counted samples
                s, n, outputs = token_loss(model, batch)
                total += torch.stack([s.double(), n.double()])
                if balance is not None:
                    balance.observe(outputs, batch, evaluating=True)
            totals[name] = acc.reduce(total, "sum")
    model.train()

    def scores(total: torch.Tensor, suffix: str = "") -> dict:
        if run.preference is not None:
            return run.preference.eval_row(total, suffix)
        loss = (total[0] / total[1].clamp(min=1)).item()
        return {f"eval_loss{suffix}": loss, f"eval_ppl{suffix}": math.exp(min(loss, 50))}

    row = scores(sum(totals.values()))
    if named:
        for name, total in totals.items():
            row |= scores(total, f"/{name}")
    moe = balance.finish("eval_") if balance is not None else {}
    run.metrics.write({"step": run.step, **row, **moe})
    if run.preference is not None:
        log.info(
            "step %d: eval loss %.4f, preference accuracy %.3f",
            run.step,
            row["eval_loss"],
            row["eval_preference_accuracy"],
        )
    else:
        log.info("step %d: eval loss %.4f (perplexity %.2f)", run.step, row["eval_loss"], row["eval_ppl"])
    for name in totals if named else ():
        log.info("step %d:   %s: eval loss %.4f", run.step, name, row[f"eval_loss/{name}"])


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


def save(run: Run) -> None:
    state = {"step": run.step, "skipped_steps": run.skipped, "total_steps": run.total_steps}
    pairs = [(run.model, run.optimizer)] if run.pipeline else None  # stages: saved by torch DCP
    save_checkpoint(run.accelerator, run.run_dir, run.step, state, run.recipe.checkpoint.keep_last, pairs)


def log_row(run: Run, stats: StepStats, seconds: float, elapsed: float, first: bool) -> dict:
    row = {
        "step": run.step,
        "total_steps": run.total_steps,
        "loss": stats.loss,
        "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": stats.grad_norm,
        "tokens": stats.tokens,
        "tokens_per_s": stats.tokens / max(seconds, 1e-9),
        "elapsed_s": elapsed,
        "peak_mem_gb": peak_memory_gb(run.accelerator.device),
        "skipped_steps": run.skipped,
        **(stats.moe or {}),
        **stream_metrics(run.train_dl),  # streamed/mixed data: tokens drawn per source, records read
        **stats.metrics,
    }
    row["mfu"] = run.speed.mfu(row["tokens_per_s"])  # None on CPU / unknown GPU
    setup_row = {**run.speed.as_row(), **(pipeline.first_row(run) if run.pipeline else {})} if first else {}
    run.metrics.write({**row, **setup_row})  # the run's set-up, once per run
    return row


def export_final(run: Run) -> Path:
    """save_pretrained output (full model or adapter) + tokenizer, written atomically to final/."""
    acc = run.accelerator
    if run.pipeline is not None:  # every stage holds a part: gathered on rank 0 (collective)
        unwrapped, state_dict = pipeline.whole_model(run), pipeline.full_state_dict(run)
    else:
        unwrapped = acc.unwrap_model(run.model)
        state_dict = full_state_dict(acc, run.model)  # collective: gathers shards
    if acc.is_main_process:
        base = getattr(unwrapped, "base_model", unwrapped)
        getattr(base, "config", unwrapped.config).use_cache = True
        with (
            atomic_dir(run.run_dir.final) as tmp,
            saved_as_plain_model(unwrapped),
            plain_router_outputs(unwrapped),
        ):
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            run.tokenizer.save_pretrained(tmp)
            write_model_card(tmp, run.recipe, run.run_dir)  # README.md: the Hub's model card
    acc.wait_for_everyone()
    return run.run_dir.final


def finish(run: Run) -> None:
    if run.eval_dls:
        evaluate(run)
    if run.recipe.checkpoint.every_steps:
        save(run)
    final = export_final(run)
    if run.accelerator.is_main_process:
        plot_loss(run.run_dir.metrics, run.run_dir.loss_plot)
        write_status(run, "finished")
        log.info("done: %s (metrics %s, plot %s)", final, run.run_dir.metrics, run.run_dir.loss_plot)
        evaluate_after_training(run.recipe)  # eval.harness_tasks, if any
    run.accelerator.end_training()


# ----------------------------------------------------------------------------- the loop


def every(n: int | None, step: int) -> bool:
    return bool(n) and step % n == 0


def train(run: Run) -> int:
    recipe, t, acc = run.recipe, run.recipe.train, run.accelerator
    write_status(run, "running")
    stop = GracefulStop()
    batches = batch_stream(run.train_dl, acc, run.step * t.grad_accum)
    bar = tqdm(
        total=run.total_steps,
        initial=run.step,
        disable=not acc.is_main_process,
        dynamic_ncols=True,
        desc="train",
    )
    start = last = time.time()
    first_row = True
    run.model.train()
    if run.eval_dls and recipe.eval.at_start and run.step == 0:
        evaluate(run)

    while run.step < run.total_steps:
        stats = train_step(run, [next(batches) for _ in range(t.grad_accum)], stop)
        bar.update(1)
        last_step = run.step == run.total_steps
        if every(t.log_every, run.step) or last_step:
            now = time.time()
            row = log_row(run, stats, now - last, now - start, first_row)
            first_row = False
            bar.set_postfix(
                loss=f"{stats.loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", **mfu_postfix(row["mfu"])
            )
        if run.eval_dls and every(recipe.eval.every_steps, run.step) and not last_step:
            evaluate(run)
        if every(recipe.checkpoint.every_steps, run.step) and not last_step:
            save(run)
        if stats.stop_requested and not last_step:
            save(run)
            bar.close()
            write_status(run, "stopped")
            acc.end_training()
            if acc.is_main_process:
                print(
                    f"stopped at step {run.step}; checkpoint saved. Resume with the same command (resume: auto).",
                    flush=True,
                )
            return 0
        last = time.time()
    bar.close()
    finish(run)
    return 0


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.lr=1e-4")
    return ap.parse_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    return train(setup(load_recipe(args.recipe, args.overrides)))


def entry() -> None:
    try:
        code = main()
    except TrainingAborted as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 3
    sys.exit(code)


if __name__ == "__main__":
    entry()
