"""Set-up: everything the loop needs, built once, in small named steps (torchtune's _setup_* style).

setup(recipe) -> Run
  start          backend, precision for this machine, Accelerator, Mesh, run directory, checks
  load_data      tokenizer, datasets
  objective_data the objective kind's own data pass, if it has one (distill.top_k: the teacher's top-k)
  preflight      memory plan and disk space, before anything large loads
  load_model     model built or loaded, then split as the launch asks (TP, EP, pipeline stages);
                 the step executor is chosen here, once (Model.step)
  make_loaders   train and held-out loaders of the data's shape
  prepare        accelerate's prepare (or the pipeline's own sharding), the step executor
  make_objective the recipe's registered objective kind (training.objectives.registry), built from one
                 context; before resuming, so references taken from the model (a precomputed one, RL's
                 frozen copy) are of its initial weights
  schedule       steps and the optimizer schedule
  resume         what accelerate's checkpoints hold registered, then the checkpoint loaded
  open_metrics   trackers and the metrics file
The Run is built once, complete, from what the steps return.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import LRScheduler

import training.rl  # noqa: F401 (registers online RL's objective kind)
from training.config import Recipe, dump_recipe, resolve_precision
from training.core.errors import RecipeError, UserError
from training.core.fs import write_atomic
from training.core.machine import auto_precision, cpu_has_native_bf16, emulated_bf16_warning
from training.data import build_datasets, eval_loader, eval_split_names, load_tokenizer, train_loader
from training.data.scale import scale_lines
from training.evals.harness import check_harness_tasks
from training.launch.backend import Backend, elastic_attempt, launched_backend
from training.launch.op_builds import cache_cpu_info, check_op_build_locks, use_environment_build_dir
from training.loop.run import Run, StepExecutor, Windows
from training.loop.step import DataParallelStep, PipelineStep
from training.model.attention import VARLEN
from training.model.build import build_model, count_parameters
from training.model.optim import build_optimizer, build_scheduler
from training.model.speed import (
    SpeedReport,
    check_speed_options,
    cpu_compile_warning,
    cpu_sharing_warning,
    speed_report,
)
from training.model.vision import resolve_image_text
from training.objectives.base import checkpointed
from training.objectives.next_token import choose_loss
from training.objectives.registry import DataPass, ObjectiveContext, ObjectiveKind, kind_of
from training.objectives.router_balance import NoRouter, RouterBalance, router_balance
from training.parallel import pipeline
from training.parallel.accelerator import (
    build_accelerator,
    check_compatibility,
    check_model_parallelism,
    model_init_context,
    no_zero3_init,
)
from training.parallel.checkpoint import Checkpointer, load_checkpoint, staging_root
from training.parallel.collectives import effective_timeout_s, gather_objects
from training.parallel.expert_parallel import apply_expert_parallel
from training.parallel.frozen import full_weights, shard_frozen, whole_for_generation
from training.parallel.lean_start import LeanStart, lean_start, prepare_model
from training.parallel.mesh import Mesh
from training.parallel.sequence_parallel import resumable, split_ready
from training.parallel.state_dict import mask_repeated_rows
from training.parallel.tensor_parallel import apply_tensor_parallel
from training.planning.preflight import check_disk_space, memory_fit, run_inventory
from training.run.lock import RunLock
from training.run.metrics import MetricsWriter
from training.run.resume import check_resume, global_batch
from training.run.rundir import RunDir, is_checkpoint
from training.run.trackers import start as start_trackers

log = logging.getLogger(__name__)


@dataclass
class Start:
    recipe: Recipe  # with precision: auto resolved for this machine
    backend: Backend
    accelerator: Accelerator
    mesh: Mesh
    run_dir: RunDir
    resume_from: Path | None  # the checkpoint this run continues (checked against its recipe), or None
    precision_note: str | None  # how `precision: auto` was resolved, said with the model's other settings

    def mask_rows(self, batch: dict) -> dict:
        """Labels of the rows accelerate repeats to even out the last eval batch, masked (over the mesh's
        data-parallel ranks)."""
        return mask_repeated_rows(batch, self.accelerator, self.mesh)


def setup(recipe: Recipe, lock: RunLock | None = None) -> Run:
    """recipe -> accelerator + mesh -> run dir -> tokenizer + data -> preflight -> model -> loaders -> prepare
    -> objective -> optimizer schedule -> resume -> metrics. `lock`: output_dir's lock, taken by the main
    process where it first writes the run directory (one run per directory)."""
    s = start(recipe, lock)
    kind = kind_of(s.recipe)
    tokenizer, train_ds, eval_sets = load_data(s)
    train_ds, eval_sets = objective_data(s, kind, tokenizer, train_ds, eval_sets)
    preflight(s, tokenizer)
    m = load_model(s, tokenizer)
    train_dl, eval_dls = make_loaders(s, tokenizer, train_ds, eval_sets, m)
    optimizer = build_optimizer(m.trained, s.recipe.train, s.accelerator.device)
    executor, optimizer, train_dl, eval_dls = prepare(s, m, optimizer, train_dl, eval_dls)
    check_full_batch(s, train_ds, train_dl)
    total_steps, scheduler = schedule(s, tokenizer, optimizer, train_dl, train_ds)
    windows = Windows(s.recipe.train.grad_accum)
    objective = make_objective(s, kind, executor, (tokenizer, train_ds, eval_sets), windows, total_steps)
    c = s.recipe.checkpoint  # a killed run's staged copies are removed as the checkpointer starts
    checkpointer = Checkpointer(s.accelerator, s.run_dir, c.keep_last, c.async_save, c.staging_dir)
    step, skipped = resume(s, executor, optimizer, scheduler, train_dl, train_ds, objective)
    run = Run(
        recipe=s.recipe,
        accelerator=s.accelerator,
        mesh=s.mesh,
        run_dir=s.run_dir,
        tokenizer=tokenizer,
        executor=executor,
        objective=objective,
        router=m.router,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dl=train_dl,
        eval_dls=eval_dls,
        train_examples=len(train_ds) if train_ds is not None else 0,
        total_steps=total_steps,
        speed=m.speed,
        metrics=open_metrics(s, step if s.resume_from else None),
        checkpointer=checkpointer,
        windows=windows,
        step=step,
        skipped=skipped,
    )
    log_start(run)
    return run


# ----------------------------------------------------------------------------- the steps


def forced_bf16(recipe: Recipe) -> str | None:
    """The setting of a resolved recipe that computes in bf16 whatever the CPU ("key=value", one that `auto` would
    set to fp32 there), or None."""
    if recipe.precision == "bf16":
        return "precision=bf16"
    if recipe.method.type == "qlora" and recipe.method.quantization.compute_dtype == "bfloat16":
        return "method.quantization.compute_dtype=bfloat16"
    return None


def start(recipe: Recipe, lock: RunLock | None = None) -> Start:
    """The launched backend (read once), `precision: auto` for this machine, the Accelerator and its Mesh,
    the run directory with the resolved recipe, and what can be refused before anything loads."""
    backend = launched_backend()
    recipe = resolve_precision(recipe, *auto_precision())
    precision_note = recipe._precision_auto
    recipe = resolve_image_text(recipe)  # model.name_or_path an image-text checkpoint: an image-text run
    run_dir = RunDir(recipe.output_dir)
    if backend.kind == "deepspeed":  # DeepSpeed builds its ops as its accelerator starts
        check_op_build_locks(use_environment_build_dir())
        cache_cpu_info()
    accelerator = build_accelerator(recipe, backend)
    setup_logging(accelerator)
    if elastic := elastic_attempt():
        log.info(elastic)
    if accelerator.num_processes > 1:
        timeout_s = effective_timeout_s(recipe.train.collective_timeout_s)
        log.info(
            "collectives wait at most %g s for the other processes while training (train.collective_timeout_s)",
            timeout_s,
        )
    check_compatibility(recipe, accelerator, backend)
    check_speed_options(recipe, accelerator.device)
    for warning in (
        emulated_bf16_warning(forced_bf16(recipe), accelerator.device.type, cpu_has_native_bf16()),
        cpu_compile_warning(recipe.train.torch_compile, accelerator.device.type),
        cpu_sharing_warning(accelerator.device.type),
    ):
        if warning:
            log.warning(warning)
    check_harness_tasks(recipe)  # eval.harness_tasks: an unknown task fails now, not after training
    mesh = Mesh.build(backend, accelerator)
    if (ckpt := find_resume(recipe, run_dir)) is not None:  # the run it continues trained the same way
        for line in check_resume(recipe, ckpt, global_batch(recipe, mesh.batch_replicas)):
            log.info(line)
    if accelerator.is_main_process:
        if lock is not None:
            lock.acquire()  # a live run holding output_dir is named (exit 2); a dead one holds nothing
        prepare_run_dir(run_dir, recipe)
    accelerator.wait_for_everyone()
    set_seed(recipe.seed)
    return Start(recipe, backend, accelerator, mesh, run_dir, ckpt, precision_note)


def load_data(s: Start):
    """(tokenizer, train dataset or None when streamed, {name: held-out dataset})."""
    tokenizer = load_tokenizer(s.recipe.model, s.recipe.data.images)
    with s.accelerator.main_process_first():
        train_ds, eval_sets = build_datasets(s.recipe, tokenizer)
    return tokenizer, train_ds, eval_sets


def objective_data(s: Start, kind: ObjectiveKind, tokenizer, train_ds, eval_sets: dict) -> tuple:
    """The objective kind's own pass over the data, where it has one (distill.top_k: the teacher's top-k per
    token, computed once by the main process first and cached)."""
    if kind.prepare_data is None:
        return train_ds, eval_sets
    with s.accelerator.main_process_first():
        return kind.prepare_data(DataPass(s.recipe, tokenizer, train_ds, eval_sets, s.accelerator.device))


def preflight(s: Start, tokenizer) -> None:
    """Disk space for the checkpoints (not at the first save) and the memory plan, from the model's
    inventory (a meta-device model); one memory judgement per machine, of its own memory."""
    with no_zero3_init():  # its meta-device model must not be built inside deepspeed.zero.Init
        if (inv := run_inventory(s.recipe, tokenizer)) is None:
            return
        c = s.recipe.checkpoint
        staging = staging_root(s.run_dir, c.staging_dir) if c.async_save else None
        check_disk_space(s.recipe, s.run_dir.root, inv, staging, s.backend.num_machines)
        local_main = s.accelerator.is_local_main_process
        if local_main and (warning := memory_fit(s.recipe, inv, s.backend, s.accelerator.device)):
            log.warning(warning)


@dataclass
class Model:
    model: object  # the whole model (before pipeline splitting)
    pipe: pipeline.Pipeline | None  # this process's stage, when the launch has pipeline stages
    lean: LeanStart | None  # FSDP's lean start-up
    router: RouterBalance | NoRouter
    speed: SpeedReport

    @property
    def trained(self):
        """What the optimizer steps: the model, or this process's stage."""
        return self.pipe.module if self.pipe is not None else self.model

    @property
    def step(self):
        """The step executor of this launch: chosen once, here."""
        return PipelineStep if self.pipe is not None else DataParallelStep


