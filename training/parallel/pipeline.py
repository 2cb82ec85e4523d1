"""Pipeline parallelism: a Hugging Face decoder split into stages by layers, trained with
torch.distributed.pipelining (PipelineStage + ScheduleGPipe / Schedule1F1B), optionally with data
parallelism over the remaining processes (PP x DP).

Chosen by the accelerate config file, not the recipe (accelerate_configs/pp.yaml, pp_dp.yaml):

    parallelism_config:
      parallelism_config_pp_size: 2            # stages
      parallelism_config_pp_schedule: 1F1B     # or GPipe
      parallelism_config_pp_microbatches: 4    # optional; default: train.batch_size (one row each)
      parallelism_config_dp_replicate_size: 2  # optional: data-parallel replicas of the whole pipeline

The processes form a torch DeviceMesh (pp, dp): rank = stage x dp + replica. Stage s holds decoder
layers [s*L/p, (s+1)*L/p) (the first also the embeddings, the last also the final norm and the LM head);
the parameter names stay those of the whole model (model.layers.3.mlp...), so checkpoints (torch
distributed checkpoint, one file set holding every stage) and `final/` are whole-model. Each replica's
stages see the same rows; the data are sharded over the dp dimension only; a stage's gradients are
averaged over its dp group after the schedule (one flattened all-reduce; see _average_over_replicas).

Micro-batches: one optimizer micro-step's batch (train.batch_size rows per replica) is cut into
`pp_microbatches` micro-batches of equal rows; `train.grad_accum` such batches make a step, as without
pipelining. Every micro-batch is right-padded to data.max_length, because the stages exchange
activations of one fixed shape (padding gets no label and no attention, so the loss is unchanged).

The loss is normalised exactly as in every step (training.loop.step): summed next-token cross-entropy over the labelled
tokens of the whole global window, divided by the global labelled-token count (counted before the step),
so the trajectory equals one process seeing the same global batch. The schedule's bubble, the share of
each stage's time spent idle, is (p - 1) / (m + p - 1) for GPipe and 1F1B (p stages, m micro-batches).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import init_empty_weights
from accelerate.data_loader import prepare_data_loader
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import AutoModelForCausalLM

from training.core.batch import IGNORE, labelled_tokens
from training.core.errors import RecipeError
from training.launch.backend import Backend
from training.launch.checks import bubble_fraction, stage_layers
from training.parallel.mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

log = logging.getLogger(__name__)

PASSED_TO_EVERY_STAGE = ("attention_mask", "position_ids")  # per-row tensors each stage's layers need


class _Skipped(torch.nn.Module):
    """Stands in for a decoder layer another stage holds: passes the hidden states through, so the
    base model's own forward (mask, rotary embeddings, layer loop) runs unchanged on the layers kept."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        if hasattr(layer, "attention_type"):  # read by some models' layer loops (Qwen3, Gemma, ...)
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class Stage(torch.nn.Module):
    """One stage of a causal LM: its children are named like the whole model's (`model`, `lm_head`),
    so its state dict keys are the whole model's keys for the parameters it holds."""

    def __init__(self, lm, index: int, stages: int, autocast):
        super().__init__()
        base = lm.model
        layers = stage_layers(len(base.layers), stages, index)
        self.first, self.last, self.layers, self.config = index == 0, index == stages - 1, layers, lm.config
        for i in range(len(base.layers)):
            if i not in layers:
                base.layers[i] = _Skipped(base.layers[i])
        if not self.first:
            base.embed_tokens = None
        if not self.last:
            base.norm = torch.nn.Identity()
        self.model = base
        self.lm_head = lm.lm_head if self.last else None
        self._autocast = autocast  # the recipe's precision (accelerate's autocast; a no-op for fp32)

    def forward(self, x, attention_mask=None, position_ids=None):
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with self._autocast():
            h = self.model(
                **inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
            return self.lm_head(h) if self.last else h


def check_splittable(lm, backend: Backend) -> None:
    """A Llama-style decoder (model.embed_tokens, .layers, .norm, .rotary_emb, lm_head); else RecipeError
    (exit 2). (More stages than layers is refused earlier, from the config: backends.check_pipeline.)"""
    base = getattr(lm, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, p) for p in parts) or not hasattr(lm, "lm_head"):
        raise RecipeError(
            f"parallelism_config_pp_size={backend.pp_size} (the accelerate config): the model type "
            f"{lm.config.model_type!r} is not a Llama-style decoder (model.embed_tokens, model.layers, model.norm, "
            f"model.rotary_emb, lm_head) that training/parallel/pipeline.py can split; use llama, qwen2, qwen3, mistral, ... "
            f"or a config without pipeline stages (ddp.yaml, fsdp.yaml)"
        )


