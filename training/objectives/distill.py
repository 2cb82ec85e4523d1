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
the student on every rank in eval mode, never trained and without optimizer state, and its logits come
on the fly. Neither model's [tokens x vocab] logits are held for the whole batch: both output heads are
called by their models' own forwards (as the chunked SFT loss does: objectives/next_token.py), the
teacher's returning only the hidden states of the labelled positions, the student's computing the loss
in chunks of rows, with its gradients, from those and its own hidden states. A student whose head is not
a plain Linear (a LoRA adapter on lm_head, a quantised head) gets the same loss from whole logits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from training.config import DistillSection, ModelSection, Recipe
from training.core.batch import IGNORE, labelled_tokens, real_tokens
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer
from training.model.build import load_teacher
from training.model.unwrap import inner_module
from training.objectives.next_token import CHUNK_ELEMENTS, output_heads, targets_of

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the divergence


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float) -> torch.Tensor:
    """Per-row generalised JSD [rows] of two logit tensors [rows, vocab] (fp32), as TRL computes it."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
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
    student_logits, teacher_logits, targets, cfg: DistillSection
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy [rows], divergence [rows]) of labelled rows."""
    ce = F.cross_entropy(student_logits.float(), targets, reduction="none")
    return ce, generalized_jsd(student_logits, teacher_logits, cfg.beta, cfg.temperature)


class ChunkedDistillLoss(torch.autograd.Function):
    """sum over rows of ce_weight x CE + (1 - ce_weight) x D, one chunk of rows at a time: each chunk's
    student and teacher logits are made, differentiated (autograd on the chunk) and freed in forward, which
    leaves the gradients of x, weight and bias; backward scales them (as ChunkedLinearCrossEntropy)."""

    @staticmethod
    def forward(ctx, x, weight, bias, teacher_x, teacher_w, teacher_b, targets, cfg, rows: int, sums: list):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        w_ce, w_kd = cfg.ce_weight, 1.0 - cfg.ce_weight
        for start in range(0, x.shape[0], rows):
            part, t = x[start : start + rows], targets[start : start + rows]
            with torch.no_grad():
                teacher_logits = F.linear(teacher_x[start : start + rows], teacher_w, teacher_b)
            with torch.enable_grad():
                xc = part.detach().requires_grad_(need_x)
                wc = weight.detach().requires_grad_(need_w)
                bc = bias.detach().requires_grad_(need_b) if bias is not None else None
                ce, kd = row_losses(F.linear(xc, wc, bc), teacher_logits, t, cfg)
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
        return gx, gw, gb, None, None, None, None, None, None, None


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
    unshards its weight there, as for the chunked SFT loss)."""

    def __init__(self, head, teacher_x, teacher_head, targets, cfg, sums):
        self.head, self.teacher_x, self.teacher_head = head, teacher_x, teacher_head
        self.targets, self.cfg, self.sums, self.result = targets, cfg, sums, None

    def call(self, x, original):
        if self.result is not None or x.shape[:-1] != self.targets.shape:
            return original(x)
        keep = self.targets != IGNORE
        xs, t = x[keep], self.targets[keep]
        th = self.teacher_head
        self.result = ChunkedDistillLoss.apply(
            xs,
            self.head.weight,
            self.head.bias,
            self.teacher_x.to(xs.dtype),
            th.weight.to(xs.dtype),
            th.bias.to(xs.dtype) if th.bias is not None else None,
            t,
            self.cfg,
            rows_per_chunk(self.head.weight.shape[0]),
            self.sums,
        )
        return self.result


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}


def distill_loss(model, teacher, batch: dict, cfg: DistillSection, sums: list) -> torch.Tensor:
    """The summed distillation loss of a batch's labelled tokens (sums[0] += CE, sums[1] += divergence)."""
    targets = targets_of(batch)
    keep = targets != IGNORE
    inputs = model_inputs(batch)
    teacher_heads, _ = output_heads(teacher)
    student_heads, why = output_heads(inner_module(model))
    if student_heads and teacher_heads:
        with torch.no_grad(), _Capture(teacher_heads[0], keep) as cap:
            teacher(**inputs, use_cache=False)
        with _HeadComputesDistill(student_heads[0], cap.x, teacher_heads[0], targets, cfg, sums) as probe:
            out = model(**inputs, use_cache=False)
        if probe.result is not None and out.logits is not None and out.logits.dim() == 0:
            return out.logits
    # whole logits: a head that is not a plain Linear (LoRA on lm_head), or one called unexpectedly
    with torch.no_grad():
        t_logits = teacher(**inputs, use_cache=False).logits[keep]
    s_logits = model(**inputs, use_cache=False).logits[keep]
    ce, kd = row_losses(s_logits, t_logits, targets[keep], cfg)
    sums[0] += float(ce.detach().sum())
    sums[1] += float(kd.detach().sum())
    return cfg.ce_weight * ce.sum() + (1 - cfg.ce_weight) * kd.sum()


