"""Preference tuning objectives: DPO, IPO, SimPO, ORPO and KTO on the batches of training.data.preference.

A batch holds two sequences per example, stacked [2B, L]: chosen over rejected (pairwise), or the
completion over KTO's mismatched KL completion (unpaired). For each sequence `sequence_logps` sums the
log-probabilities of its completion tokens (labels != IGNORE); SimPO, ORPO and IPO use the per-token
average. The loss functions below take those sums and return one loss per example; `the step (training.loop.step)
divides their sum by the number of examples in the global window, as it divides the SFT loss by the
number of labelled tokens, so gradient accumulation, DDP, ZeRO and FSDP give the one-process loss.

The reference model (DPO, IPO, KTO) is either
  adapter_disabled  the policy's own base under peft's `disable_adapter()` (LoRA/QLoRA: no second copy)
  precomputed       log-probabilities of every example computed once before training with the initial
                    weights (and before a checkpoint is loaded), kept in the run directory, looked up by
                    the row index: the reference never sits in memory during training, and under
                    ZeRO-3/FSDP it is computed by the sharded policy itself.
`reward` trains a reward model instead: the model is a sequence classifier with one score per sequence
(training.model.build.model_class), and the loss is the Bradley-Terry -log sigmoid(score chosen - score
rejected); its scores are the rewards in the metrics. Its final/ is what rl.rewards' reward_model reads.
Rewards are beta x (policy - reference) log-probabilities (SimPO/ORPO: beta x the average log-probability);
preference accuracy counts a tie (e.g. at step 0, where policy == reference) as half right, so it
starts at chance.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from training.config import PreferenceSection
from training.core.batch import IGNORE, real_tokens
from training.core.fs import write_atomic
from training.data.preference import PreferenceCollator
from training.model.logits import last_logits, scored_width
from training.objectives.base import kept_rows
from training.objectives.registry import ObjectiveContext, ObjectiveKind, register

log = logging.getLogger(__name__)

NON_MODEL_KEYS = ("labels", "row", "label")
# metric sums kept per step: index -> name
SUMS = ("loss", "reward_chosen", "n_chosen", "reward_rejected", "n_rejected", "correct", "n")


# ----------------------------------------------------------------------------- log-probabilities


def sequence_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's labelled tokens [N], how many there were [N]); the logits are
    made from the first labelled token on (the prompts' positions before it are not scored)."""
    width = scored_width(batch["labels"][:, 1:] != IGNORE)
    labels = batch["labels"][:, -width:]
    mask = labels != IGNORE
    logits = last_logits(model, width, **{k: v for k, v in batch.items() if k not in NON_MODEL_KEYS})
    logps = torch.log_softmax(logits.float(), dim=-1)
    per_token = torch.gather(logps, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(-1), mask.sum(-1)


def half(batch: dict, which: int) -> dict:
    """The first (0) or second (1) sequences of a preference batch, as a batch of their own."""
    b = batch["input_ids"].shape[0] // 2
    rows = slice(0, b) if which == 0 else slice(b, 2 * b)
    return {k: v[rows] for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}


# ----------------------------------------------------------------------------- the objectives


def dpo_loss(pc, pr, rc, rr, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7), with cDPO's label smoothing (probability eps of flipped labels)."""
    z = beta * ((pc - rc) - (pr - rr))
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def ipo_loss(pc, pr, rc, rr, nc, nr, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17) on per-token average log-ratios (TRL's normalisation, which the
    authors' results use): (h - 1/(2 tau))^2 with tau = beta."""
    h = (pc - rc) / nc.clamp(min=1) - (pr - rr) / nr.clamp(min=1)
    return (h - 1 / (2 * beta)) ** 2


def simpo_loss(pc, pr, nc, nr, beta: float, gamma: float) -> torch.Tensor:
    """SimPO (Meng et al. 2024, eq. 6): -log sigmoid(beta/|yw| log p(yw) - beta/|yl| log p(yl) - gamma)."""
    return -F.logsigmoid(beta * (pc / nc.clamp(min=1) - pr / nr.clamp(min=1)) - gamma)


def sequence_scores(model, batch: dict) -> torch.Tensor:
    """A reward model's score of each sequence [N]: its one-label head at the last real token (transformers'
    sequence classification reads it where the padding starts)."""
    out = model(**{k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}, use_cache=False)
    return out.logits.squeeze(-1).float()


def reward_loss(sc, sr, center: float) -> torch.Tensor:
    """The Bradley-Terry loss of a reward model (Ouyang et al. 2022, eq. 1; TRL's RewardTrainer):
    -log sigmoid(r_chosen - r_rejected), plus center x (r_chosen + r_rejected)^2 (TRL's
    center_rewards_coefficient), which keeps the scores near 0 without changing their order."""
    return -F.logsigmoid(sc - sr) + center * (sc + sr) ** 2


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both ends."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(pc, pr, nc, nr, beta: float) -> torch.Tensor:
    """ORPO (Hong et al. 2024, eq. 6-7): the chosen completion's average NLL - lambda log sigmoid(log odds
    ratio), with lambda = beta and the odds of the average (per-token) log-probabilities."""
    ac, ar = pc / nc.clamp(min=1), pr / nr.clamp(min=1)
    log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar))
    return -ac - beta * F.logsigmoid(log_odds)