def load_model(s: Start, tokenizer) -> Model:
    """The model, built with the same initial weights under every backend, then split as the launch asks."""
    recipe, acc, mesh = s.recipe, s.accelerator, s.mesh
    check_model_parallelism(recipe, tokenizer, s.backend)  # e.g. a tensor-parallel plan and divisible heads
    lean = lean_start(recipe, acc, mesh)  # FSDP: no process holds the whole model at start-up
    with model_init_context(recipe):  # same initial weights under every backend
        model = build_model(recipe, tokenizer, acc.device, hollow=lean is not None and lean.hollow)
    model = apply_tensor_parallel(model, mesh)  # the model's own TP plan, when the mesh has tp > 1
    model = apply_expert_parallel(model, mesh, acc.device)  # MoE experts sharded over the ranks (ep.yaml)
    router = router_balance(recipe, model)  # MoE models: the router's load-balancing loss; NoRouter if dense
    trainable, total = count_parameters(model)
    log.info(
        "model: %.1fM parameters, %.2fM trainable (%s)", total / 1e6, trainable / 1e6, recipe.method.type
    )
    if s.precision_note:  # with the model's other settings, once the data and model are good
        log.info(s.precision_note)
    loss = choose_loss(model, recipe.train.loss_impl, acc.device, recipe.train.torch_compile)
    speed = speed_report(model, recipe, acc, loss)  # attention impl., loss, compile, FLOPs/token, peak
    pipe = pipeline.build(model, recipe, acc, tokenizer, s.backend, mesh) if mesh.pp > 1 else None
    if pipe is not None:
        router = NoRouter()  # the stages' schedule computes the next-token loss alone
        speed.head_labelled_only = False  # ... from whole logits (pipeline's loss_fn): counted as such
    return Model(model, pipe, lean, router, speed)