# ----------------------------------------------------------------------------- as an objective


@dataclass
class Distill:
    """Knowledge distillation as a training.objectives.base.Objective (see the module doc)."""

    cfg: DistillSection
    teacher: torch.nn.Module
    accelerator: object
    mask_rows: Callable[[dict], dict]  # masks the rows accelerate repeats in the last eval batch
    sums: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # CE, divergence, labelled tokens

    def counts(self, window: list[dict]) -> torch.Tensor:
        counts = torch.stack([sum(labelled_tokens(b) for b in window), sum(real_tokens(b) for b in window)])
        return counts.to(self.accelerator.device)

    def start_window(self, model, window: list[dict], step: int = 0) -> Distill:
        self.sums = [0.0, 0.0, float(sum(labelled_tokens(b) for b in window))]
        return self

    def loss(self, model, batch: dict, i: int):
        return distill_loss(model, self.teacher, batch, self.cfg, self.sums), None, None

    def trained_batches(self, window: list[dict]) -> list[dict]:
        return window

    def step_metrics(self) -> dict:
        """The window's cross-entropy and divergence per labelled token, over every rank (a collective)."""
        t = torch.tensor(self.sums, dtype=torch.float64, device=self.accelerator.device)
        ce, kd, n = self.accelerator.reduce(t, "sum").tolist()
        return {"ce_loss": ce / max(n, 1), "distill_divergence": kd / max(n, 1)}

    @torch.no_grad()
    def eval_sums(self, model, batches, split: str, balance=None) -> torch.Tensor:
        """[CE, divergence, labelled tokens] over the held-out batches and every rank (repeated rows once)."""
        total = torch.zeros(3, dtype=torch.float64, device=self.accelerator.device)
        for batch in batches:
            batch = self.mask_rows(batch)
            sums = [0.0, 0.0]
            distill_loss(model, self.teacher, batch, self.cfg, sums)
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


def check_same_vocabulary(student_tok, teacher_tok, student_name: str, teacher_name: str) -> None:
    """A teacher must share the student's vocabulary: the divergence compares distributions token by token."""
    if student_tok.get_vocab() != teacher_tok.get_vocab():
        raise RecipeError(
            f"distill.teacher: {teacher_name} has another vocabulary than the student's tokenizer "
            f"{student_name} ({len(teacher_tok)} vs {len(student_tok)} tokens); distillation compares the two "
            f"distributions token by token, so the teacher must use the student's tokenizer"
        )


def check_same_logits(student, teacher, teacher_name: str) -> None:
    s = inner_module(student).get_output_embeddings().weight.shape[0]
    t = teacher.get_output_embeddings().weight.shape[0]
    if s != t:
        raise RecipeError(
            f"distill.teacher: {teacher_name} scores {t} tokens, the student {s}: the output heads must have "
            f"the same size (the same tokenizer, and the same model.from_scratch vocabulary padding)"
        )


def build_distill(recipe: Recipe, tokenizer, model, accelerator, mask_rows) -> Distill:
    """The distillation objective with its teacher, loaded whole on this rank and checked against the student."""
    cfg = recipe.distill
    teacher = load_teacher(recipe, accelerator.device)
    try:
        teacher_tok = load_tokenizer(ModelSection(name_or_path=cfg.teacher))
    except RecipeError:
        raise RecipeError(f"distill.teacher: {cfg.teacher} has no tokenizer beside it to compare") from None
    student_name = recipe.model.tokenizer or recipe.model.name_or_path or "(trained tokenizer)"
    check_same_vocabulary(tokenizer, teacher_tok, student_name, cfg.teacher)
    check_same_logits(model, teacher, cfg.teacher)
    log.info(
        "distillation: %.0f%% cross-entropy + %.0f%% divergence to the teacher (beta %g, temperature %g)",
        100 * cfg.ce_weight,
        100 * (1 - cfg.ce_weight),
        cfg.beta,
        cfg.temperature,
    )
    return Distill(cfg, teacher, accelerator, mask_rows)