def kto_loss(p, r, desirable, z0, beta: float, w_desirable: float, w_undesirable: float) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 8): w_d (1 - sigmoid(beta (r - z0))) for desirable examples,
    w_u (1 - sigmoid(beta (z0 - r))) for undesirable ones, r = policy - reference log-probability and
    z0 the (detached) KL reference point."""
    r_ = p - r
    good = w_desirable * (1 - torch.sigmoid(beta * (r_ - z0)))
    bad = w_undesirable * (1 - torch.sigmoid(beta * (z0 - r_)))
    return torch.where(desirable, good, bad)


def example_losses(cfg: PreferenceSection, pol, n, ref, label=None, z0=None):
    """(loss [B], reward of the first sequences [B], reward of the second [B]) from [2B] sums and counts."""
    b = pol.shape[0] // 2
    pc, pr, nc, nr = pol[:b], pol[b:], n[:b], n[b:]
    rc, rr = (ref[:b], ref[b:]) if ref is not None else (None, None)
    o, beta = cfg.objective, cfg.beta
    if o == "dpo":
        losses = dpo_loss(pc, pr, rc, rr, beta, cfg.label_smoothing)
    elif o == "ipo":
        losses = ipo_loss(pc, pr, rc, rr, nc, nr, beta)
    elif o == "simpo":
        losses = simpo_loss(pc, pr, nc, nr, beta, cfg.simpo_gamma)
    elif o == "orpo":
        losses = orpo_loss(pc, pr, nc, nr, beta)
    else:
        losses = kto_loss(pc, rc, label, z0, beta, cfg.desirable_weight, cfg.undesirable_weight)
    if cfg.needs_reference:
        return losses, beta * (pc - rc).detach(), beta * (pr - rr).detach()
    return losses, beta * (pc / nc.clamp(min=1)).detach(), beta * (pr / nr.clamp(min=1)).detach()


def metric_sums(cfg: PreferenceSection, losses, ra, rb, label=None) -> torch.Tensor:
    """The SUMS of one batch (float64). KTO: chosen = desirable examples, rejected = undesirable ones,
    and an example is right when its reward has the sign of its label."""
    losses = losses.detach().double()
    ra = ra.double()
    if cfg.objective == "kto":
        good = label.double()
        right = torch.where(label, (ra > 0).double(), (ra < 0).double()) + 0.5 * (ra == 0).double()
        return torch.stack(
            [
                losses.sum(),
                (ra * good).sum(),
                good.sum(),
                (ra * (1 - good)).sum(),
                (1 - good).sum(),
                right.sum(),
            ]
            + [torch.tensor(float(len(ra)), dtype=torch.float64, device=ra.device)]
        )
    rb = rb.double()
    right = (ra > rb).double() + 0.5 * (ra == rb).double()
    n = torch.tensor(float(len(ra)), dtype=torch.float64, device=ra.device)
    return torch.stack([losses.sum(), ra.sum(), n, rb.sum(), n, right.sum(), n])


def metrics_row(sums: torch.Tensor, prefix: str = "", suffix: str = "") -> dict:
    s = dict(zip(SUMS, sums.tolist()))
    chosen = s["reward_chosen"] / s["n_chosen"] if s["n_chosen"] else float("nan")
    rejected = s["reward_rejected"] / s["n_rejected"] if s["n_rejected"] else float("nan")
    return {
        f"{prefix}rewards_chosen{suffix}": chosen,
        f"{prefix}rewards_rejected{suffix}": rejected,
        f"{prefix}rewards_margin{suffix}": chosen - rejected,
        f"{prefix}preference_accuracy{suffix}": s["correct"] / max(s["n"], 1),
    }


# ----------------------------------------------------------------------------- the reference


class AdapterDisabled:
    """The reference is the policy's base: the same (prepared) model under peft's disable_adapter()."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    @torch.no_grad()
    def logps(self, model, batch: dict, split: str) -> torch.Tensor:
        with self.accelerator.unwrap_model(model).disable_adapter():
            return sequence_logps(model, batch)[0]


