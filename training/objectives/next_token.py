"""The training objective: summed next-token cross-entropy over the labelled tokens of a batch.

`token_loss` returns the sum (not the mean) and the count, so the caller can normalise over a whole
accumulation window and every data-parallel rank (see `training.loop.step.train_step`). It also returns the model's
outputs: a Mixture-of-Experts model's router logits ride on them.

Two ways to compute it, chosen once per run by `choose_loss` (train.loss_impl: auto | chunked | full)
and logged with the attention implementation:

- chunked (the default wherever it applies): the `[tokens x vocab]` logits are never materialised.
  While the model runs, its output head (e.g. `lm_head`, a plain Linear) is called as usual, by the
  model's own forward and through every wrapper's hooks, but computes the summed cross-entropy of the
  labelled positions from its input and weight instead of returning logits, in chunks of about
  `CHUNK_ELEMENTS` logits (or with Liger's / cut-cross-entropy's fused kernels on CUDA when
  installed). The loss is then the model's output, so the head's weight is used only inside the head
  module's own forward: DeepSpeed ZeRO-3 gathers it there and again before the head's backward (its
  module hooks), FSDP2 holds it unsharded there, DDP sees an ordinary forward. Positions without a
  label (padding, prompts under assistant-only masks, the first token of each packed document) get no
  logits at all.
- full: the model returns logits and the loss is `F.cross_entropy` over them in fp32. Used where the
  chunked path cannot be exact: an output head that is not a plain Linear (a LoRA adapter on lm_head,
  a quantised head), a head sharded by tensor parallelism (its logits are gathered over the vocabulary
  split), models that post-process their logits (soft-capping, scaling), torch.compile.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from training.core.batch import IGNORE, labelled_tokens, real_tokens
from training.core.errors import RecipeError
from training.core.tensors import is_dtensor
from training.model.unwrap import inner_module
from training.objectives.registry import ObjectiveKind, register

log = logging.getLogger(__name__)

# Logits per chunk of the chunked loss (64 MiB in fp32): rows per chunk = CHUNK_ELEMENTS // vocab.
CHUNK_ELEMENTS = 2**24
# Config attributes of models whose forward changes the head's output before returning it as logits.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# Model types whose forward changes the head's output by a rule of its own, not a config setting (what it does).
LOGIT_MASKS = {"chameleon": "its VQ image codes' logits set to the lowest value"}
_CHOICE_ATTR = "_llm_forge_loss"


@dataclass
class LossChoice:
    impl: str  # "chunked" (ChunkedLinearCrossEntropy), "liger", "cut_cross_entropy" or "full"
    reason: str  # why this one (for the log and metrics)
    # the Linear modules that make the logits, found before any backend wraps or shards the model
    heads: list = field(default_factory=list, repr=False, compare=False)

    def describe(self) -> str:
        return f"{self.impl} ({self.reason})"


# ----------------------------------------------------------------------------- which loss


def output_heads(model) -> tuple[list[torch.nn.Module], str]:
    """(the plain Linear modules that compute the logits, '') or ([], why there are none)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return [], "the model has no output head (get_output_embeddings() is None)"
    if type(head).__name__ == "ModulesToSaveWrapper":  # peft modules_to_save=[lm_head]: a trained copy
        linears = [m for m in head.modules() if type(m) is torch.nn.Linear]
        if linears:
            return linears, ""
    if type(head) is not torch.nn.Linear:
        return [], f"the output head is a {type(head).__module__}.{type(head).__name__}, not a plain Linear"
    if is_dtensor(head.weight) and _sharded_by_tensor_parallel(head.weight):
        return [], "the output head is split over the vocabulary by tensor parallelism"
    return [head], ""


def _sharded_by_tensor_parallel(weight) -> bool:
    names = weight.device_mesh.mesh_dim_names or ()
    return "tp" in names or any(p.is_shard() for p in weight.placements)


def logit_postprocessing(config) -> str:
    """'' or the config setting with which the model changes its head's output before returning it."""
    for name in LOGIT_POSTPROCESSING:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0, False):
            return f"{name}={value}"
    return LOGIT_MASKS.get(getattr(config, "model_type", None), "")


def chunked_unavailable(model, compiled: bool = False) -> str:
    """'' if the chunked loss applies to this (unwrapped) model, else why not."""
    _, why = output_heads(model)
    if why:
        return why
    if post := logit_postprocessing(getattr(model, "config", None)):
        return f"the model post-processes its logits ({post})"
    if compiled:
        return "train.torch_compile: the compiled graph calls the head as it was traced"
    return ""


def fused_kernel(device: torch.device) -> str | None:
    """Liger's or cut-cross-entropy's fused linear cross-entropy, when installed and on CUDA."""
    if device.type != "cuda":
        return None
    for impl, package in (("liger", "liger_kernel"), ("cut_cross_entropy", "cut_cross_entropy")):
        if importlib.util.find_spec(package) is not None:
            return impl
    return None


