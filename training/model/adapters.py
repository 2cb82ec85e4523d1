"""Fine-tuning methods on top of a loaded model: LoRA adapters (new, or continued from an earlier run)
and QLoRA's quantised base (bitsandbytes config, k-bit preparation).

Which methods a backend or machine refuses is decided in training.launch; this module builds what
the recipe asks for.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import BitsAndBytesConfig

from training.config import Recipe
from training.core.dtypes import DTYPES
from training.core.errors import RecipeError
from training.launch.backend import launched_backend
from training.model import lora_targets
from training.run.rundir import ADAPTER_CONFIG, resolve_source

log = logging.getLogger(__name__)


def quantization_config(recipe: Recipe) -> BitsAndBytesConfig:
    """The BitsAndBytesConfig for a QLoRA base (method.quantization)."""
    q = recipe.method.quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[recipe.quantization_compute_dtype],
        bnb_4bit_quant_storage=DTYPES.get(q.quant_storage, torch.uint8),
    )


def loading_kwargs(recipe: Recipe, device: torch.device) -> dict:
    """Extra from_pretrained arguments of the method: QLoRA loads its base quantised, on `device`
    (under FSDP/ZeRO-3 the backend places the shards itself)."""
    if recipe.method.type != "qlora":
        return {}
    kwargs = {"quantization_config": quantization_config(recipe)}
    if not launched_backend().shards_parameters:  # FSDP or ZeRO-3 split parameters as they load
        kwargs["device_map"] = {"": device}
    return kwargs


def lora_config(
    recipe: Recipe,
    model,
    targets: tuple[list[str], list[str]] | None = None,
    chosen: lora_targets.Targets | None = None,
):
    """peft's LoraConfig of method.lora; `targets`: (adapted modules, modules trained whole) where the
    model decides them (a pretrained image-text model: its language model's linear layers); `chosen`:
    lora_targets.resolve's answer for this model, where the caller has it already."""
    # peft imports bitsandbytes (seconds, and its start-up messages): only when adapters are built
    from peft import LoraConfig

    lc = recipe.method.lora
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    chosen = chosen or lora_targets.resolve(
        model, lc
    )  # all-linear on fused MoE experts: experts in, router out
    adapted, whole = targets or (chosen.modules, lc.modules_to_save)
    return LoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        lora_dropout=chosen.dropout,
        target_modules=adapted,
        target_parameters=chosen.parameters,  # e.g. an MoE model's fused expert weights
        use_rslora=lc.use_rslora,
        use_dora=lc.use_dora,
        modules_to_save=whole or None,
        ensure_weight_tying=bool(lc.modules_to_save) and tied,  # trained embed_tokens/lm_head stay one matrix
        # SEQ_CLS (a reward model): peft also trains and saves the new score head whole (modules_to_save)
        task_type="SEQ_CLS" if recipe.trains_reward_model else "CAUSAL_LM",
    )


def adapter_to_continue(init_from: str) -> Path:
    """The adapter directory that method.lora.init_from names: an adapter directory, or a run whose
    final/ is one."""
    source = resolve_source(init_from, what="method.lora.init_from", hub=False)
    if source.kind != "adapter":
        raise RecipeError(
            f"method.lora.init_from: {init_from} holds no {ADAPTER_CONFIG} (it is a {source.kind}; "
            "give a LoRA run directory or its final/ directory)"
        )
    return Path(source.path)