@dataclass
class Precomputed:
    """Reference log-probabilities of every row of each split, [N, 2] (first and second sequences)."""

    tables: dict[str, torch.Tensor] = field(default_factory=dict)

    def logps(self, model, batch: dict, split: str) -> torch.Tensor:
        t = self.tables[split].to(batch["input_ids"].device)[batch["row"]]
        return torch.cat([t[:, 0], t[:, 1]])


@torch.no_grad()
def reference_table(accelerator, dp: tuple[int, int], model, ds, batch_size: int, collate) -> torch.Tensor:
    """[N, 2] log-probabilities of every row of `ds` under `model` (in eval mode).

    Each data-parallel rank takes every world-th row (all ranks run the same number of forwards, as
    FSDP/ZeRO-3 need); the results are summed over ranks and divided by how often each row was done.
    """
    rank, size = dp  # (this rank's data-parallel index, data-parallel size)
    n = len(ds)
    mine = list(range(rank, n, size))
    per_rank = math.ceil(n / size)
    mine += [mine[-1] if mine else 0] * (per_rank - len(mine))
    device = accelerator.device
    table = torch.zeros(n, 2, dtype=torch.float64, device=device)
    seen = torch.zeros(n, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for start in range(0, per_rank, batch_size):
        idx = mine[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate([ds[i] for i in idx]).items()}
        s, _ = sequence_logps(model, batch)
        b = len(idx)
        rows = torch.tensor(idx, device=device)
        table.index_add_(0, rows, torch.stack([s[:b], s[b:]], dim=1).double())
        seen.index_add_(0, rows, torch.ones(b, dtype=torch.float64, device=device))
    model.train(was_training)
    table, seen = accelerator.reduce(table, "sum"), accelerator.reduce(seen, "sum")
    return (table / seen.clamp(min=1).unsqueeze(1)).float().cpu()


def precomputed_reference(
    run_dir, accelerator, dp: tuple[int, int], model, splits: dict, batch_size: int, collate
) -> Precomputed:
    """The run's precomputed reference: read from run_dir.reference_logps when it holds every split
    (a resumed run), else computed now from the model's initial weights and saved there."""
    path = run_dir.reference_logps
    sizes = {name: len(ds) for name, ds in splits.items()}
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if {k: len(v) for k, v in saved.items()} == sizes:
            log.info("reference log-probabilities: %s", path)
            return Precomputed(saved)
    tables = {
        name: reference_table(accelerator, dp, model, ds, batch_size, collate) for name, ds in splits.items()
    }
    if accelerator.is_main_process:
        import io

        buf = io.BytesIO()
        torch.save(tables, buf)
        write_atomic(path, buf.getvalue())
    accelerator.wait_for_everyone()
    log.info("reference log-probabilities of %s computed once and saved to %s", sizes, path)
    return Precomputed(tables)


# ----------------------------------------------------------------------------- in the loop


@dataclass
class PreferenceObjective:
    """Preference tuning as a training.objectives.base.Objective (see the module doc)."""

    cfg: PreferenceSection
    accelerator: object
    reference: AdapterDisabled | Precomputed | None
    mask_rows: Callable[[dict], dict]  # masks the rows accelerate repeats in the last eval batch
    sums: torch.Tensor | None = None  # this rank's SUMS over the current window
    _context: list = field(default_factory=list)

    def count(self, batch: dict) -> torch.Tensor:
        """Examples in a batch (the loss is normalised over those of the global window)."""
        return torch.tensor(batch["row"].shape[0], device=batch["row"].device)

    def counts(self, window: list[dict]) -> torch.Tensor:
        """[examples, real tokens] of this rank's micro-batches: the loss is a mean over the examples
        (pairs) of the global window."""
        counts = torch.stack([sum(self.count(b) for b in window), sum(real_tokens(b) for b in window)])
        return counts.to(self.accelerator.device, torch.float64)

    def start_window(
        self, model, window: list[dict], step: int = 0, split: str = "train"
    ) -> PreferenceObjective:
        """Reference log-probabilities of the window's batches and, for KTO, the KL reference point z0:
        the mean over the global window of policy - reference log-probabilities of the mismatched
        completions (detached, clamped at 0), so it does not depend on how the window is split."""
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.accelerator.device)
        refs = [self.reference.logps(model, b, split) if self.reference else None for b in window]
        z0 = None
        if self.cfg.objective == "kto":
            kl = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
            with torch.no_grad():
                for b, ref in zip(window, refs):
                    pol, _ = sequence_logps(model, half(b, 1))
                    k = ref.shape[0] // 2
                    kl += torch.stack(
                        [(pol - ref[k:]).double().sum(), torch.tensor(float(k), device=kl.device)]
                    )
            kl = self.accelerator.reduce(kl, "sum")
            z0 = (kl[0] / kl[1].clamp(min=1)).clamp(min=0).float()
        self._context = [(ref, z0) for ref in refs]
        return self

    def _score(self, model, batch: dict, i: int):
        ref, z0 = self._context[i]
        if self.cfg.objective == "reward":  # the rewards are the model's scores
            s = sequence_scores(model, batch)
            b = s.shape[0] // 2
            return reward_loss(s[:b], s[b:], self.cfg.center_rewards), s[:b].detach(), s[b:].detach()
        if self.cfg.objective == "kto":  # the mismatched half only feeds z0 (start_window)
            pol, n = sequence_logps(model, half(batch, 0))
            pol, n = torch.cat([pol, pol.detach()]), torch.cat([n, n])
        else:
            pol, n = sequence_logps(model, batch)
        return example_losses(self.cfg, pol, n, ref, batch.get("label"), z0)

    def loss(self, model, batch: dict, i: int) -> tuple[torch.Tensor, None, None]:
        """(summed loss over the batch's examples, None, None): the shape of loss.token_loss's result."""
        losses, ra, rb = self._score(model, batch, i)
        self.sums += metric_sums(self.cfg, losses, ra, rb, batch.get("label"))
        return losses.sum(), None, None

    def trained_batches(self, window: list[dict]) -> list[dict]:
        return window  # each batch holds both sequences of its pairs as rows

    def step_metrics(self) -> dict:
        """The window's reward metrics over every rank (a collective: call it on all ranks)."""
        return metrics_row(self.accelerator.reduce(self.sums, "sum"))

    @torch.no_grad()
    def eval_sums(self, model, batches, split: str, balance=None) -> torch.Tensor:
        """The SUMS over a held-out set's batches and every rank (the samples accelerate repeats to even
        out the last batch counted once); `split` names its precomputed reference table."""
        acc = self.accelerator
        total = torch.zeros(len(SUMS), dtype=torch.float64, device=acc.device)
        for batch in batches:
            keep = kept_rows(self.mask_rows, batch["row"])
            self.start_window(model, [batch], split=split)
            losses, ra, rb = self._score(model, batch, 0)
            label = batch["label"][keep] if "label" in batch else None
            total += metric_sums(self.cfg, losses[keep], ra[keep], rb[keep], label)
        return acc.reduce(total, "sum")

    @staticmethod
    def eval_row(total: torch.Tensor, suffix: str = "") -> dict:
        """eval_loss and the reward metrics of eval_sums' total (keys end in `suffix`)."""
        loss = (total[0] / total[6].clamp(min=1)).item()
        return {f"eval_loss{suffix}": loss, **metrics_row(total, "eval_", suffix)}

    @staticmethod
    def eval_line(row: dict) -> str:
        return f"eval loss {row['eval_loss']:.4f}, preference accuracy {row['eval_preference_accuracy']:.3f}"


