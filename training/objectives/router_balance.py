"""Mixture-of-Experts: the router's load-balancing loss, exact over the global batch, and expert load.

The loss is the Switch Transformer's (eq. 4-6), per MoE layer and averaged over the layers:

    aux = mean_l E * sum_i f_li * P_li
          f_li = share of layer l's top-k assignments that go to expert i (not differentiated)
          P_li = mean router probability of expert i in layer l, over the unpadded tokens

transformers' `load_balancing_loss_func` pools the layers instead (f and P over all (token, layer)
rows). A pooled loss is at its minimum when the layers collapse onto complementary experts: layer 1
sending every token to experts {0, 1} and layer 2 to {2, 3} gives a uniform pooled f, and with f
uniform the loss is the same whatever the probabilities, so nothing pulls a collapsed layer back
(seen: tiny Qwen3-MoE runs ending with every layer at the 2.0x maximum and the pooled loss at its
floor). Per layer, as in the Switch Transformer, Megatron-LM and DeepSeek-MoE, it does; with one MoE
layer the two are the same, which is what the tests compare with transformers' function.

Both f and P are means over the batch, so the loss is not a sum over tokens: per-rank (or
per-micro-batch) aux losses, averaged, are not the aux loss of one process seeing the global batch.
Here it is made exact. f is computed from the assignment counts of the whole global window (every
micro-batch of the step, every data-parallel rank; one all-reduce of an [L, E]-sized tensor before any
backward), and each micro-batch contributes mean_l E * sum_i f_li * (its own sum of layer l's router
probabilities of expert i) / T, with T the global count of real tokens. Those contributions sum to the
global aux loss, and since f carries no gradient, their gradients sum to the one-process gradient.
With one micro-batch per step the counts come from the step's own forward (reduced between forward
and backward); with several, a no-grad routing pass over the window counts them first (one extra
forward per micro-batch, only when the coefficient is not 0). Padding tokens (attention_mask 0) are
not counted.

Metrics (train rows and eval rows, `eval_` prefixed): `aux_loss` (the unweighted loss above) and the
expert load: per MoE layer, the busiest expert's assignments over the mean (1.0 = perfectly even,
E/top_k = every token to the same experts); `expert_load_max` is the worst layer's, `expert_load_layers`
all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from training.config import Recipe
from training.config.architectures import router_shape
from training.core.batch import IGNORE
from training.core.errors import RecipeError


def _config(model):
    base = getattr(model, "get_base_model", None)
    return (base() if base is not None else model).config


def router_balance(recipe: Recipe, model) -> RouterBalance | NoRouter:
    """The load-balancing loss and metrics of an MoE model (NoRouter for a dense one). It asks the model
    to return its router logits (restored before saving: `plain_router_outputs`)."""
    config = _config(model)
    coef = recipe.train.router_aux_loss_coef
    shape = router_shape(config)
    if shape is None:
        if coef:
            raise RecipeError(
                f"train.router_aux_loss_coef={coef}: {config.model_type} is a dense model (no experts, "
                f"no router); remove the key or use a Mixture-of-Experts model"
            )
        return NoRouter()
    if recipe.rl is not None or recipe.distill is not None:
        what = "rl" if recipe.rl is not None else "distill"
        raise RecipeError(
            f"{what} on a Mixture-of-Experts model ({config.model_type}): the router's load-balancing loss is "
            f"not computed with this objective yet; use a dense model, or train this one with SFT or preference "
            f"tuning"
        )
    if coef is None:
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    config._llm_forge_router_outputs = getattr(config, "output_router_logits", False)
    config.output_router_logits = True
    return RouterBalance(num_experts=shape[0], top_k=shape[1], coef=coef)


class plain_router_outputs:
    """While final/ is written: the config's own output_router_logits, not the training's True."""

    def __init__(self, model):
        self.config = _config(model)
        self.saved = getattr(self.config, "output_router_logits", None)

    def __enter__(self):
        if hasattr(self.config, "_llm_forge_router_outputs"):
            self.config.output_router_logits = self.config._llm_forge_router_outputs
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.config.output_router_logits = self.saved


def _rows_mask(batch: dict, rows: int, device, labelled_rows_only: bool = False) -> torch.Tensor:
    """1.0 for the router rows of real tokens, 0.0 for padding (rows = batch x sequence, flattened).
    labelled_rows_only (evaluation): also 0.0 for the samples whose labels are all masked, i.e. those
    accelerate repeats to fill the last batch (training.parallel.mask_repeated_rows)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.numel() != rows:  # padding-free rows: every token is real
        return torch.ones(rows, device=device)
    if labelled_rows_only and "labels" in batch:
        mask = mask * batch["labels"].ne(IGNORE).any(dim=1, keepdim=True)
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def route(router_logits, top_k: int, num_experts: int, mask: torch.Tensor):
    """(assignment counts [L, E] (no grad), summed router probabilities [L, E], real tokens counted).

    The same top-k of the softmax that transformers' routers and `load_balancing_loss_func` take."""
    counts, prob_sums = [], []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs.detach(), top_k, dim=-1).indices
        counts.append(
            torch.zeros(num_experts, device=probs.device).scatter_add_(
                0, chosen.reshape(-1), mask.repeat_interleave(top_k)
            )
        )
        prob_sums.append((probs * mask.unsqueeze(-1)).sum(dim=0))
    return torch.stack(counts), torch.stack(prob_sums), mask.sum()