def add_lora(model, recipe: Recipe, targets: tuple[list[str], list[str]] | None = None):
    """Wrap the base in peft LoRA adapters (new ones, or method.lora.init_from's); only adapters train.

    QLoRA: prepare_model_for_kbit_training freezes the quantised base and upcasts the norms to fp32 for
    stable training; the input embedding and output head stay in the compute dtype unless
    method.quantization.embeddings_dtype=float32 (see kbit_prepared). A base stored for sharding
    (floating quant_storage) skips the upcast, because FSDP/ZeRO-3 need every parameter in one dtype.
    """
    from peft import PeftModel, get_peft_model  # see lora_config

    if recipe.method.type == "qlora":
        if recipe.method.quantization.quant_storage == "uint8":
            model = kbit_prepared(model, recipe)
        else:
            for p in model.parameters():
                p.requires_grad_(False)

    lc = recipe.method.lora
    if lc.init_from is not None:
        src = adapter_to_continue(lc.init_from)
        log.info("continuing the adapter in %s (its own rank/alpha/targets apply)", src)
        return inputs_left_to_autocast(PeftModel.from_pretrained(model, str(src), is_trainable=True), recipe)
    chosen = lora_targets.resolve(model, lc)
    if chosen.note:
        log.info("%s", chosen.note)
    try:
        model = get_peft_model(model, lora_config(recipe, model, targets, chosen))
    except ValueError as e:
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        names = sorted(linear)
        raise RecipeError(
            f"method.lora: {str(e).splitlines()[0]} (linear layers in this model: {', '.join(names)})"
        ) from None
    cov = lora_targets.coverage(model)
    lora_targets.check_experts_adapted(cov, lc)
    log.info("%s", cov.line())
    return inputs_left_to_autocast(model, recipe)


def inputs_left_to_autocast(model, recipe: Recipe):
    """`model` with its LoRA layers taking their input as it comes, where the run trains a fp32 base under a
    bf16/fp16 autocast. peft casts a half-precision input (the attention's output, the MLP's product) up to the
    adapter's fp32 for autocast to cast it straight back down: two copies of the activation each way, about a
    tenth of a LoRA step on a 2-core CPU. bf16 -> fp32 -> bf16 is exact, so the losses and gradients are the
    same bit for bit (tests/unit/model/test_adapters.py). Outside autocast every input of a fp32 base is fp32,
    so the cast never had anything to do there."""
    half = recipe.precision in ("bf16", "fp16") and recipe.method.type == "lora"
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if half and all(d == torch.float32 for d in floating):
        for module in model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    return model


def embedding_parameters(model) -> list[torch.nn.Parameter]:
    """The floating parameters of the input embedding and the output head (one, when tied)."""
    found = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        for p in module.parameters(recurse=False) if module is not None else ():
            if p.is_floating_point():
                found[id(p)] = p
    return list(found.values())


def kbit_prepared(model, recipe: Recipe):
    """peft's prepare_model_for_kbit_training, except that the input embedding and output head keep the
    compute dtype (method.quantization.embeddings_dtype=compute, the default).

    peft casts every unquantised half-precision parameter to fp32. For the embedding and head of a large
    vocabulary that doubles the biggest unquantised tensors (Llama-3-8B: 2 x 0.98 GiB in bf16 -> 3.9
    GiB) for no stability gain (the loss is computed in fp32 either way); norms keep peft's fp32. The two
    are set aside while peft casts (their data swapped for an empty fp32 tensor, so no fp32 copy is ever
    made), then cast to the compute dtype if they were loaded in another. Without autocast
    (precision=no) the head then gets its fp32 input cast to its dtype by a forward pre-hook.
    """
    from peft import prepare_model_for_kbit_training  # see lora_config

    q = recipe.method.quantization
    dtype = DTYPES[recipe.quantization_compute_dtype]
    keep = embedding_parameters(model) if q.embeddings_dtype == "compute" and dtype != torch.float32 else []
    saved = [(p, p.data) for p in keep]
    for p in keep:
        p.data = torch.empty(0, dtype=torch.float32, device=p.device)
    try:
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=recipe.model.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    finally:
        for p, data in saved:
            p.data = data
    for p in keep:
        p.data = p.data.to(dtype)
    head = model.get_output_embeddings()
    if keep and head is not None:
        head.register_forward_pre_hook(_input_in_weight_dtype)
    return model


def _input_in_weight_dtype(module, args):
    x = args[0]
    if torch.is_tensor(x) and x.is_floating_point() and x.dtype != module.weight.dtype:
        return (x.to(module.weight.dtype), *args[1:])
    return None
