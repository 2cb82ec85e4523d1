"""The optimizer named by `train.optimizer`.

    adamw              torch AdamW: fused on CUDA; elsewhere torch's default (one tensor at a time on CPU)
    adamw_8bit         bitsandbytes AdamW8bit: Adam moments stored in 8 bits (block-wise quantised)
    paged_adamw_8bit   the same, with state in paged (CUDA unified) memory that can spill to CPU RAM
    paged_adamw_32bit  bitsandbytes paged AdamW with 32-bit state
    muon               torch Muon for the hidden weight matrices, torch AdamW for the rest (`MuonWithAdamW`)

Weight decay applies to matrices only (not to biases and norm weights). bitsandbytes keeps 32-bit
state for tensors smaller than 4096 elements (its `min_8bit_size`), so small LoRA matrices get
little from the 8-bit variants; they pay off for full fine-tuning and large adapters.
Paged optimizers only page on CUDA; on CPU they run as ordinary optimizers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from training.config import TrainSection
from training.core.errors import RecipeError
from training.core.tensors import is_dtensor
from training.model.adapters import embedding_parameters

BNB_OPTIMIZERS = {
    "adamw_8bit": "AdamW8bit",
    "paged_adamw_8bit": "PagedAdamW8bit",
    "paged_adamw_32bit": "PagedAdamW32bit",
}

# Muon's learning-rate adjustment (torch.optim.Muon `adjust_lr_fn`): Moonshot's "match_rms_adamw" scales
# each matrix's orthogonalised update to the RMS of an AdamW update (0.2 * sqrt(max(rows, cols))), so that
# Muon runs at AdamW's train.lr and train.weight_decay ("Muon is Scalable for LLM Training", 2025): one
# learning rate and one schedule for both halves, no second lr to tune.
MUON_ADJUST_LR = "match_rms_adamw"
MUON_MOMENTUM = 0.95  # torch's and the authors' default (Nesterov momentum)


def _is_no_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or "norm" in name.lower()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _is_no_decay(name, p) else decay).append(p)
    if not decay and not no_decay:
        raise RecipeError(
            "the model has no trainable parameters (check method.type and method.lora.target_modules)"
        )
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for group in groups for g in _apart_from_dtensors(group)]


def _apart_from_dtensors(group: dict) -> list[dict]:
    """A group whose parameters mix DTensors (experts sharded by expert parallelism) and plain tensors,
    as two groups: torch's foreach kernels refuse the mix. Any other group unchanged."""
    sharded = [p for p in group["params"] if is_dtensor(p)]
    if not sharded or len(sharded) == len(group["params"]):
        return [group]
    plain = [p for p in group["params"] if not is_dtensor(p)]
    return [{**group, "params": plain}, {**group, "params": sharded}]


def muon_split(
    model: torch.nn.Module,
) -> tuple[list[torch.nn.Parameter], list[tuple[str, torch.nn.Parameter]]]:
    """(the trainable hidden weight matrices, which Muon updates; the other trainable parameters, by name,
    which AdamW updates), as Muon's authors prescribe: Muon orthogonalises the update of each 2-D matrix of
    the hidden layers; the input embedding and the output head (found by identity, tied or not), norm
    weights, biases and any non-2-D tensor (e.g. fused 3-D MoE experts) go to AdamW."""
    outer = {id(p) for p in embedding_parameters(model)}
    hidden, rest = [], []
    for name, p in model.named_parameters():  # unique tensors: a tied head appears once
        if not p.requires_grad:
            continue
        if p.ndim == 2 and id(p) not in outer and "norm" not in name.lower():
            hidden.append(p)
        else:
            rest.append((name, p))
    return hidden, rest