def aux_loss(counts: torch.Tensor, prob_sum: torch.Tensor, tokens: float, num_experts: int) -> torch.Tensor:
    """mean_l E * sum_i f_li * P_li from global counts [L, E] and (a share of) summed probabilities [L, E]."""
    tokens = max(float(tokens), 1.0)
    f = counts.to(prob_sum.device) / tokens
    return num_experts * (f * prob_sum).sum() / (tokens * counts.shape[0])


def load_ratios(counts: torch.Tensor) -> list[float]:
    """Per layer: the busiest expert's assignments over the mean assignments per expert."""
    mean = counts.mean(dim=-1).clamp(min=1e-9)
    return (counts.max(dim=-1).values / mean).tolist()


def metrics(counts: torch.Tensor, prob_sum: torch.Tensor, tokens: float, num_experts: int, prefix: str = ""):
    """The metrics row of global counts [L, E], global summed probabilities [L, E] and global tokens."""
    aux = float(aux_loss(counts, prob_sum, tokens, num_experts))
    layers = load_ratios(counts)
    return {
        f"{prefix}aux_loss": aux,
        f"{prefix}expert_load_max": max(layers) if layers else float("nan"),
        f"{prefix}expert_load_layers": [round(x, 4) for x in layers],
    }


def _router_logits(outputs) -> tuple:
    logits = getattr(outputs, "router_logits", None)
    if not logits:
        raise RuntimeError("the MoE model returned no router logits (output_router_logits is not honoured)")
    return tuple(logits)


@dataclass
class RouterBalance:
    num_experts: int
    top_k: int
    coef: float

    def begin(self, accelerator, model, window: list[dict]) -> WindowBalance:
        """Start a step over `window`: with several micro-batches and a loss to add, the routing pass."""
        w = WindowBalance(self, accelerator)
        if self.coef > 0 and len(window) > 1:
            with torch.no_grad():
                for batch in window:
                    outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
                    logits = _router_logits(outputs)
                    counts, _, rows = route(logits, self.top_k, self.num_experts, self.mask(batch, logits))
                    w.local_counts += counts
                    w.local_rows += rows
            w.reduce_counts()
        return w

    def mask(self, batch: dict, logits: tuple, evaluating: bool = False) -> torch.Tensor:
        return _rows_mask(batch, logits[0].shape[0], logits[0].device, evaluating)


@dataclass
class WindowBalance:
    """One step's (or one evaluation's) router statistics."""

    spec: RouterBalance
    accelerator: object
    local_counts: torch.Tensor | float = 0.0
    local_rows: torch.Tensor | float = 0.0  # real tokens
    local_probs: torch.Tensor | float = 0.0
    counts: torch.Tensor | None = None  # global, once reduced
    rows: float | None = None  # global real tokens
    counted: bool = field(default=False)  # the routing pass counted the window already

    def reduce_counts(self) -> None:
        """One all-reduce: the global assignment counts and rows (collective)."""
        flat = torch.cat([self.local_counts.reshape(-1), torch.as_tensor(self.local_rows).reshape(1).float()])
        flat = self.accelerator.reduce(flat.to(self.accelerator.device), "sum")
        self.counts = flat[:-1].reshape(self.local_counts.shape).cpu()
        self.rows = float(flat[-1])
        self.counted = True

    def observe(self, outputs, batch: dict, evaluating: bool = False) -> torch.Tensor:
        """Count one micro-batch's routing; return its summed router probabilities [L, E] (with gradient)."""
        s = self.spec
        logits = _router_logits(outputs)
        counts, prob_sum, rows = route(logits, s.top_k, s.num_experts, s.mask(batch, logits, evaluating))
        self.local_probs = self.local_probs + prob_sum.detach()
        if not self.counted:
            self.local_counts = self.local_counts + counts
            self.local_rows = self.local_rows + rows
        return prob_sum

    def loss(self, outputs, batch: dict) -> torch.Tensor:
        """This micro-batch's share of coef * aux (to add to the normalised loss before backward)."""
        s = self.spec
        prob_sum = self.observe(outputs, batch)
        if s.coef == 0:
            return prob_sum.sum() * 0.0
        if self.counts is None:  # one micro-batch: its own forward counted the step (collective)
            self.reduce_counts()
        return s.coef * aux_loss(self.counts, prob_sum, self.rows, s.num_experts)

    def finish(self, prefix: str = "") -> dict:
        """The step's metrics (collective: one all-reduce, two when nothing was counted yet)."""
        if self.counts is None:
            if isinstance(self.local_counts, float):  # nothing routed (an empty evaluation)
                return {}
            self.reduce_counts()
        probs = self.accelerator.reduce(torch.as_tensor(self.local_probs).to(self.accelerator.device), "sum")
        return metrics(self.counts, probs.cpu(), self.rows, self.spec.num_experts, prefix)


class NoRouter:
    """A dense model's RouterBalance: nothing to balance, no metrics (so the step never asks which it has)."""

    def begin(self, accelerator, model, window: list[dict]) -> NoRouter:
        return self

    def observe(self, outputs, batch: dict, evaluating: bool = False) -> None:
        return None

    def loss(self, outputs, batch: dict) -> float:
        return 0.0  # added to the micro-batch's loss: x + 0.0 is x

    def finish(self, prefix: str = "") -> dict:
        return {}