def choose_loss(model, requested: str = "auto", device=None, compiled: bool = False) -> LossChoice:
    """Pick the loss for this model (train.loss_impl) and remember it on the model for token_loss.

    requested='chunked' where it cannot apply is a RecipeError naming the reason."""
    model = inner_module(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if requested == "full":
        choice = LossChoice("full", "train.loss_impl=full")
    elif why := chunked_unavailable(model, compiled):
        if requested == "chunked":
            raise RecipeError(f"train.loss_impl=chunked cannot be used here: {why}; use auto or full")
        choice = LossChoice("full", why)
    elif kernel := fused_kernel(device):
        choice = LossChoice(
            kernel, f"fused linear cross-entropy kernel, {device.type}", output_heads(model)[0]
        )
    else:
        choice = LossChoice(
            "chunked", f"output head in chunks of {CHUNK_ELEMENTS:,} logits", output_heads(model)[0]
        )
    setattr(model, _CHOICE_ATTR, choice)
    return choice


def loss_choice(model) -> LossChoice:
    """The loss chosen for this model (chosen now, automatically, if nobody chose before)."""
    inner = inner_module(model)
    choice = getattr(inner, _CHOICE_ATTR, None)
    return choice if choice is not None else choose_loss(inner)


# ----------------------------------------------------------------------------- the chunked computation


def rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where autocast is on (as for F.linear), else the
    weight's (a QLoRA head kept in bf16 gets its fp32 input cast, as its forward pre-hook does)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_n cross_entropy(x[n] @ weight.T + bias, targets[n]) over rows that all carry a label, one chunk
    of rows at a time.

    Per chunk it does what the full loss does for those rows: logits in the compute dtype (F.linear),
    then fp32 log-softmax; with gradients wanted it turns the same fp32 buffer into softmax - one-hot at
    once and multiplies it back through the head, so the forward leaves the gradients of x, weight and
    bias (in their own dtypes, weight's accumulated over chunks in fp32 when it is fp32) and no logits;
    backward scales them by the incoming gradient. That is one matmul less than recomputing the logits
    in backward and holds the same memory: the weight's gradient would be allocated at the start of
    backward anyway, the loss being the first thing backward visits.

    Hand-written because torch 2.13's F.linear_cross_entropy (chunked `options`) returns the loss in
    the input dtype: a bf16 sum over thousands of tokens is off by ~0.3%, more than the loss curves it
    is compared on.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, targets, rows: int, dtype: torch.dtype, grads: bool):
        need_x, need_w, need_b = (grads and n for n in ctx.needs_input_grad[:3])
        xc, wc = x.to(dtype), weight.to(dtype)
        bc = bias.to(dtype) if bias is not None else None
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], rows):
            part, t = xc[start : start + rows], targets[start : start + rows]
            logits = F.linear(part, wc, bc).float()  # [rows, vocab]: the only vocabulary-sized tensors
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if not (need_x or need_w or need_b):
                continue
            dlogits = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            dlogits[torch.arange(t.shape[0], device=t.device), t] -= 1.0
            if need_b:
                grad_b += dlogits.sum(0)
            d = dlogits.to(dtype)
            del logits, dlogits
            if need_x:
                grad_x[start : start + rows] = (d @ wc).to(x.dtype)
            if need_w:
                grad_w += (d.T @ part).to(grad_w.dtype)
        ctx.grads = (grad_x, grad_w, grad_b.to(bias.dtype) if need_b else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_w, grad_b = (None if g is None else g * grad_total.to(g.dtype) for g in ctx.grads)
        ctx.grads = None
        return grad_x, grad_w, grad_b, None, None, None, None


def linear_loss_sum(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, impl: str
) -> torch.Tensor:
    """sum over labelled rows of cross_entropy(x @ weight.T + bias, target), in fp32, without ever
    holding more than one chunk of logits."""
    x, targets = x.flatten(0, -2), targets.flatten()
    keep = targets != IGNORE
    x, targets = x[keep], targets[keep]  # only labelled positions need logits
    dtype = _compute_dtype(x, weight)
    if targets.numel() == 0:  # nothing labelled: zero, still connected to the inputs (DDP expects grads)
        return (x.sum() * 0 + weight[:1].sum() * 0).float()
    with torch.autocast(x.device.type, enabled=False):
        if impl in ("liger", "cut_cross_entropy"):
            xc, w = x.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            if impl == "liger":
                from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

                out = liger_fused_linear_cross_entropy(
                    xc, w, targets, bias=b, ignore_index=IGNORE, reduction="sum"
                )
                return (out[0] if isinstance(out, tuple) else out).float()
            from cut_cross_entropy import linear_cross_entropy

            return linear_cross_entropy(xc, w, targets, bias=b, ignore_index=IGNORE, reduction="sum").float()
        grads = torch.is_grad_enabled()
        return ChunkedLinearCrossEntropy.apply(
            x, weight, bias, targets, rows_per_chunk(weight.shape[0]), dtype, grads
        )


class _HeadComputesLoss:
    """While open, the first call of the output head with inputs of the targets' shape returns the summed
    loss of those targets instead of logits. The head is called by the model's own forward, so every
    hook around it (DeepSpeed ZeRO-3 gathers, FSDP2 unshards) runs as for logits."""

    def __init__(self, heads: list[torch.nn.Module], targets: torch.Tensor, impl: str):
        self.heads, self.targets, self.impl = heads, targets, impl
        self.result: torch.Tensor | None = None
        self._saved: list = []

    def _forward_of(self, head):
        original = head.__dict__.get("forward") or type(head).forward.__get__(head)

        def forward(x, *args, **kwargs):
            if (
                self.result is not None
                or args
                or kwargs
                or x.shape[:-1] != self.targets.shape
                or is_dtensor(head.weight)
            ):
                return original(x, *args, **kwargs)
            self.result = linear_loss_sum(x, head.weight, head.bias, self.targets, self.impl)
            return self.result

        return forward

    def __enter__(self):
        for head in self.heads:
            self._saved.append((head, head.__dict__.get("forward")))
            head.forward = self._forward_of(head)
        return self

    def __exit__(self, *exc):
        for head, before in self._saved:
            if before is None:
                del head.forward
            else:
                head.forward = before
        self._saved.clear()
        return False


def _full_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of every position's logits against its target (IGNORE where none)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def targets_of(batch: dict) -> torch.Tensor:
    """The label each position predicts: label t+1 at position t (IGNORE at the end), or a split
    sequence's shard's `shift_labels`, shifted before the split (training.parallel.sequence_parallel)."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)


def token_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(summed next-token cross-entropy over labelled tokens, how many there were, the model's outputs).

    On the chunked path the outputs carry no logits (`outputs.logits` is None): none were made."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    targets = targets_of(batch)
    n_labels = (targets != IGNORE).sum()
    choice = loss_choice(model)
    if choice.impl == "full":
        outputs = model(**inputs)
        return _full_loss(outputs.logits, targets), n_labels, outputs

    with _HeadComputesLoss(choice.heads, targets, choice.impl) as probe:
        outputs = model(**inputs)
    loss = outputs.logits
    if probe.result is None:  # the head made logits after all (e.g. a DTensor head met only at run time)
        if not getattr(choice, "warned", False):
            log.warning("loss: the output head made logits in this forward; the loss is computed from them")
            choice.warned = True
        return _full_loss(loss, targets), n_labels, outputs
    if loss is None or loss.dim() != 0 or loss.data_ptr() != probe.result.data_ptr():
        # the model changed its head's output before returning it: the loss is not the model's objective
        why = "the model changes its output head's result before returning it as logits"
        log.warning("loss: switching to the full-logits loss: %s", why)
        setattr(inner_module(model), _CHOICE_ATTR, LossChoice("full", why))
        return token_loss(model, batch)
    outputs["logits"] = None
    return loss, n_labels, outputs


# ----------------------------------------------------------------------------- as an objective


@dataclass
class NextToken:
    """Supervised next-token training (pretraining, SFT) as a training.objectives.base.Objective: the loss
    is the summed cross-entropy of the labelled tokens, normalised by the labelled tokens of the window."""

    accelerator: object  # its `reduce` and `device`
    mask_rows: Callable[[dict], dict]  # masks the rows accelerate repeats in the last eval batch

    def counts(self, window: list[dict]) -> torch.Tensor:
        counts = torch.stack([sum(labelled_tokens(b) for b in window), sum(real_tokens(b) for b in window)])
        return counts.to(self.accelerator.device)

    def start_window(self, model, window: list[dict], step: int = 0) -> NextToken:
        return self

    def loss(self, model, batch: dict, i: int):
        return token_loss(model, batch)

    def trained_batches(self, window: list[dict]) -> list[dict]:
        return window

    def step_metrics(self) -> dict:
        return {}

    @torch.no_grad()
    def eval_sums(self, model, batches, split: str, balance) -> torch.Tensor:
        """(summed loss, labelled tokens) over `batches` and every rank (samples repeated to even out the
        last batch counted once)."""
        acc = self.accelerator
        total = torch.zeros(2, device=acc.device, dtype=torch.float64)
        for batch in batches:
            batch = self.mask_rows(batch)  # no double-counted samples
            s, n, outputs = token_loss(model, batch)
            total += torch.stack([s.double(), n.double()])
            balance.observe(outputs, batch, evaluating=True)
        return acc.reduce(total, "sum")

    @staticmethod
    def eval_row(total: torch.Tensor, suffix: str = "") -> dict:
        loss = (total[0] / total[1].clamp(min=1)).item()
        return {f"eval_loss{suffix}": loss, f"eval_ppl{suffix}": math.exp(min(loss, 50))}

    @staticmethod
    def eval_line(row: dict) -> str:
        return f"eval loss {row['eval_loss']:.4f} (perplexity {row['eval_ppl']:.2f})"


register(
    ObjectiveKind(
        "next_token",
        applies=lambda recipe: True,
        build=lambda c: NextToken(c.accelerator, c.mask_rows),
        priority=0,
    )
)