@dataclass
class Pipeline:
    """This process's part of the pipeline, and what a step needs."""

    mesh: DeviceMesh  # (pp, dp)
    stage: PipelineStage
    schedule: object
    module: Stage
    index: int
    stages: int
    dp_rank: int
    dp_size: int
    microbatches: int
    rows: int  # rows per micro-step batch (train.batch_size)
    length: int  # every micro-batch is padded to this many tokens
    pad_token_id: int
    schedule_name: str
    tied: dist.ProcessGroup | None = None  # tied embedding/head: {first, last stage} of this replica
    scale: float = 1.0  # the loss function's multiplier, set before each step (1.0: raw sums, for eval)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches)

    def describe(self) -> str:
        return (
            f"pipeline {self.stages} stages x {self.dp_size} data-parallel, {self.schedule_name}, "
            f"{self.microbatches} micro-batches of {self.rows // self.microbatches} rows, "
            f"bubble {self.bubble:.1%}; this process: stage {self.index} (layers "
            f"{self.module.layers.start}-{self.module.layers.stop - 1}), replica {self.dp_rank}"
        )

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """training.objectives.next_token.token_loss's summed next-token cross-entropy, times `scale`."""
        loss_sum = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(),
            labels[:, 1:].flatten(),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return loss_sum * self.scale


def build(model, recipe, accelerator, tokenizer, backend: Backend, mesh: Mesh) -> Pipeline:
    """Split `model` for the launched pipeline (backend.pp_size > 1): this process keeps its stage."""
    check_splittable(model, backend)
    pp, dp = mesh.pp, mesh.dp_size
    device_mesh = init_device_mesh(accelerator.device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    index, dp_rank = device_mesh["pp"].get_local_rank(), device_mesh["dp"].get_local_rank()
    assert (index, dp_rank) == (mesh.pp_rank, mesh.dp_rank), (
        "the pipeline's mesh and training.parallel.mesh differ"
    )
    tied = _tied_group(model, device_mesh, pp, dp)
    module = Stage(model, index, pp, accelerator.autocast).to(accelerator.device)
    # imported here, not at the top: torch.distributed.pipelining costs ~1.5 s of start-up (it pulls in
    # dynamo and DTensor's op table), paid by every process of every run otherwise
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(module, index, pp, accelerator.device, group=device_mesh["pp"].get_group())
    rows = recipe.train.batch_size
    m = backend.pp_microbatches or rows
    pipe = Pipeline(
        mesh=device_mesh,
        stage=stage,
        schedule=None,
        module=module,
        index=index,
        stages=pp,
        dp_rank=dp_rank,
        dp_size=dp,
        microbatches=m,
        rows=rows,
        length=recipe.data.max_length,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        schedule_name=backend.pp_schedule,
        tied=tied,
    )
    # scale_grads=False: the loss function already carries the whole normalisation
    schedules = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
    pipe.schedule = schedules[backend.pp_schedule](stage, m, loss_fn=pipe.loss_fn, scale_grads=False)
    log.info("%s", pipe.describe())
    return pipe


def _tied_group(lm, mesh: DeviceMesh, pp: int, dp: int) -> dist.ProcessGroup | None:
    """An output head tied to the input embedding (tie_word_embeddings) is one weight that the first
    stage uses as the embedding and the last as the head: each keeps a copy (equal at the start), and
    their gradients are summed over the two before every optimizer step, so both copies take the same
    steps. The group of this replica's first and last stage (None when untied or on the stages between)."""
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return None
    ranks = mesh.mesh  # [pp, dp] global ranks
    mine = None
    for d in range(dp):  # every process creates every group, in the same order
        group = dist.new_group([int(ranks[0, d]), int(ranks[pp - 1, d])])
        if dist.get_rank() in (int(ranks[0, d]), int(ranks[pp - 1, d])):
            mine = group
    return mine


def _tied_weight(pipe: Pipeline) -> torch.nn.Parameter | None:
    if pipe.tied is None:
        return None
    m = pipe.module
    return m.model.embed_tokens.weight if pipe.first else m.lm_head.weight


def prepare_loader(pipe: Pipeline, accelerator, loader):
    """accelerate's data-loader sharding, over the data-parallel ranks only: the stages of one replica
    get the same rows."""
    return prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=pipe.dp_size,
        process_index=pipe.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=True,
        rng_types=accelerator.rng_types.copy(),
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
    )