def make_loaders(s: Start, tokenizer, train_ds, eval_sets: dict, m: Model):
    recipe, mesh = s.recipe, s.mesh
    padding_free = m.model.config._attn_implementation in VARLEN and m.step.padding_free  # varlen rows
    device = s.accelerator.device
    # the pipeline's stages exchange activations of train.batch_size rows: its batches count packed rows
    unit = "rows" if m.pipe is not None else recipe.data.packed_batch
    train_dl = train_loader(
        recipe, train_ds, tokenizer, mesh.dp_rank, mesh.dp_size, device, padding_free, unit
    )
    if train_ds is not None:  # SP/CP: rows ready to be split (a no-op otherwise)
        train_dl = split_ready(train_dl, mesh, recipe.data.max_length)
    eval_bs = m.step.eval_batch_size(recipe)
    eval_dls = {
        name: eval_loader(recipe, ds, eval_bs, tokenizer, padding_free, unit)
        for name, ds in eval_sets.items()
    }
    return train_dl, eval_dls


def prepare(s: Start, m: Model, optimizer, train_dl, eval_dls: dict):
    """The step executor of this launch, with the model, optimizer and loaders prepared for it."""
    acc, mesh, pipe = s.accelerator, s.mesh, m.pipe
    if pipe is not None:  # the stages were split above; data sharded over the data-parallel replicas only
        train_dl = pipeline.prepare_loader(pipe, acc, train_dl)
        eval_dls = {name: pipeline.prepare_loader(pipe, acc, dl) for name, dl in eval_dls.items()}
        return (
            PipelineStep(pipe, s.mask_rows),
            optimizer,
            train_dl,
            eval_dls,
        )
    model, optimizer, train_dl = prepare_model(acc, m.lean, m.model, optimizer, train_dl)
    train_dl = resumable(train_dl, mesh, acc)  # DeepSpeed Ulysses wrapped it: keep it resumable
    eval_dls = {name: acc.prepare(dl) for name, dl in eval_dls.items()}
    return DataParallelStep(acc, mesh, model), optimizer, train_dl, eval_dls