class _BothStates(Mapping):
    """The per-parameter state of optimizers over disjoint parameters, read as one: live (each
    load_state_dict gives an optimizer a new `state`) and never inserting (theirs are defaultdicts)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __getitem__(self, p):
        for o in self.optimizers:
            if p in o.state:
                return o.state[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator:
        return (p for o in self.optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizers)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the hidden matrices and torch.optim.AdamW over the rest, as one optimizer.

    Hand-written because neither torch (2.13) nor accelerate has a public composite optimizer (torch's
    Muon docs show two optimizers stepped side by side), while the loop, accelerate's wrapper and
    checkpointing, gradient clipping and the LR scheduler (a LambdaLR over `param_groups`) all expect
    one. `param_groups` are the two optimizers' own group dicts (Muon's first), so the scheduler scales
    both learning rates; `step` and `zero_grad` call both; `state_dict` is {"muon": ..., "adamw": ...},
    each the optimizer's own state dict (Muon's momentum buffers; AdamW's moments and step), so a
    checkpoint restores both exactly.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        # Optimizer.__init__ sets up hooks and zero_grad's profiling; the groups it builds are replaced
        super().__init__([p for o in (muon, adamw) for g in o.param_groups for p in g["params"]], {})
        self.state = _BothStates(muon, adamw)
        self._join_groups()

    def _join_groups(self) -> None:
        # in place: whoever holds the list (accelerate's wrapper reads it through) sees the new dicts
        self.param_groups[:] = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self._join_groups()  # load_state_dict gives each optimizer new group dicts


def build_muon(model: torch.nn.Module, t: TrainSection) -> MuonWithAdamW:
    hidden, rest = muon_split(model)
    if not hidden:
        raise RecipeError(
            "train.optimizer=muon: the model has no trainable hidden weight matrices for Muon; use adamw"
        )
    decay = [p for name, p in rest if not _is_no_decay(name, p)]
    no_decay = [p for name, p in rest if _is_no_decay(name, p)]
    muon = torch.optim.Muon(
        hidden,
        lr=t.lr,
        weight_decay=t.weight_decay,
        momentum=MUON_MOMENTUM,
        nesterov=True,
        adjust_lr_fn=MUON_ADJUST_LR,
    )
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=t.betas)
    return MuonWithAdamW(muon, adamw)


def build_optimizer(
    model: torch.nn.Module, t: TrainSection, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable parameters. `device` is where training will run
    (parameters may still be on CPU when this is called, before `accelerator.prepare`)."""
    if t.optimizer == "muon":
        return build_muon(model, t)
    groups = param_groups(model, t.weight_decay)
    kwargs = dict(lr=t.lr, betas=t.betas)
    if t.optimizer == "adamw":
        on_cuda = device is not None and device.type == "cuda"
        floating = all(p.is_floating_point() for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, fused=True if on_cuda and floating else None, **kwargs)
    import bitsandbytes as bnb

    return getattr(bnb.optim, BNB_OPTIMIZERS[t.optimizer])(groups, **kwargs)


# ----------------------------------------------------------------------------- the learning-rate schedule
# transformers' get_scheduler("cosine" | "linear" | "constant_with_warmup") formulas, step for step, as
# partials of module functions (what LambdaLR checkpoints, as before). Not imported from transformers:
# transformers.optimization imports the Trainer's utilities, which import peft, which imports
# bitsandbytes and torch's inductor: ~1.3 s of every process's start-up, for three one-line formulas.
# tests/unit/model/test_schedule.py checks them against transformers' own.


def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int, *, warmup: int, total: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


SCHEDULES = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainSection, total_steps: int) -> LambdaLR:
    """train.scheduler after a linear warm-up from 0 (train.warmup_steps, else warmup_ratio of the steps)."""
    warmup = t.warmup_steps or int(t.warmup_ratio * total_steps)
    scheduler = LambdaLR(optimizer, partial(SCHEDULES[t.scheduler], warmup=warmup, total=total_steps))
    scheduler.checkpoint_label = "the learning-rate schedule"  # named in resume's refusals
    return scheduler
