"""The support matrix's image-text part: every type transformers registers as image-text-to-text, built tiny
from its own config class with a processor built here (no download), trained by the trainer itself.

    python -m benchmarks.image_text_models [--types idefics3,qwen2_5_vl,...] [--out docs/models.md]

The config class's defaults are shrunk as the text matrix shrinks them (benchmarks.models.shrink), in every
sub-config (the language model's and the vision encoder's), and the encoder's picture to IMAGE x IMAGE
pixels in PATCH x PATCH patches (VISION); a family that needs more says so in OVERRIDES, with the reason.
The processor is the type's own processor class with its PIL image processor at that size and the bundled
SmolLM2 tokenizer, the tokens the processor names added (and those it reads from the tokenizer by name), its
sizes from the tiny config (processor_kwargs); its chat template is one generic template that writes an image
part as the family's own templates do (the image token, Qwen's or HunYuan's markers around it, Gemma 3's
start-of-image). A type whose processor cannot be built so is `no: needs a processor we cannot build
offline: <why>`; one whose own save_pretrained does not load back in transformers says so.
Saved as a checkpoint (model and processor), each type then runs through training.train on two chat
records of the bundled picture task (data/shapes), one image each:
  lora    method.lora (the adapters on the language model, the projector whole), 3 steps: finite losses,
          the adapters moved
  full    full fine-tuning, 3 steps: finite losses, the weights moved
  reload  both runs' final/ load in plain transformers (AutoModelForImageTextToText and AutoProcessor, with
          peft for the adapter) and give the logits the trained model gave on a training prompt
A refusal the trainer gives (exit 2 with its reason) is `no (refused): <reason>`.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import logging
import math
import os
import re
import resource
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
import yaml
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedConfig,
)
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from benchmarks import models
from benchmarks.common import machine
from benchmarks.models import ROOT, Row, get, put, shrink

CHECKS = ("lora", "full", "reload")
IMAGE, PATCH = 32, 8  # each picture resized to 32 x 32: 4 x 4 patches
TOKENIZER = "bundled:smollm2-135m-instruct"
SHAPES = ROOT / "data/shapes"
# the vision encoder's sizes, under its config's names (set where the default config has the attribute)
VISION = (
    (IMAGE, ("image_size",)),
    (PATCH, ("patch_size",)),
    (2, ("depth", "spatial_merge_size", "merge_size", "temporal_patch_size")),
    (4 * PATCH, ("window_size",)),  # Qwen2.5-VL's windows: 2 x 2 merged patches
)
OUT_WIDTH = ("out_hidden_size", "text_hidden_size", "projection_dim")  # the encoder's output: the LM's width
# Families whose config, tokenizer or processor needs more than the generic shrink (each with why).
OVERRIDES: dict[str, dict] = {
    # 4 x 4 patches pooled to 2 x 2 image tokens (the default pools 64 x 64 to 16 x 16)
    "gemma3": {"mm_tokens_per_image": 4},
    # Qwen2.5-VL's encoder attends whole in the listed blocks, windowed in the others (block 1 of 2)
    "qwen2_5_vl": {"vision_config.fullatt_block_indexes": [1]},
    # Idefics3's connector folds scale_factor^2 patches into one token: 16 patches -> 4 tokens
    "idefics3": {"scale_factor": 2},
    "smolvlm": {"scale_factor": 2},
    # VipLLaVA reads 5 encoder layers by index (-2, -5, -8, -11, 6): the 2 of the tiny encoder's
    "vipllava": {"vision_feature_layers": [-2, -1]},
    "shieldgemma2": {"mm_tokens_per_image": 4},  # Gemma 3's, as above
}
# Processor arguments the type needs at this size (each with why).
PROCESSOR_KWARGS: dict[str, dict] = {
    "idefics3": {"image_seq_len": 4},  # the tokens per picture the connector makes (scale_factor 2)
    "smolvlm": {"image_seq_len": 4},
    "granite_docling": {"image_seq_len": 1},  # its connector's scale_factor 4: 16 patches -> 1 token
    "vipllava": {"vision_feature_select_strategy": "default"},  # its config has none; the model drops CLS
}
# Tokens a processor reads from the tokenizer by name, as the family's tokenizer spells them (any other that
# a processor asks for is added as <its name>: tiny_processor)
GEMMA3_TOKENS = {
    "image_token": "<image_soft_token>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
}
NAMED_TOKENS: dict[str, dict] = {"gemma3": GEMMA3_TOKENS, "shieldgemma2": GEMMA3_TOKENS}
# A generic chat template: string contents as they are, an image part as IMAGE_PART (the family's own
# templates write it so), then the text parts.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ IMAGE_PART }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


TOKEN_TYPES = ("str", "AddedToken")


class Unbuildable(Exception):
    """The type cannot be built tiny here, with why."""


def image_text_types() -> list[str]:
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def sub_configs(cfg) -> list:
    """cfg and every config inside it (text, vision, and deeper: an encoder's own sub-configs)."""
    out = [cfg]
    for value in vars(cfg).values():
        if isinstance(value, PreTrainedConfig):
            out += sub_configs(value)
    return out


def tiny_config(model_type: str):
    """The type's config, shrunk: every sub-config as the text matrix shrinks, the encoder's sizes (VISION)
    and its output to the language model's width, then OVERRIDES (a dotted name sets a sub-config's)."""
    cfg = AutoConfig.for_model(model_type)
    for sub in sub_configs(cfg):
        shrink(sub)
        for value, names in VISION:
            for name in names:
                if isinstance(get(sub, name), int):
                    put(sub, name, value)
    width = next(v for v, names in models.SHRINK.items() if "hidden_size" in names)
    for sub in sub_configs(cfg):
        for name in OUT_WIDTH:
            if isinstance(get(sub, name), int):
                put(sub, name, width)
    if isinstance(get(cfg, "image_grid_pinpoints"), list):  # LLaVA-NeXT's tiles: one, the picture's size
        put(cfg, "image_grid_pinpoints", [[IMAGE, IMAGE]])
    models.apply_overrides(cfg, model_type, OVERRIDES)
    cfg.use_cache = False
    return cfg


def tiny_tokenizer(named: dict[str, str], extra: list[str]):
    """The bundled tokenizer with `named` tokens (tokenizer.image_token, ...) and `extra` ones added."""
    from training.run.sources import pretrained_source

    tok = AutoTokenizer.from_pretrained(pretrained_source(TOKENIZER), extra_special_tokens=named or None)
    new = [t for t in dict.fromkeys([*named.values(), *extra]) if t and t not in tok.get_vocab()]
    if new:
        tok.add_special_tokens({"additional_special_tokens": new})
    return tok


def image_processor(model_type: str):
    """The type's PIL image processor at IMAGE x IMAGE pixels (no torchvision here), built with the sizes as
    arguments (so that they are saved)."""
    name = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type, {}).get("pil")
    if name is None:
        raise Unbuildable("its image processor needs torchvision, which is not installed")
    cls = getattr(transformers, name)
    default, kwargs = cls(), {}
    size = {k: v for k, v in dict(getattr(default, "size", None) or {}).items() if v is not None}
    if "shortest_edge" in size and size.get("longest_edge", 0) > 4096:  # Qwen2-VL's: pixels, not edges
        kwargs["size"] = {"shortest_edge": IMAGE * IMAGE, "longest_edge": IMAGE * IMAGE}
    elif size:
        kwargs["size"] = dict.fromkeys(size, IMAGE)
    for key in ("crop_size", "max_image_size", "high_res_size"):  # DeepSeek-VL-Hybrid's second encoder
        if getattr(default, key, None):
            kwargs[key] = {k: IMAGE for k, v in dict(getattr(default, key)).items() if v}
    for key, value in (("patch_size", PATCH), ("merge_size", 2), ("temporal_patch_size", 2)):
        if isinstance(getattr(default, key, None), int):
            kwargs[key] = value
    if getattr(default, "image_grid_pinpoints", None):
        kwargs["image_grid_pinpoints"] = [[IMAGE, IMAGE]]
    if "image_seq_length" in vars(default):  # PaliGemma's processor reads the tokens per picture here
        kwargs["image_seq_length"] = (IMAGE // PATCH) ** 2
    for key in ("do_image_splitting", "do_pan_and_scan"):
        if getattr(default, key, None):
            kwargs[key] = False
    return cls(**kwargs)


def processor_tokens(proc) -> list[str]:
    """The special tokens a processor names (image_token, boi_token, vision_start_token, ...)."""
    named = (
        str(v) for k, v in vars(proc).items() if k.endswith("_token") and type(v).__name__ in TOKEN_TYPES
    )
    return [t for t in named if t.startswith("<")]


def image_part(proc) -> str:
    """What the family's own chat templates write for an image part."""
    for start, end in (("vision_start_token", "vision_end_token"), ("image_start_token", "image_end_token")):
        if isinstance(getattr(proc, start, None), str) and isinstance(getattr(proc, end, None), str):
            return (
                f"{getattr(proc, start)}{proc.image_token}{getattr(proc, end)}"  # Qwen2-VL's kin, HunYuan-VL
            )
    return str(getattr(proc, "boi_token", None) or proc.image_token)  # Gemma 3: its start-of-image token


@contextlib.contextmanager
def unchecked_processor_classes():
    """transformers' check of each processor part's class looks the video processor up in a registry that
    needs torchvision (Qwen2-VL and its kin, even with no video processor): skipped while building here, so
    the checkpoint is written as the Hub has it and the trainer's loader gives its own answer."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


# what a processor says when it reads a token from the tokenizer by name (tokenizer.image_token, ...)
NAMED = re.compile(r"has no attribute '?(\w+?)(?:_id)?'?$|missing required attribute '(\w+?)(?:_id)?'")


def processor_kwargs(model_type: str, cls, cfg) -> dict:
    """The arguments the processor class takes that the tiny model decides (LLaVA's patch size and feature
    strategy, the tokens per picture), then PROCESSOR_KWARGS."""
    params = inspect.signature(cls.__init__).parameters
    strategy = get(cfg, "vision_feature_select_strategy")
    clip = "clip" in str(get(get(cfg, "vision_config"), "model_type"))  # CLIP's encoder adds a CLS token
    derived = {
        "video_processor": None,  # transformers' video processors need torchvision
        "patch_size": PATCH,
        "vision_feature_select_strategy": strategy,
        "num_additional_image_tokens": int(clip),
        "image_seq_length": get(cfg, "mm_tokens_per_image") or (IMAGE // PATCH) ** 2,
        "num_image_tokens": (IMAGE // PATCH) ** 2,
        "img_size": IMAGE,  # Aya Vision's tiles
        "downsample_factor": get(cfg, "downsample_factor"),
    }
    kwargs = {k: v for k, v in derived.items() if k in params and (v is not None or k == "video_processor")}
    return {**kwargs, **PROCESSOR_KWARGS.get(model_type, {})}


def tiny_processor(model_type: str, cfg):
    """The type's processor class with its PIL image processor at IMAGE pixels and the bundled tokenizer,
    the tokens it names added: those it reads from the tokenizer by name (tried again with each), then
    those it holds (built once more, so that their ids are in the vocabulary)."""
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if name is None:
        raise Unbuildable("transformers registers no processor class for it")
    cls = getattr(transformers, name)
    kwargs, named, extra = processor_kwargs(model_type, cls, cfg), dict(NAMED_TOKENS.get(model_type, {})), []
    for attempt in range(10):
        tok = tiny_tokenizer(named, extra)
        try:
            with unchecked_processor_classes():
                proc = cls(image_processor=image_processor(model_type), tokenizer=tok, **kwargs)
        except Unbuildable:
            raise
        except Exception as e:  # noqa: BLE001 (the cell says what the class said)
            why = str(e).splitlines()[0][:120] if str(e) else ""
            wanted = NAMED.search(why)
            if wanted and attempt < 8 and isinstance(e, AttributeError | ValueError):
                token = wanted.group(1) or wanted.group(2)
                named[token] = f"<{token}>"
                continue
            raise Unbuildable(f"{name}: {type(e).__name__}: {why}") from None
        if extra:
            break
        extra = processor_tokens(proc) or [""]
    if not isinstance(getattr(proc, "image_token", None), str):
        raise Unbuildable(f"{name} names no image_token")
    proc.chat_template = TEMPLATE.replace("IMAGE_PART", repr(image_part(proc)))
    return proc


def token_id(tok, proc, stem: str) -> int | None:
    """The id of the processor's `stem` token (image_token, ...): the tokenizer's named one first (Gemma 3's
    processor calls its start-of-image token image_token), then the id the processor holds (Aya Vision's
    image_token_id is its patch token's), then its token's id."""
    if isinstance(get(tok, stem), str):
        return tok.convert_tokens_to_ids(get(tok, stem))
    if isinstance(get(proc, f"{stem}_id"), int):
        return get(proc, f"{stem}_id")
    return tok.convert_tokens_to_ids(get(proc, stem)) if isinstance(get(proc, stem), str) else None


def token_ids(cfg, proc) -> None:
    """The config's special token ids set to the processor's tokens (image_token_id <- image_token, ...);
    its vocabulary to the tokenizer's."""
    tok, vocab = proc.tokenizer, len(proc.tokenizer)
    for sub in sub_configs(cfg):
        if isinstance(get(sub, "vocab_size"), int) and get(sub, "vocab_size") == 256:
            put(sub, "vocab_size", vocab)
        for name in list(sub.to_dict()):
            stem = name.removesuffix("_id").removesuffix("_index")
            if stem != name and stem.endswith("_token") and (token := token_id(tok, proc, stem)) is not None:
                put(sub, name, token)
    for sub in sub_configs(cfg):
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(get(sub, name), int):
                put(sub, name, getattr(tok, name))


def checkpoint(model_type: str, path: Path) -> tuple[Path, object]:
    """The tiny model (random weights, seeded) and its processor, saved as a checkpoint in `path`; (path,
    the processor)."""
    cfg = tiny_config(model_type)
    proc = tiny_processor(model_type, cfg)
    token_ids(cfg, proc)
    torch.manual_seed(0)
    try:
        model = AutoModelForImageTextToText.from_config(cfg)
    except Exception as e:  # noqa: BLE001
        why = str(e).splitlines()[0][:120] if str(e) else ""
        raise Unbuildable(f"does not build tiny ({type(e).__name__}: {why})") from None
    model.float().save_pretrained(path)
    _, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    if info["missing_keys"]:  # transformers' own round trip, before the trainer sees it
        missing = sorted(info["missing_keys"])
        raise Unbuildable(
            f"does not load its own save_pretrained ({len(missing)} weights missing: {missing[0]})"
        )
    try:
        proc.save_pretrained(path)
    except (
        AttributeError
    ):  # a processor without its video part (Qwen2-VL's kin): its parts, as the Hub has them
        proc.image_processor.save_pretrained(path)
        proc.tokenizer.save_pretrained(path)
        (path / "chat_template.jinja").write_text(proc.chat_template)
        (path / "processor_config.json").write_text(json.dumps({"processor_class": type(proc).__name__}))
    return path, proc


def records(path: Path, n: int = 2) -> Path:
    """The first `n` records of the bundled picture task, their images named by absolute path."""
    rows = [json.loads(line) for line in (SHAPES / "train.jsonl").read_text().splitlines()[:n]]
    for row in rows:
        part = row["messages"][0]["content"][0]
        part["image"] = str(SHAPES / part["image"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe(work: Path, ckpt: Path, method: str) -> Path:
    raw = {
        "output_dir": str(work / method),
        "seed": 0,
        "model": {"name_or_path": str(ckpt)},
        "method": {"type": method, **({"lora": {"r": 4}} if method == "lora" else {})},
        "data": {"train": str(records(work / "train.jsonl")), "format": "chat", "max_length": 200},
        "train": {"lr": 1e-2, "batch_size": 2, "max_steps": 3, "warmup_steps": 0},
        "eval": {"at_start": False},
    }
    path = work / f"{method}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def prompt_inputs(proc) -> dict:
    """The first training record's prompt (its user message, with its picture) as the processor makes it."""
    row = json.loads((SHAPES / "train.jsonl").read_text().splitlines()[0])
    user = row["messages"][0]
    text = proc.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    with Image.open(SHAPES / user["content"][0]["image"]) as im:
        try:
            return dict(proc(text=[text], images=[im.convert("RGB")], return_tensors="pt"))
        except ValueError:  # Florence-2's processor writes the image's tokens itself, before the text
            text = text.replace(image_part(proc), "")
            return dict(proc(text=[text], images=[im.convert("RGB")], return_tensors="pt"))


def train(recipe_path: Path, inputs: dict) -> tuple[int, str, torch.Tensor | None]:
    """training.train in this process: (exit code, its stderr, the trained model's logits on `inputs`, taken
    as the trainer writes final/)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    import training.loop.fit as fit
    from training.train import main

    seen: list[torch.Tensor] = []
    export = fit.export_final

    def export_and_look(run):
        model = run.executor.whole_model()
        with torch.no_grad():
            seen.append(model.eval()(**inputs).logits.float())
        return export(run)

    fit.export_final, err = export_and_look, io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main([str(recipe_path)])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        fit.export_final = export
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()
    return code, err.getvalue(), (seen[0] if seen else None)


def refusal(stderr: str) -> str:
    """The trainer's own `error: ...` line, else the last line of its output."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1] if lines else "")
    return said.removeprefix("error: ")[:200]


def losses(run: Path) -> list[float]:
    metrics = run / "metrics.jsonl"
    rows = map(json.loads, metrics.read_text().splitlines()) if metrics.is_file() else []
    return [r["loss"] for r in rows if "loss" in r]


def trained(work: Path, ckpt: Path, method: str, inputs: dict) -> tuple[str, torch.Tensor | None]:
    """(the lora/full cell, the trained model's logits on the prompt) of one run of the trainer."""
    code, stderr, logits = train(recipe(work, ckpt, method), inputs)
    said = refusal(stderr).replace(repr(str(ckpt)), "CHECKPOINT").replace(str(ckpt), "CHECKPOINT")
    said = said.replace(str(work), "WORK")  # the run's own files (its data) named without the temporary path
    if code == 2:
        return f"no (refused): {said}", None
    if code != 0:
        return f"no: exit {code}: {said}", None
    got = losses(work / method)
    if len(got) != 3 or not all(map(math.isfinite, got)):
        return f"no: losses {got}", logits
    final = work / method / "final"
    if method == "lora":
        adapter = load_file(final / "adapter_model.safetensors")
        moved = [k for k, v in adapter.items() if "lora_B" in k and v.abs().sum() > 0]  # B starts at zero
        return ("yes" if moved else "no: no adapter moved"), logits
    start, end = load_file(ckpt / "model.safetensors"), load_file(final / "model.safetensors")
    if set(start) != set(end):
        return f"no: final/ names other weights ({sorted(set(start) ^ set(end))[0]})", logits
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    return ("yes" if moved else "no: no weight moved"), logits


def reloaded(ckpt: Path, final: Path, inputs: dict, logits: torch.Tensor) -> str:
    """'' when final/ loads in plain transformers (and peft) with the same prompt and logits, else why not."""
    from peft import PeftModel

    again = AutoProcessor.from_pretrained(final)
    prompt = prompt_inputs(again)
    if not torch.equal(prompt["input_ids"], inputs["input_ids"]):
        return "final/'s processor writes another prompt"
    if (final / "adapter_config.json").is_file():
        model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(ckpt), final)
    else:
        model = AutoModelForImageTextToText.from_pretrained(final)
    with torch.no_grad():
        out = model.float().eval()(**inputs).logits.float()
    if not torch.allclose(out, logits, atol=1e-4):
        return f"logits differ by {float((out - logits).abs().max()):.2g}"
    return ""


def failed(e: Exception) -> str:
    return f"no: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def built(model_type: str, work: Path) -> tuple[Path, dict]:
    """(the checkpoint, the training prompt's inputs); Unbuildable says why not."""
    try:
        ckpt, proc = checkpoint(model_type, work / "checkpoint")
        return ckpt, prompt_inputs(proc)
    except Unbuildable as e:
        if str(e).startswith(("does not build", "does not load")):
            raise
        raise Unbuildable(f"needs a processor we cannot build offline: {e}") from None


def check_type(model_type: str, methods: tuple[str, ...] = ("lora", "full")) -> Row:
    """Every check on one type (the runs of `methods`); one that raises is a 'no' with the exception, never
    a crash."""
    row, start = Row(model_type), time.perf_counter()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        work = Path(d)
        try:
            ckpt, inputs = built(model_type, work)
        except Exception as e:  # noqa: BLE001
            why = f"no: {e}" if isinstance(e, Unbuildable) else failed(e)
            row.cells, row.seconds = dict.fromkeys(CHECKS, why), time.perf_counter() - start
            return row
        reload: dict[str, str] = {}  # method -> '' (equal) or why not
        for method in methods:
            try:
                row.cells[method], logits = trained(work, ckpt, method, inputs)
                if row.cells[method] == "yes":
                    reload[method] = reloaded(ckpt, work / method / "final", inputs, logits)
            except Exception as e:  # noqa: BLE001
                row.cells[method] = failed(e)
        row.cells["reload"] = reload_cell(reload)
    row.seconds = time.perf_counter() - start
    return row


def reload_cell(reload: dict[str, str]) -> str:
    if not reload:
        return "no: neither run trained"
    bad = [f"{m}: {why}" for m, why in reload.items() if why]
    if bad:
        return "no: " + "; ".join(bad)
    return "yes" if len(reload) == 2 else f"yes ({next(iter(reload))} only)"


def worker(types: list[str]) -> None:
    """Check `types` in this process, one JSON line each (benchmarks.models.run_isolated reads them), its
    memory capped as the text matrix's workers are."""
    resource.setrlimit(resource.RLIMIT_AS, (models.WORKER_MEMORY, models.WORKER_MEMORY))
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["LLM_FORGE_PRECISION_AUTO"] = "no"  # fp32 on every CPU, as the tests run
    for t in types:
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's progress: not a row
            row = check_type(t)
        print(
            models.ROW_PREFIX + json.dumps({"type": t, "cells": row.cells, "seconds": row.seconds}),
            flush=True,
        )


def markdown(rows: list[Row], seconds: float) -> str:
    totals = " | ".join(
        f"{sum(r.ok(c) for r in rows)} yes, {sum(r.answered(c) for r in rows)} refused" for c in CHECKS
    )
    lines = [
        models.IMAGE_TEXT_SECTION.strip(),
        "",
        "Written by `python -m benchmarks.image_text_models` (the checks are in its docstring): every type",
        "transformers registers as image-text-to-text, built tiny from its own config class with a processor",
        f"built offline, trained by `training.train`. {time.strftime('%Y-%m-%d')}, transformers "
        f"{transformers.__version__}, torch {torch.__version__}; {machine()}; {seconds / 60:.1f} min.",
        "",
        "`yes`: the check passed. `no (refused)`: the trainer stopped before training (exit 2), with its reason.",
        "`no:` anything else, as the check saw it; `needs a processor we cannot build offline` names what is",
        "missing (most often torchvision, which this machine does not have).",
        "",
        "| type | " + " | ".join(CHECKS) + " |",
        "|---|" + "---|" * len(CHECKS),
        f"| **all {len(rows)}** | {totals} |",
    ]
    for r in rows:
        lines.append(
            f"| {r.model_type} | " + " | ".join(r.cells.get(c, "").replace("|", "/") for c in CHECKS) + " |"
        )
    return "\n".join(lines) + "\n"


def write(out: Path, rows: list[Row], seconds: float) -> None:
    """The image-text section of `out` (docs/models.md) replaced, the text matrix before it kept; the rows
    in its .json beside the text matrix's, marked "part": "image-text"."""
    text = out.read_text().partition(models.IMAGE_TEXT_SECTION)[0] if out.is_file() else ""
    out.write_text(text.rstrip("\n") + "\n\n" + markdown(rows, seconds))
    js = out.with_suffix(".json")
    old = [r for r in json.loads(js.read_text()) if r.get("part") != "image-text"] if js.is_file() else []
    js.write_text(json.dumps(old + [{**vars(r), "part": "image-text"} for r in rows], indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.image_text_models", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--types", default="", help="comma-separated model types (default: every image-text type)"
    )
    ap.add_argument("--out", default=str(ROOT / "docs/models.md"))
    ap.add_argument("--limit-s", type=float, default=240, help="seconds one type may take")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker.split(","))
    types = [t for t in args.types.split(",") if t] or image_text_types()
    start = time.perf_counter()
    rows = models.run_isolated(types, args.limit_s, module="benchmarks.image_text_models", checks=CHECKS)
    write(Path(args.out), rows, time.perf_counter() - start)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
