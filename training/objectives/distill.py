"""Knowledge distillation as an objective: next-token cross-entropy plus a divergence to a teacher's
distribution, on the labelled tokens of the same batches SFT trains on.

    loss per labelled token = ce_weight x CE(student, label) + (1 - ce_weight) x D_beta(student, teacher)

D_beta is GKD's generalised Jensen-Shannon divergence (Agarwal et al. 2024, eq. 1, as TRL's
`generalized_jsd_loss` computes it) of the two distributions at `temperature`:
    beta = 0   forward KL(teacher || student)
    beta = 1   reverse KL(student || teacher)
    between    beta KL(teacher || m) + (1 - beta) KL(student || m),  m = beta teacher + (1 - beta) student
The step normalises the summed loss by the labelled tokens of the global window, as for SFT, so
accumulation and every data-parallel backend give the one-process loss.

The teacher shares the student's vocabulary (a different tokenizer is refused, naming both), sits beside
the student in eval mode, never trained and without optimizer state (sharded like it under FSDP2 and
ZeRO-3: the loop passes training.parallel.frozen's shard_frozen and full_weights in), and its logits come
on the fly. With distill.top_k, the teacher runs once over the data instead, before training (the main
process first), and its top-k token ids and log-probabilities per labelled position are cached beside the
tokenized data and ride in the batches (with_teacher_topk); no teacher is in memory while training, and
the divergence compares the two distributions on those k tokens plus one bucket holding the rest of each
one's mass (MaxText's "other bucket" truncation: renormalising over the k tokens instead would tell a
student nothing about the mass it puts elsewhere); with k = the vocabulary it is the whole divergence.

On-policy distillation (GKD's lambda, distill.lmbda): on the steps a coin keyed by (seed, step) picks, each
row's last labelled span (its last assistant turn) is replaced by the student's own completion of the
tokens before it, sampled by the RL rollout stage (training/generation: keyed by (seed, step, prompt), so
every backend and a resumed run draw the same), labelled whole and scored by the teacher on the fly. Neither model's [tokens x vocab] logits are held for the whole batch: both output heads are
called by their models' own forwards (as the chunked SFT loss does: objectives/next_token.py), the
teacher's returning only the hidden states of the labelled positions, the student's computing the loss
in chunks of rows, with its gradients, from those and its own hidden states. A student whose head is not
a plain Linear (a LoRA adapter on lm_head, a quantised head) gets the same loss from whole logits.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from datasets.arrow_writer import ArrowWriter

from training.config import DistillSection, ModelSection, Recipe
from training.core.batch import IGNORE, NOT_MODEL_INPUTS, TEACHER_TOPK, labelled_tokens, real_tokens
from training.core.errors import RecipeError
from training.data.cache import cache_dir, cache_key, load_or_build
from training.data.loader import Collator, make_loader
from training.data.tokenizer import load_tokenizer
from training.generation import TransformersEngine, sample_seed
from training.model.build import load_teacher, teacher_fingerprint, teacher_vocab_size
from training.model.unwrap import inner_module
from training.objectives.next_token import CHUNK_ELEMENTS, output_heads, targets_of
from training.objectives.registry import DataPass, ObjectiveContext, ObjectiveKind, register

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the divergence


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float) -> torch.Tensor:
    """Per-row generalised JSD [rows] of two logit tensors [rows, vocab] (fp32), as TRL computes it."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return jsd_of_logprobs(s, t, beta)


LOG_FLOOR = -80.0  # a log-probability of ~1e-35: an empty bucket, kept finite so that 0 x log 0 is 0