def check_full_batch(s: Start, train_ds, train_dl) -> None:
    if train_ds is not None and len(train_dl) == 0:
        raise UserError(
            f"data.train: {len(train_ds)} examples give no full batch of train.batch_size="
            f"{s.recipe.train.batch_size} x {s.mesh.dp_size} data-parallel ranks; lower the batch size or add data"
        )


def make_objective(
    s: Start, kind: ObjectiveKind, executor: StepExecutor, data: tuple, windows: Windows, total_steps: int
):
    """The recipe's objective kind built from one context (before resuming: a precomputed reference, and RL's
    frozen copy of the model, are of the initial weights). Inside no_zero3_init: a model it loads (a reward
    model, a teacher) is whole on every rank, not partitioned by ZeRO-3 (a teacher is sharded afterwards)."""
    acc, mesh = s.accelerator, s.mesh
    tokenizer, train_ds, eval_sets = data
    splits = {"train": train_ds} | {k: eval_sets[n] for k, n in eval_split_names(s.recipe.data).items()}
    context = ObjectiveContext(
        recipe=s.recipe,
        accelerator=acc,
        tokenizer=tokenizer,
        model=executor.model,
        splits=splits,
        mask_rows=s.mask_rows,
        dp=(mesh.dp_rank, mesh.dp_size),
        run_dir=s.run_dir,
        synced=s.backend.shards_parameters and acc.num_processes > 1,  # generation steps together
        shard_frozen=lambda model: shard_frozen(model, acc, s.backend, mesh),
        full_weights=full_weights,
        gather=gather_objects,
        upcoming=windows.peek,
        total_steps=total_steps,
        whole_for_generation=whole_for_generation,
    )
    with no_zero3_init():
        return kind.build(context)