def build_preference(c: ObjectiveContext) -> PreferenceObjective:
    """The recipe's objective with its reference (None for SimPO/ORPO). `c.dp` is (data-parallel rank, size);
    `c.mask_rows(batch)` masks the rows accelerate repeats to even out the last batch (both from the mesh)."""
    recipe, accelerator, cfg = c.recipe, c.accelerator, c.recipe.preference
    reference = None
    if cfg.needs_reference:
        how = cfg.reference
        if how == "auto":
            how = "adapter_disabled" if recipe.method.type in ("lora", "qlora") else "precomputed"
        if how == "adapter_disabled":
            reference = AdapterDisabled(accelerator)
        else:
            bs = recipe.eval_batch_size
            collate = PreferenceCollator(c.tokenizer.pad_token_id)
            reference = precomputed_reference(c.run_dir, accelerator, c.dp, c.model, c.splits, bs, collate)
        log.info("preference objective %s (beta %g), reference: %s", cfg.objective, cfg.beta, how)
    elif cfg.objective == "reward":
        log.info("preference objective reward: a reward model (one score per sequence), Bradley-Terry loss")
    else:
        log.info("preference objective %s (beta %g), reference-free", cfg.objective, cfg.beta)
    return PreferenceObjective(cfg, accelerator, reference, c.mask_rows)


register(
    ObjectiveKind(
        "preference",
        applies=lambda recipe: recipe.preference is not None,
        build=build_preference,
        priority=10,
    )
)