def fixed_shape(pipe: Pipeline, batch: dict) -> dict:
    """The batch padded to `rows` x `length`: extra columns are padding (no label, no attention), extra
    rows repeat row 0 without labels (a row with nothing to attend to would give NaN)."""
    ids = batch["input_ids"]
    n, s = ids.shape
    if s > pipe.length:
        raise RecipeError(f"a batch of {s} tokens is longer than data.max_length={pipe.length}")
    fills = {"input_ids": pipe.pad_token_id, "labels": IGNORE, "attention_mask": 0, "position_ids": 0}
    out = {}
    for key, fill in fills.items():
        if key not in batch:
            continue
        t = F.pad(batch[key], (0, pipe.length - s), value=fill)
        if n < pipe.rows:
            extra = t[:1].expand(pipe.rows - n, -1)
            extra = torch.full_like(extra, IGNORE) if key == "labels" else extra
            t = torch.cat([t, extra])
        out[key] = t
    if "attention_mask" not in out and "position_ids" not in out and s < pipe.length:
        out["attention_mask"] = F.pad(torch.ones_like(ids), (0, pipe.length - s), value=0)
    return out


def run_schedule(pipe: Pipeline, batch: dict, train: bool) -> torch.Tensor:
    """One pass of the schedule over one batch; on the last stage, the summed (unscaled) loss."""
    batch = fixed_shape(pipe, batch)
    args = (batch["input_ids"],) if pipe.first else ()
    kwargs = {k: batch[k] for k in PASSED_TO_EVERY_STAGE if k in batch}
    losses: list = []
    target = batch["labels"] if pipe.last else None
    run = pipe.schedule.step if train else pipe.schedule.eval
    run(*args, target=target, losses=losses if pipe.last else None, **kwargs)
    device = batch["input_ids"].device
    if not pipe.last:
        return torch.zeros((), device=device)
    return torch.stack([x.detach().float() for x in losses]).sum() / pipe.scale


def _average_over_replicas(pipe: Pipeline) -> None:
    """Average each gradient over the stage's data-parallel replicas: one all-reduce of all of them
    flattened (what DDP does in buckets). DDP itself is not used: its reducer fails an internal assertion
    ("rebuilt parameter indices size is not same as original model parameters size") once a stage runs
    several micro-batch backwards per step, even through PipelineStage's own no_sync handling."""
    if pipe.dp_size == 1:
        return
    grads = [p.grad for p in pipe.module.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=pipe.mesh["dp"].get_group())
    flat /= pipe.dp_size
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def _sum_tied_gradients(pipe: Pipeline) -> None:
    """The tied embedding/head weight's gradient: the first stage's (embedding) plus the last's (head)."""
    if (w := _tied_weight(pipe)) is not None:
        dist.all_reduce(w.grad, group=pipe.tied)