def schedule(s: Start, tokenizer, optimizer, train_dl, train_ds) -> tuple[int, LRScheduler]:
    """(total steps, the LR schedule); the scale of the run (tokens in the corpus, per step, steps per epoch)
    said by the main process."""
    t = s.recipe.train
    total_steps = t.max_steps or max(1, int(t.epochs * len(train_dl)) // t.grad_accum)
    if s.accelerator.is_main_process:
        for line in scale_lines(s.recipe, tokenizer, s.mesh.dp_size, total_steps, train_ds):
            log.info(line)
    return total_steps, build_scheduler(optimizer, t, total_steps)


def resume(
    s: Start, executor: StepExecutor, optimizer, scheduler, train_dl, train_ds, objective
) -> tuple[int, int]:
    """(step, skipped steps) of the checkpoint the run continues, (0, 0) for a new run. What accelerate's
    checkpoints hold besides model and optimizer is registered first, in this order: the LR schedule, a
    streamed loader's position, what the objective keeps between steps (RL's rollouts)."""
    acc = s.accelerator
    acc.register_for_checkpointing(scheduler)
    if train_ds is None:
        acc.register_for_checkpointing(train_dl)
    for kept in checkpointed(objective):  # RL's rollouts, reused for rl.num_iterations steps
        acc.register_for_checkpointing(kept)
    if s.resume_from is None:
        return 0, 0
    state = load_checkpoint(acc, s.resume_from, pairs=executor.checkpoint_pairs(optimizer))
    log.info("resumed from %s at step %d", s.resume_from, state["step"])
    return state["step"], state.get("skipped_steps", 0)


def open_metrics(s: Start, resume_step: int | None) -> MetricsWriter:
    """The trackers (report_to: the recipe as hyper-parameters) and the metrics file, continued after
    `resume_step` when resuming."""
    acc, recipe = s.accelerator, s.recipe
    start_trackers(acc, recipe)
    return MetricsWriter(
        s.run_dir.metrics,
        resume_step=resume_step,
        enabled=acc.is_main_process,
        tracker_log=acc.log if recipe.report_to else None,
    )


def log_start(run: Run) -> None:
    t, mesh, acc = run.recipe.train, run.mesh, run.accelerator
    log.info(
        "training %d steps: %d examples, global batch %d x %d accumulation, %d process(es), %s%s",
        run.total_steps,
        run.train_examples,
        t.batch_size * mesh.batch_replicas,
        t.grad_accum,
        acc.num_processes,
        acc.distributed_type.value,
        f", {described}" if (described := mesh.describe()) else "",
    )


# ----------------------------------------------------------------------------- helpers


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


def setup_logging(accelerator: Accelerator) -> None:
    import transformers  # noqa: PLC0415 (already imported by the modules above; only its logging here)

    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True
    )
    transformers.logging.set_verbosity_error()
    quiet_checkpoint_chatter()


class TiedWeightsOnce(logging.Filter):
    """accelerate warns at every checkpoint that it removed a tensor sharing storage with another (a tied
    output head); that is how tied weights are stored, and loading ties them again: said once, as INFO."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Removed shared tensor" not in record.getMessage():
            return True
        if not TiedWeightsOnce.said:
            TiedWeightsOnce.said = True
            names = record.getMessage().split("{", 1)[-1].split("}", 1)[0]
            log.info(
                "checkpoints keep tied weights once (%s share another tensor's storage); loading ties them again",
                names,
            )
        return False


def quiet_checkpoint_chatter() -> None:
    """accelerate's INFO line per file at every save and load (seven at a checkpoint) give way to ours
    (`checkpoint step-N saved ...`); its tied-weights warning is said once (TiedWeightsOnce)."""
    for name in ("accelerate.checkpointing", "accelerate.accelerator"):
        logging.getLogger(name).setLevel(logging.WARNING)
    other = logging.getLogger("accelerate.utils.other")
    if not any(isinstance(f, TiedWeightsOnce) for f in other.filters):
        other.addFilter(TiedWeightsOnce())
