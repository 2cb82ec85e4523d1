"""Tokenizer and model builders: pretrained (local dir, hub name, GGUF, bundled SmolLM2) or from scratch,
with the method's adapters (training.model.adapters) and the recipe's speed transforms (Liger, torch.compile)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.initialization import no_init_weights

from training.config import Architecture, Recipe
from training.core.dtypes import DTYPES
from training.core.errors import RecipeError
from training.model.adapters import add_lora, loading_kwargs
from training.model.attention import VARLEN_SDPA, packing_refusal, use_varlen_sdpa
from training.model.offload import ActivationOffload
from training.model.offload import install as install_offload
from training.model.qat import apply_qat
from training.model.rope import scale_rope, warn_past_context
from training.model.tiled_mlp import apply_tiled_mlp
from training.model.vision import (
    checkpoint_config,
    image_text_config,
    image_text_lora_targets,
    new_image_text_model,
    pretrained_image_text_model,
)
from training.run.sources import load_refusal, pretrained_source

log = logging.getLogger(__name__)


def pick_attention(requested: str, device: torch.device) -> str:
    flash_attn = importlib.util.find_spec("flash_attn") is not None
    if requested != "auto":
        if requested == "flash_attention_2" and (device.type != "cuda" or not flash_attn):
            raise RecipeError(
                "model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package; use sdpa (or auto)"
            )
        return requested
    if device.type == "cuda" and flash_attn:
        return "flash_attention_2"
    return "sdpa"


def from_scratch_config(arch: Architecture, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    """The transformers config of a new model of `arch.type`, sized for the tokenizer's vocabulary."""
    return AutoConfig.for_model(
        arch.type,
        **arch.config_kwargs(arch.vocab_size or len(tokenizer)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(
    recipe: Recipe, tokenizer: PreTrainedTokenizerBase, device: torch.device, *, hollow: bool = False
):
    """The model to train: pretrained or new, quantized and adapted as the recipe's method says.

    hollow=True (FSDP's lean start, training.parallel.lean_start): the parameters are left on the
    meta device, taking no memory, and buffers are real. A pretrained model's weights are then not read
    (the main process reads them and sends each process its shards in `accelerator.prepare`); a new
    model is not initialised (each process initialises its own shards after sharding,
    training.parallel.init_shards_from_scratch, with the same values as here)."""
    cfg = recipe.model
    attn = pick_attention(cfg.attn_implementation, device)
    if cfg.attn_implementation == "auto" and attn == "sdpa":
        attn = None  # transformers' own default: SDPA where the class has it, else eager (Inkling2, HunYuan-V4-VL)
    if recipe.image_text_checkpoint:  # never hollow: lean_start leaves image-text models to the plain start
        model = pretrained_image_text_model(recipe, device, attn)
    elif recipe.composes_image_text:
        model = new_image_text_model(recipe, tokenizer, text_config(recipe, tokenizer), attn)
    elif cfg.from_scratch is not None:
        model = new_model(recipe, tokenizer, attn, hollow)
    else:
        model = pretrained_model(recipe, device, attn, hollow)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        if hollow:  # shapes only: the values come from the main process's (mean-resized) embeddings
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        else:
            model.resize_token_embeddings(len(tokenizer))
    if cfg.liger_kernels:
        apply_liger(model)
    if recipe.data.packing and (why := packing_refusal(model)):
        raise RecipeError(f"data.packing: {why}")
    if recipe.data.packing and use_varlen_sdpa(model):
        log.info("attention: %s for packed rows (one causal SDPA call per example, no padding)", VARLEN_SDPA)
    model.config.use_cache = False  # training needs no KV cache (and one disables packed-sequence masks)
    if recipe.trains_reward_model and model.config.pad_token_id is None:  # where the score is read
        model.config.pad_token_id = tokenizer.pad_token_id
    warn_past_context(model.config, recipe.data.max_length, cfg.rope_scaling)
    apply_sequence_memory(model, recipe, device)
    if recipe.method.qat is not None:  # full training: the linear layers fake-quantized (torchao)
        apply_qat(model, recipe, device)
    if recipe.method.type in ("lora", "qlora"):
        targets = image_text_lora_targets(model, recipe) if recipe.image_text_checkpoint else None
        model = add_lora(model, recipe, targets)
    if recipe.train.torch_compile:
        apply_compile(model)
    return model


def apply_sequence_memory(model, recipe: Recipe, device: torch.device) -> None:
    """What bounds the activations of long sequences, as the recipe's model section asks: gradient
    checkpointing, the tiled MLP (training.model.tiled_mlp), activation offloading (training.model.offload;
    the refusal table refuses it without CUDA)."""
    cfg = recipe.model
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.tiled_mlp:
        apply_tiled_mlp(model, cfg.tiled_mlp)
    if cfg.activation_offloading:
        install_offload(model, ActivationOffload())
        log.info(
            "activation offloading: the tensors saved for the backward%s go to pinned host memory",
            " (each checkpointed layer's input)" if cfg.gradient_checkpointing else "",
        )


def text_config(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    """The language model's config: new (model.from_scratch) or the pretrained one's."""
    if recipe.model.from_scratch is not None:
        return from_scratch_config(recipe.model.from_scratch, tokenizer)
    return checkpoint_config(recipe)


def model_class(recipe: Recipe):
    """AutoModelForCausalLM, or for a reward model (preference.objective=reward) the same architecture with a
    one-score head (AutoModelForSequenceClassification: num_labels 1, scored at the last real token)."""
    return AutoModelForSequenceClassification if recipe.trains_reward_model else AutoModelForCausalLM


def head_kwargs(recipe: Recipe) -> dict:
    return {"num_labels": 1} if recipe.trains_reward_model else {}


def new_model(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, attn: str, hollow: bool):
    """A model built from scratch from the recipe's architecture (random init, or none when hollow)."""
    config = from_scratch_config(recipe.model.from_scratch, tokenizer)
    if recipe.trains_reward_model:
        config.num_labels = 1
    # Initialised in one pass after construction, not also by each torch layer's own constructor:
    # the random stream is then transformers' module-by-module `_init_weights` walk alone, which
    # init_shards_from_scratch replays one module at a time on sharded models.
    with no_init_weights(), params_on_meta(hollow):
        model = model_class(recipe).from_config(
            config, dtype=DTYPES[recipe.model.dtype], attn_implementation=attn
        )
    if hollow:
        model._llm_forge_init_rng = torch.get_rng_state()  # where the walk starts (as below)
        model.tie_weights()
    else:
        model.init_weights()  # what from_config's post_init does: initialise, then tie
    return model


def pretrained_model(recipe: Recipe, device: torch.device, attn: str, hollow: bool):
    """The recipe's pretrained model, loaded (quantized as the method says), or hollow: its config's
    model with parameters on the meta device."""
    cfg, dtype = recipe.model, DTYPES[recipe.model.dtype]
    src = pretrained_source(cfg.name_or_path)
    config = pretrained_config(recipe, src)
    try:
        if hollow:
            with no_init_weights(), params_on_meta(True):
                model = model_class(recipe).from_config(
                    config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
                )
            model.tie_weights()
            return model
        kwargs = dict(
            config=config,
            dtype=dtype,
            attn_implementation=attn,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
        )
        return model_class(recipe).from_pretrained(src, **kwargs, **loading_kwargs(recipe, device))
    except (OSError, ValueError) as e:  # a missing file, or an attention its class does not have
        raise load_refusal(src, attn, e) from None


def pretrained_config(recipe: Recipe, src: str):
    """The pretrained model's config, with the recipe's RoPE scaling (training.model.rope) when set."""
    cfg = recipe.model
    try:
        config = AutoConfig.from_pretrained(
            src, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, **head_kwargs(recipe)
        )
    except OSError as e:
        raise load_refusal(src, None, e) from None
    if cfg.rope_scaling is not None:
        scale_rope(config, cfg.rope_scaling)
    return config


def load_teacher(recipe: Recipe, device: torch.device):
    """distill.teacher, whole (never sharded or quantised) in the student's dtype, in eval mode, frozen."""
    name = recipe.distill.teacher
    src = pretrained_source(name)
    try:
        teacher = AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[recipe.model.dtype])
    except (OSError, ValueError) as e:
        raise RecipeError(f"distill.teacher: cannot load {name!r} ({str(e).splitlines()[0]})") from None
    teacher.config.use_cache = False
    return teacher.to(device).eval().requires_grad_(False)


def teacher_vocab_size(recipe: Recipe) -> int:
    """How many tokens distill.teacher scores, from its config (the teacher itself is not loaded)."""
    name = recipe.distill.teacher
    try:
        config = AutoConfig.from_pretrained(pretrained_source(name))
    except (OSError, ValueError) as e:
        raise RecipeError(f"distill.teacher: cannot load {name!r} ({str(e).splitlines()[0]})") from None
    return getattr(config.get_text_config(), "vocab_size", 0)


def teacher_fingerprint(name: str) -> list:
    """What a teacher's outputs depend on, read without loading it: its source and the name, size and
    modification time of every file of its directory (for a hub name, of its snapshot in the hub cache;
    the name alone when none is there)."""
    src = pretrained_source(name)
    path = Path(src)
    if not path.is_dir():
        try:
            path = Path(snapshot_download(src, local_files_only=True))
        except (
            OSError,
            ValueError,
        ):  # not in the local hub cache (huggingface_hub's LocalEntryNotFoundError)
            return [src]
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return [src, [[p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in files]]


def params_on_meta(enabled: bool = True):
    """While open, parameters are created on the meta device (no memory) and buffers normally, so that
    non-persistent buffers such as RoPE's inv_freq hold their real values (accelerate's
    init_empty_weights(include_buffers=False))."""
    return init_empty_weights(include_buffers=False) if enabled else contextlib.nullcontext()


def apply_liger(model) -> None:
    """Swap RMSNorm, RoPE and SwiGLU for Liger's fused kernels on this model instance.

    The training loop computes the loss from the logits, so Liger's (fused linear) cross entropy,
    which replaces the model's own loss computation, is left off.
    """
    # an optional GPU-only package (training.launch refuses the option without it)
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    log.info("Liger kernels applied (RMSNorm, RoPE, SwiGLU)")


def apply_compile(model) -> None:
    """torch.compile the model's forward in place (nn.Module.compile): the module, its state-dict keys
    and therefore checkpoints and exports stay exactly as without compilation."""
    model.compile()
    log.info("torch.compile enabled (inductor); the first steps include compilation time")


def full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter, wherever it lives: a DeepSpeed ZeRO-3 parameter is an empty
    tensor on each process outside its gathers (`ds_numel` is the real size); a DTensor (FSDP2, TP)
    reports its global shape, so numel() is already the whole."""
    return int(getattr(p, "ds_numel", None) or p.numel())


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) elements of the model's parameters, counted whole under sharded backends."""
    total = sum(full_numel(p) for p in model.parameters())
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    return trainable, total


def model_config_only(recipe: Recipe, tokenizer=None):
    """The transformers config of the recipe's model, without loading weights (a model built from scratch
    takes its vocabulary and special tokens from `tokenizer`, which it then needs)."""
    if recipe.model.from_scratch is not None or recipe.composes_image_text:
        if tokenizer is None:
            raise ValueError("model_config_only: a new or composed model needs the run's tokenizer")
        if recipe.composes_image_text:
            return image_text_config(recipe.model.vision, text_config(recipe, tokenizer), tokenizer)
        return from_scratch_config(recipe.model.from_scratch, tokenizer)
    src = pretrained_source(recipe.model.name_or_path)
    return AutoConfig.from_pretrained(src, trust_remote_code=recipe.model.trust_remote_code)