def topk_logprobs(
    student_logits, ids, teacher_logprobs, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(student, teacher) log-probabilities [rows, k + 1] on the teacher's top-k tokens and one bucket for
    all the others: the student's at the temperature (its whole softmax, gathered), the teacher's as
    precomputed at that temperature, each bucket holding the rest of its mass (MaxText's "other bucket"):
    two whole distributions, so every beta is a true divergence, and k = the vocabulary is the whole one."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    s_rest = s.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    t = teacher_logprobs.float()
    t_rest = torch.log1p(-t.exp().sum(-1, keepdim=True).clamp(max=1.0))
    s_all = torch.cat([s.gather(-1, ids), s_rest.clamp(min=LOG_FLOOR)], dim=-1)
    return s_all, torch.cat([t, t_rest.clamp(min=LOG_FLOOR)], dim=-1)


def jsd_of_logprobs(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row generalised JSD [rows] of two log-probability tensors [rows, n]."""
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
    return b * kl_t + (1 - b) * kl_s


def row_losses(
    student_logits, teacher_scores, targets, cfg: DistillSection, ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy [rows], divergence [rows]) of labelled rows. The teacher's scores are its logits
    [rows, vocab], or with `ids` [rows, k] its log-probabilities at those tokens at the temperature
    (precomputed top-k): the divergence then compares the two distributions on those k tokens and a bucket
    for the rest (topk_logprobs)."""
    ce = F.cross_entropy(student_logits.float(), targets, reduction="none")
    if ids is None:
        return ce, generalized_jsd(student_logits, teacher_scores, cfg.beta, cfg.temperature)
    s, t = topk_logprobs(student_logits, ids, teacher_scores, cfg.temperature)
    return ce, jsd_of_logprobs(s, t, cfg.beta)


@dataclass
class HeadRows:
    """The teacher's logits, row chunk by row chunk, from its hidden states and output head."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, None]:
        with torch.no_grad():
            return F.linear(self.x[start:end], self.weight, self.bias), None


@dataclass
class TopkRows:
    """The teacher's precomputed top-k log-probabilities and their token ids, row chunk by row chunk."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logprobs[start:end], self.ids[start:end]


class ChunkedDistillLoss(torch.autograd.Function):
    """sum over rows of ce_weight x CE + (1 - ce_weight) x D, one chunk of rows at a time: each chunk's
    student logits and teacher scores (`teacher.rows`: HeadRows or TopkRows) are made, differentiated
    (autograd on the chunk) and freed in forward, which leaves the gradients of x, weight and bias; backward
    scales them (as ChunkedLinearCrossEntropy)."""

    @staticmethod
    def forward(ctx, x, weight, bias, teacher, targets, cfg, rows: int, sums: list):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        w_ce, w_kd = cfg.ce_weight, 1.0 - cfg.ce_weight
        for start in range(0, x.shape[0], rows):
            part, t = x[start : start + rows], targets[start : start + rows]
            teacher_scores, ids = teacher.rows(start, start + rows)
            with torch.enable_grad():
                xc = part.detach().requires_grad_(need_x)
                wc = weight.detach().requires_grad_(need_w)
                bc = bias.detach().requires_grad_(need_b) if bias is not None else None
                ce, kd = row_losses(F.linear(xc, wc, bc), teacher_scores, t, cfg, ids)
                loss = w_ce * ce.sum() + w_kd * kd.sum()
                wanted = [v for v, n in ((xc, need_x), (wc, need_w), (bc, need_b)) if n]
                got = iter(torch.autograd.grad(loss, wanted)) if wanted else iter(())
            total += loss.detach()
            sums[0] += float(ce.detach().sum())
            sums[1] += float(kd.detach().sum())
            if need_x:
                grad_x[start : start + rows] = next(got)
            if need_w:
                grad_w += next(got).float()
            if need_b:
                grad_b += next(got).float()
        ctx.grads = (
            grad_x,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
        )
        return total

    @staticmethod
    def backward(ctx, grad_total):
        gx, gw, gb = (None if g is None else g * grad_total.to(g.dtype) for g in ctx.grads)
        ctx.grads = None
        return gx, gw, gb, None, None, None, None, None


def rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // (4 * vocab))  # student and teacher logits, their log-softmax, grads


# ----------------------------------------------------------------------------- the heads


class _HeadOverride:
    """While open, `head.forward` is `self.call(x, original)` for calls with one tensor argument, and the
    head's own forward otherwise (restored on exit)."""

    head: torch.nn.Module

    def call(self, x, original):
        raise NotImplementedError

    def __enter__(self):
        self._saved = self.head.__dict__.get("forward")
        original = self._saved or type(self.head).forward.__get__(self.head)

        def forward(x, *args, **kwargs):
            return original(x, *args, **kwargs) if args or kwargs else self.call(x, original)

        self.head.forward = forward
        return self

    def __exit__(self, *exc):
        if self._saved is None:
            del self.head.forward
        else:
            self.head.forward = self._saved
        return False


class _Capture(_HeadOverride):
    """While open, the first call of `head` with inputs of the targets' shape returns zeros and keeps its
    input at the labelled positions (the teacher's last hidden states, no logits made)."""

    def __init__(self, head, keep: torch.Tensor):
        self.head, self.keep, self.x = head, keep, None

    def call(self, x, original):
        if self.x is None and x.shape[:-1] == self.keep.shape:
            self.x = x[self.keep]
            return x.new_zeros(())
        return original(x)


class _HeadComputesDistill(_HeadOverride):
    """While open, the student head's first call with inputs of the targets' shape returns the summed
    distillation loss of the labelled rows (the model's own forward calls it: ZeRO-3 gathers and FSDP2
    unshards its weight there, as for the chunked SFT loss). `teacher(dtype)` gives the labelled rows'
    teacher scores (HeadRows or TopkRows) for the student's dtype."""

    def __init__(self, head, teacher: Callable[[torch.dtype], HeadRows | TopkRows], targets, cfg, sums):
        self.head, self.teacher = head, teacher
        self.targets, self.cfg, self.sums, self.result = targets, cfg, sums, None

    def call(self, x, original):
        if self.result is not None or x.shape[:-1] != self.targets.shape:
            return original(x)
        keep = self.targets != IGNORE
        xs, t = x[keep], self.targets[keep]
        self.result = ChunkedDistillLoss.apply(
            xs,
            self.head.weight,
            self.head.bias,
            self.teacher(xs.dtype),
            t,
            self.cfg,
            rows_per_chunk(self.head.weight.shape[0]),
            self.sums,
        )
        return self.result


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


@contextlib.contextmanager
def plain_weights(module: torch.nn.Module):
    """(weight, bias) of a module that is whole on this process (training.parallel.frozen.full_weights
    gathers those of a sharded one)."""
    yield module.weight, getattr(module, "bias", None)


WeightsOf = Callable[[torch.nn.Module], contextlib.AbstractContextManager]


def precomputed_topk(batch: dict, keep: torch.Tensor) -> TopkRows:
    """The labelled rows' precomputed teacher top-k that a batch carries (distill.top_k)."""
    return TopkRows(batch[TEACHER_TOPK[0]][keep].long(), batch[TEACHER_TOPK[1]][keep].float())


@contextlib.contextmanager
def teacher_rows(teacher, batch: dict, keep: torch.Tensor, weights_of: WeightsOf = plain_weights):
    """While open, gives `rows(dtype)`: the teacher's scores of the labelled rows: the batch's precomputed
    top-k, or from its hidden states (its forward run here, its head's input captured: no logits made) and
    its head's weights (whole while open, also where the teacher is sharded)."""
    if TEACHER_TOPK[0] in batch:
        found = precomputed_topk(batch, keep)
        yield lambda dtype: found
        return
    head = output_heads(teacher)[0][0]
    with torch.no_grad(), _Capture(head, keep) as cap:
        teacher(**model_inputs(batch), use_cache=False)
    with weights_of(head) as (weight, bias):

        def rows(dtype):
            return HeadRows(cap.x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None)

        yield rows


def distill_loss(
    model, teacher, batch: dict, cfg: DistillSection, sums: list, weights_of: WeightsOf = plain_weights
) -> torch.Tensor:
    """The summed distillation loss of a batch's labelled tokens (sums[0] += CE, sums[1] += divergence).
    `teacher` is None when the batch carries the teacher's precomputed top-k (distill.top_k);
    `weights_of`: how its head's weights are had whole (training.parallel.frozen.full_weights if sharded)."""
    targets = targets_of(batch)
    keep = targets != IGNORE
    inputs = model_inputs(batch)
    precomputed = TEACHER_TOPK[0] in batch
    student_heads, why = output_heads(inner_module(model))
    if student_heads and (precomputed or output_heads(teacher)[0]):
        with (
            teacher_rows(teacher, batch, keep, weights_of) as teacher_scores,
            _HeadComputesDistill(student_heads[0], teacher_scores, targets, cfg, sums) as probe,
        ):
            out = model(**inputs, use_cache=False)
        if probe.result is not None and out.logits is not None and out.logits.dim() == 0:
            return out.logits
    # whole logits: a head that is not a plain Linear (LoRA on lm_head), or one called unexpectedly
    if precomputed:
        found = precomputed_topk(batch, keep)
        ids, t_scores = found.ids, found.logprobs
    else:
        ids = None
        with torch.no_grad():
            t_scores = teacher(**inputs, use_cache=False).logits[keep]
    s_logits = model(**inputs, use_cache=False).logits[keep]
    ce, kd = row_losses(s_logits, t_scores, targets[keep], cfg, ids)
    sums[0] += float(ce.detach().sum())
    sums[1] += float(kd.detach().sum())
    return cfg.ce_weight * ce.sum() + (1 - cfg.ce_weight) * kd.sum()


# ----------------------------------------------------------------------------- as an objective


# ----------------------------------------------------------------------------- on-policy steps


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` trains on the student's own completions: a uniform draw keyed by
    (seed, step) below lmbda (GKD's per-step coin, the same on every rank and after a resume)."""
    return sample_seed(seed, step, -1, 0) / 2**63 < lmbda


def prompt_of(ids: list[int], labels: list[int]) -> list[int]:
    """The tokens before a row's last labelled span (its last assistant turn): what the student completes."""
    end = max((i for i, label in enumerate(labels) if label != IGNORE), default=len(ids))
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return ids[:start]


def prompt_key(prompt: list[int]) -> int:
    """A completion's key from its prompt's tokens: the same row draws the same completion under every
    backend and batch layout (two equal prompts in one step draw the same one)."""
    return int.from_bytes(
        hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=7).digest()
    )


@dataclass
class Distill:
    """Knowledge distillation as a training.objectives.base.Objective (see the module doc). With an engine
    (distill.lmbda > 0), the steps that on_policy_step picks train on the student's own completions of
    the window's prompts (the rollout stage of online RL: keyed sampling), scored by the teacher."""

    cfg: DistillSection
    teacher: torch.nn.Module | None  # None with distill.top_k: the batches carry the teacher's top-k
    accelerator: object
    mask_rows: Callable[[dict], dict]  # masks the rows accelerate repeats in the last eval batch
    sums: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # CE, divergence, labelled tokens
    engine: TransformersEngine | None = None  # on-policy steps (distill.lmbda > 0)
    pad_token_id: int = 0
    window: list[dict] | None = None  # this step's trained batches: the loader's or the student's own
    generated: list = field(default_factory=lambda: [0.0, 0.0])  # on-policy: completions, their tokens
    weights_of: WeightsOf = plain_weights  # the teacher head's weights, whole (gathered if it is sharded)

    def counts(self, window: list[dict]) -> torch.Tensor:
        trained = self.trained_batches(window)
        counts = torch.stack([sum(labelled_tokens(b) for b in trained), sum(real_tokens(b) for b in trained)])
        return counts.to(self.accelerator.device)

    def start_window(self, model, window: list[dict], step: int = 0) -> Distill:
        on_policy = self.engine is not None and on_policy_step(self.engine.seed, step, self.cfg.lmbda)
        self.generated = [0.0, 0.0]
        self.window = [self._completed(model, b, step) for b in window] if on_policy else window
        self.sums = [0.0, 0.0, float(sum(labelled_tokens(b) for b in self.window))]
        return self

    def _completed(self, model, batch: dict, step: int) -> dict:
        """The batch with each row's last labelled span replaced by the student's own completion of the
        tokens before it (sampled at distill.temperature, keyed by (seed, step, prompt)), labelled whole."""
        unwrapped, dev = self.accelerator.unwrap_model(model), self.accelerator.device
        rows = []
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            real = mask.bool()
            prompt = prompt_of(ids[real].tolist(), labels[real].tolist())
            made = self.engine.group(unwrapped, prompt, step, prompt_key(prompt), 1, dev)
            completion = made.ids[0, : int(made.lengths[0])].tolist()
            rows.append({"input_ids": prompt + completion, "labels": [IGNORE] * len(prompt) + completion})
            self.generated[0] += 1
            self.generated[1] += len(completion)
        return {k: v.to(dev) for k, v in Collator(self.pad_token_id)(rows).items()}

    def loss(self, model, batch: dict, i: int):
        trained = self.window[i] if self.window is not None else batch
        return distill_loss(model, self.teacher, trained, self.cfg, self.sums, self.weights_of), None, None

    def trained_batches(self, window: list[dict]) -> list[dict]:
        return self.window if self.window is not None else window

    def step_metrics(self) -> dict:
        """The window's cross-entropy and divergence per labelled token, over every rank (a collective);
        with lmbda > 0, whether the step was on-policy and its completions' mean length."""
        t = torch.tensor([*self.sums, *self.generated], dtype=torch.float64, device=self.accelerator.device)
        ce, kd, n, completions, tokens = self.accelerator.reduce(t, "sum").tolist()
        row = {"ce_loss": ce / max(n, 1), "distill_divergence": kd / max(n, 1)}
        if self.engine is not None:
            row["on_policy"] = float(completions > 0)
            if completions:
                row["completion_length"] = tokens / completions
        return row

    @torch.no_grad()
    def eval_sums(self, model, batches, split: str, balance=None) -> torch.Tensor:
        """[CE, divergence, labelled tokens] over the held-out batches and every rank (repeated rows once)."""
        total = torch.zeros(3, dtype=torch.float64, device=self.accelerator.device)
        for batch in batches:
            batch = self.mask_rows(batch)
            sums = [0.0, 0.0]
            distill_loss(model, self.teacher, batch, self.cfg, sums, self.weights_of)
            total += torch.tensor(
                [*sums, float((targets_of(batch) != IGNORE).sum())], dtype=torch.float64, device=total.device
            )
        return self.accelerator.reduce(total, "sum")

    @staticmethod
    def eval_row(total: torch.Tensor, suffix: str = "") -> dict:
        """eval_loss is the student's cross-entropy (comparable with SFT runs); the divergence beside it."""
        n = max(total[2].item(), 1)
        loss = total[0].item() / n
        return {
            f"eval_loss{suffix}": loss,
            f"eval_ppl{suffix}": math.exp(min(loss, 50)),
            f"eval_distill_divergence{suffix}": total[1].item() / n,
        }

    @staticmethod
    def eval_line(row: dict) -> str:
        return (
            f"eval loss {row['eval_loss']:.4f} (perplexity {row['eval_ppl']:.2f}), "
            f"divergence to the teacher {row['eval_distill_divergence']:.4f}"
        )


# ----------------------------------------------------------------------------- precomputed top-k

TOPK_DIR = "teacher-topk"  # under the data cache directory


def split_digest(ds: datasets.Dataset) -> str:
    """sha256 of a tokenized split's input_ids and labels, row by row in order."""
    table = ds.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    h = hashlib.sha256()
    for name in ("input_ids", "labels"):
        column = table.column(name).combine_chunks()
        h.update(np.asarray(pc.list_value_length(column)).tobytes())
        h.update(np.asarray(column.flatten()).tobytes())
    return h.hexdigest()


@torch.no_grad()
def batch_topk(teacher, batch: dict, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k (token ids [batch, length, k] int32, log-probabilities at the temperature
    [batch, length, k] fp32) at every labelled position of a batch (zeros elsewhere), its logits made a
    chunk of rows at a time."""
    targets = targets_of(batch)
    keep = targets != IGNORE
    heads, _ = output_heads(teacher)
    if heads:
        with teacher_rows(teacher, batch, keep) as rows:  # its hidden states and head: logits by chunks
            head_rows = rows(heads[0].weight.dtype)
        n, vocab = head_rows.x.shape[0], head_rows.weight.shape[0]

        def logits_of(a, b):
            return head_rows.rows(a, b)[0]

    else:  # a head that is not a plain Linear: whole logits
        logits = teacher(**model_inputs(batch), use_cache=False).logits[keep]

        def logits_of(a, b):
            return logits[a:b]

        n, vocab = logits.shape
    ids = torch.empty((n, k), dtype=torch.int32, device=targets.device)
    logprobs = torch.empty((n, k), dtype=torch.float32, device=targets.device)
    step = rows_per_chunk(vocab)
    for a in range(0, n, step):
        top = F.log_softmax(logits_of(a, a + step).float() / temperature, dim=-1).topk(k, dim=-1)
        ids[a : a + step], logprobs[a : a + step] = top.indices.int(), top.values
    full_ids = targets.new_zeros((*targets.shape, k), dtype=torch.int32)
    full_lps = targets.new_zeros((*targets.shape, k), dtype=torch.float32)
    full_ids[keep], full_lps[keep] = ids, logprobs
    return full_ids, full_lps


def split_topk(
    teacher, ds: datasets.Dataset, recipe: Recipe, tokenizer, device, path: Path
) -> datasets.Dataset:
    """The two per-token columns (TEACHER_TOPK, k values per token, flattened) of a split, in its row order,
    written batch by batch into the Arrow file `path` and read back memory-mapped (nothing held whole)."""
    k, temperature = recipe.distill.top_k, recipe.distill.temperature
    features = datasets.Features(
        {
            TEACHER_TOPK[0]: datasets.Sequence(datasets.Value("int32")),
            TEACHER_TOPK[1]: datasets.Sequence(datasets.Value("float32")),
        }
    )
    with ArrowWriter(features=features, path=str(path)) as writer:
        for batch in make_loader(ds, recipe.train.batch_size, tokenizer, recipe.seed, shuffle=False):
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths) * k)]).astype(np.int32)
            found = batch_topk(teacher, {k_: v.to(device) for k_, v in batch.items()}, k, temperature)
            columns = {}
            for key, values in zip(TEACHER_TOPK, found):
                values = values.cpu().numpy()
                flat = np.concatenate([values[i, :n].reshape(-1) for i, n in enumerate(lengths)])
                columns[key] = pa.ListArray.from_arrays(offsets, flat)
            writer.write_table(pa.table(columns))
        writer.finalize()
    return datasets.Dataset.from_file(str(path))


def check_topk(k: int, vocab: int) -> None:
    if k > vocab:
        raise RecipeError(f"distill.top_k: {k} is more than the {vocab} tokens the teacher scores")


def with_teacher_topk(recipe: Recipe, tokenizer, train_ds, eval_sets: dict, device) -> tuple:
    """(train, {name: held-out set}) with the teacher's top-k log-probabilities as per-token columns
    (distill.top_k), computed once and kept in the data cache under a key of the splits' tokens, the
    teacher's files, its dtype, k and the temperature: a hit (a resumed run, another run on the same data) loads no teacher."""
    cfg = recipe.distill
    if cfg is None or cfg.top_k is None:
        return train_ds, eval_sets
    named = {"train": train_ds} | {f"eval.{n}": ds for n, ds in eval_sets.items()}
    entry = {f"split{i}": name for i, name in enumerate(named)}  # directory names inside a cache entry
    where = cache_dir(recipe.data) / TOPK_DIR
    scratch = where / f".building-{os.getpid()}"  # the files build() writes

    def build():  # a miss: the teacher is checked (build_distill checks it again for training), then runs
        check_teacher_tokenizer(recipe, tokenizer)
        check_topk(cfg.top_k, teacher_vocab_size(recipe))
        scratch.mkdir(parents=True, exist_ok=True)
        teacher = load_teacher(recipe, device)
        t0, tokens = time.perf_counter(), sum(sum(map(len, ds["input_ids"])) for ds in named.values())
        built = {
            d: split_topk(teacher, named[name], recipe, tokenizer, device, scratch / f"{d}.arrow")
            for d, name in entry.items()
        }
        log.info(
            "distill.top_k: the teacher's top-%d log-probabilities of %d tokens in %.1f s",
            cfg.top_k,
            tokens,
            time.perf_counter() - t0,
        )
        return built, {d: {"split": name} for d, name in entry.items()}

    if recipe.data.cache:  # the entry is a copy: the scratch files go once it is written
        key = cache_key(
            {
                "teacher_topk": cfg.top_k,
                "temperature": cfg.temperature,
                "teacher": teacher_fingerprint(cfg.teacher),
                "dtype": recipe.model.dtype,
                "splits": {d: split_digest(named[name]) for d, name in entry.items()},
            }
        )
        try:
            built, _, hit = load_or_build(where, key, build)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.info(
            "distill.top_k: teacher's top-%d %s: %s",
            cfg.top_k,
            "cached, the teacher is not loaded" if hit else "written",
            where / key,
        )
    else:  # read from the scratch files while training; removed at exit
        built, _ = build()
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    joined = {
        name: datasets.concatenate_datasets([named[name], built[d]], axis=1) for d, name in entry.items()
    }
    return joined.pop("train"), {n: joined[f"eval.{n}"] for n in eval_sets}


# ----------------------------------------------------------------------------- the teacher's checks


def check_same_vocabulary(student_tok, teacher_tok, student_name: str, teacher_name: str) -> None:
    """A teacher must share the student's vocabulary: the divergence compares distributions token by token."""
    if student_tok.get_vocab() != teacher_tok.get_vocab():
        raise RecipeError(
            f"distill.teacher: {teacher_name} has another vocabulary than the student's tokenizer "
            f"{student_name} ({len(teacher_tok)} vs {len(student_tok)} tokens); distillation compares the two "
            f"distributions token by token, so the teacher must use the student's tokenizer"
        )


def check_same_logits(student, teacher_size: int, teacher_name: str) -> None:
    head = inner_module(student).get_output_embeddings()
    s, t = (
        getattr(head, "out_features", None) or head.weight.shape[0],
        teacher_size,
    )  # ZeRO-3: weight is empty
    if s != t:
        raise RecipeError(
            f"distill.teacher: {teacher_name} scores {t} tokens, the student {s}: the output heads must have "
            f"the same size (the same tokenizer, and the same model.from_scratch vocabulary padding)"
        )


def check_teacher_tokenizer(recipe: Recipe, tokenizer) -> None:
    cfg = recipe.distill
    try:
        teacher_tok = load_tokenizer(ModelSection(name_or_path=cfg.teacher))
    except RecipeError:
        raise RecipeError(f"distill.teacher: {cfg.teacher} has no tokenizer beside it to compare") from None
    student_name = recipe.model.tokenizer or recipe.model.name_or_path or "(trained tokenizer)"
    check_same_vocabulary(tokenizer, teacher_tok, student_name, cfg.teacher)


def build_distill(c: ObjectiveContext) -> Distill:
    """The distillation objective with its teacher, loaded on this rank and checked against the student;
    with distill.top_k, no teacher: the batches carry its precomputed top-k (with_teacher_topk).
    `c.synced`: the student is sharded (ZeRO-3/FSDP), so on-policy generation steps every rank together.
    `c.shard_frozen(teacher) -> (teacher, how)`: shards it like the student (training.parallel.frozen), and
    `c.full_weights` then gathers its head's weights."""
    recipe, tokenizer, model, accelerator = c.recipe, c.tokenizer, c.model, c.accelerator
    cfg = recipe.distill
    check_teacher_tokenizer(recipe, tokenizer)
    if cfg.top_k is not None:
        teacher, size = None, teacher_vocab_size(recipe)
    else:
        teacher = load_teacher(recipe, accelerator.device)
        size = teacher.get_output_embeddings().weight.shape[0]
        teacher, how = c.shard_frozen(teacher)
        log.info("distill.teacher: %s, never trained, no optimizer state", how)
    check_same_logits(model, size, cfg.teacher)
    engine = None
    if cfg.lmbda > 0:
        eos = tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos)
        engine = TransformersEngine(
            recipe.seed,
            cfg.max_new_tokens,
            cfg.temperature,
            1.0,
            eos_ids,
            tokenizer.pad_token_id,
            c.synced,
            autocast=accelerator.autocast,
            gathered=c.whole_for_generation,
        )
    log.info(
        "distillation: %.0f%% cross-entropy + %.0f%% divergence to the teacher (beta %g, temperature %g%s%s)",
        100 * cfg.ce_weight,
        100 * (1 - cfg.ce_weight),
        cfg.beta,
        cfg.temperature,
        f", over its precomputed top-{cfg.top_k} tokens" if cfg.top_k else "",
        f", on the student's own completions on {100 * cfg.lmbda:.0f}% of the steps (lmbda)"
        if engine
        else "",
    )
    pad = tokenizer.pad_token_id
    return Distill(
        cfg, teacher, accelerator, c.mask_rows, engine=engine, pad_token_id=pad, weights_of=c.full_weights
    )


def distill_data(p: DataPass) -> tuple:
    """The data pass of distill.top_k: the teacher's top-k per token, computed once (with_teacher_topk)."""
    return with_teacher_topk(p.recipe, p.tokenizer, p.train, p.evals, p.device)


register(
    ObjectiveKind(
        "distill",
        applies=lambda recipe: recipe.distill is not None,
        build=build_distill,
        priority=20,
        prepare_data=distill_data,
    )
)