def clip(pipe: Pipeline, max_norm: float | None) -> float:
    """The whole model's gradient norm (each stage's, combined over the pipeline group; a tied weight
    counted once, on the first stage), and clipping with it (torch's clip_grads_with_norm_), as
    clip_grad_norm_ does in one process."""
    params = [p for p in pipe.module.parameters() if p.grad is not None]
    tied = _tied_weight(pipe) if pipe.last else None
    counted = [p.grad for p in params if p is not tied]
    local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros(())
    sq = local.double().pow(2).to(pipe.stage.device)
    dist.all_reduce(sq, group=pipe.mesh["pp"].get_group())
    total = sq.sqrt().float()
    if max_norm and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def reduce_over_replicas(pipe: Pipeline, counts: torch.Tensor) -> torch.Tensor:
    """`counts` summed over the data-parallel replicas (the stages of one replica see the same rows)."""
    counts = counts.to(pipe.stage.device)
    dist.all_reduce(counts, group=pipe.mesh["dp"].get_group())
    return counts


def sum_over_all(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over every process (losses live on the last stage's replicas)."""
    dist.all_reduce(t)
    return t


def forward_backward(pipe: Pipeline, window: list[dict], n_labels: float, inject) -> torch.Tensor:
    """The schedule over the window's micro-step batches, normalised by the global labelled-token count;
    then the gradients are averaged over the replicas and tied weights summed. Returns this stage's summed
    loss (0 except on the last stage). `inject(loss)` is the test-only fault hook."""
    pipe.scale = pipe.dp_size / max(n_labels, 1)  # the replicas' gradients are averaged: undo that
    loss_sum = torch.zeros((), device=pipe.stage.device)
    for batch in window:
        loss_sum += inject(run_schedule(pipe, batch, train=True))
    _average_over_replicas(pipe)
    _sum_tied_gradients(pipe)
    return loss_sum


@torch.no_grad()
def eval_totals(pipe: Pipeline, batches, mask_rows) -> torch.Tensor:
    """(summed loss, labelled tokens) over `batches`, over all replicas (float64, on every rank);
    `mask_rows(batch)` masks the rows accelerate repeats to even out the last batch."""
    pipe.scale = 1.0
    total = torch.zeros(2, dtype=torch.float64, device=pipe.stage.device)
    for batch in batches:
        batch = mask_rows(batch)
        s = run_schedule(pipe, batch, train=False)
        n = labelled_tokens(batch)
        total += torch.stack([s.double(), n.double() if pipe.last else torch.zeros((), dtype=torch.float64)])
    dist.all_reduce(total)  # only the last stage's replicas hold sums and counts
    return total


def full_state_dict(pipe: Pipeline) -> dict:
    """The whole model's state dict on global rank 0 (collective): each stage's first replica sends its
    parameters; {} elsewhere."""
    own = {}
    if pipe.dp_rank == 0:
        own = {k: v.detach().cpu() for k, v in pipe.module.state_dict().items()}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own, parts, dst=0)
    if not parts:
        return {}
    state = {k: v for part in parts for k, v in part.items()}
    if pipe.tied is not None:  # one tensor again, so that save_pretrained writes it once
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def whole_model(pipe: Pipeline):
    """A model object for save_pretrained on rank 0: the config's model, on the meta device (the state
    dict saved is the gathered one)."""
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(pipe.module.config)


def first_row(pipe: Pipeline) -> dict:
    """What the first metrics row records about the pipeline."""
    return {
        "pp_stages": pipe.stages,
        "pp_schedule": pipe.schedule_name,
        "pp_microbatches": pipe.microbatches,
        "pp_bubble": round(pipe.bubble, 4),
    }
