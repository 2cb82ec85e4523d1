"""Chat with a run's result, a checkpoint, or any model.

    python -m training.chat RUN_DIR | RUN_DIR/final | RUN_DIR/checkpoints/step-N | MODEL [--prompt TEXT]

What a path is, is decided by training.run.rundir.resolve_source: a run directory resolves to its final/
(or its newest checkpoint if there is no final/ yet). An adapter directory loads its base model
(models.adapter_base) and the adapter; a checkpoint is rebuilt from the run's recipe and loaded from
its saved state. Without --prompt it is an interactive loop.

The prompt is rendered by the model's chat template as in training: `--chat-template PATH` replaces it,
`--tools FILE` (a JSON list of tool definitions) passes tools= as transformers does, refused with exit 2
where the template cannot render them, and `--template-kwarg KEY=VALUE` (e.g. enable_thinking=false)
passes template variables; a run's own data.chat_template_kwargs (its config.yaml) apply unless
overridden. `--show-prompt` prints the rendered prompt to stderr.

An image-text model (a model.vision run's result, or any AutoModelForImageTextToText with its processor)
takes `--image PATH`: the picture goes with the first user message, its placeholder before the text, as
training put it.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
import yaml
from PIL import Image, UnidentifiedImageError
from safetensors.torch import load_file
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    TextIteratorStreamer,
)

from training.config import load_recipe
from training.core.errors import UserError, cli
from training.data import ensure_chat_template
from training.data.formats import read_chat_template
from training.data.images import image_processor
from training.data.tokenize import probe_tools
from training.data.tokenizer import load_tokenizer
from training.data.turns import parse_reply as parse_reply  # the app's Chat tab reads replies with it
from training.data.turns import parse_tools
from training.model.build import build_model
from training.model.vision import checkpoint_processor, processor_for, rendered_image, resolve_image_text
from training.run.rundir import Source, resolve_source
from training.run.sources import (
    adapter_base,
    adapter_base_kwargs,
    auto_model,
    is_reward_model,
    pretrained_source,
)


def load_for_chat(source: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) ready for generation, from a run dir, final/, checkpoint, adapter or model."""
    found = resolve_source(source)
    if is_reward_model(found):
        path = found.path
        merge = ""
        if found.kind != "model":  # an adapter or a checkpoint: merged into a plain model first
            path = f"{found.run.root if found.run else found.path}/merged"
            merge = f"merge it (python -m training.export {found.run.root if found.run else found.path} --merge), then "
        raise UserError(
            f"{source} is a reward model (sequence classification: one score per text); it scores, it does not "
            f"chat. To use it as a reward of online RL, {merge}give rl.rewards: [{{function: reward_model, "
            f"args: {{path: {path}}}}}]"
        )
    if found.kind == "model":
        src = pretrained_source(str(found.path))
        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
            model = auto_model(src).from_pretrained(src, dtype=dtype)
        except OSError as e:
            reason = str(e).splitlines()[0]
            if isinstance(found.path, str):  # not on disk: a hub name, as far as resolve_source can tell
                raise UserError(
                    f"{source}: no such path, and no hub model of that name loads ({reason})"
                ) from None
            raise UserError(f"{source}: cannot load the model ({reason})") from None
    elif found.kind == "adapter":
        # peft imports bitsandbytes (seconds): only for adapters
        from peft import PeftModel

        base_src = adapter_base(found)
        base = auto_model(base_src).from_pretrained(base_src, dtype=dtype, **adapter_base_kwargs(found.path))
        tokenizer = AutoTokenizer.from_pretrained(found.path)
        model = PeftModel.from_pretrained(base, found.path)
    else:
        model, tokenizer = _load_checkpoint(found)
    ensure_chat_template(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def takes_images(model) -> bool:
    """Whether the model is an image-text one (its config has a vision part)."""
    return hasattr(model.config, "vision_config")


def with_image(messages: list[dict], processor) -> list[dict]:
    """The messages with the picture before the first user message's text, where training put it (one
    picture per conversation), written as the processor's chat template writes an image part (e.g.
    Qwen2-VL's <|vision_start|><|image_pad|><|vision_end|>), else as its image token."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    image = rendered_image(processor) or processor.image_token
    pictured = {**messages[first], "content": image + messages[first]["content"]}
    return [*messages[:first], pictured, *messages[first + 1 :]]


def load_processor(source: str, model):
    """The processor that turns an image into the model's pixel values and image tokens: final/'s own, or,
    for a checkpoint, the one the run's final/ would get; UserError for a text-only model."""
    if not takes_images(model):
        raise UserError(
            f"--image: {source} is a text-only model ({model.config.model_type}); it takes no images"
        )
    found = resolve_source(source)
    if found.kind == "model":
        return AutoProcessor.from_pretrained(pretrained_source(str(found.path)))
    if found.kind == "adapter":  # a LoRA run's final/ carries the processor beside the adapter
        return AutoProcessor.from_pretrained(found.path)
    recipe = resolve_image_text(load_recipe(found.run.config))  # a checkpoint of an image-text run
    tokenizer = load_tokenizer(recipe.model, recipe.data.images)
    if recipe.image_text_checkpoint:
        return checkpoint_processor(recipe, tokenizer)
    return processor_for(recipe, tokenizer, image_processor(recipe.model.vision.image_size))


def read_image(path: str):
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise UserError(f"--image: {path} does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"--image: {path} cannot be read as an image ({e})") from None


def _load_checkpoint(ckpt: Source):
    """The run's model rebuilt from its recipe, with the checkpoint's weights."""
    if ckpt.run is None:
        raise UserError(f"{ckpt.path}: checkpoint outside its run directory, cannot rebuild the model")
    recipe = load_recipe(ckpt.run.config)
    tokenizer = load_tokenizer(recipe.model)
    model = build_model(recipe, tokenizer, torch.device("cpu"))
    weights = Path(ckpt.path) / "model.safetensors"
    if not weights.is_file():
        raise UserError(
            f"{ckpt.path}: no model.safetensors "
            "(sharded DeepSpeed/FSDP checkpoints: use final/ or export first)"
        )
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    tied = {k for k in missing if "lm_head" in k}
    if unexpected or set(missing) - tied:
        raise UserError(
            f"{ckpt.path}: weights do not match the run's model "
            f"({len(missing)} missing, {len(unexpected)} unexpected keys)"
        )
    if tied:
        model.tie_weights()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.use_cache = True  # fast generation
    return model, tokenizer


def _inputs(
    model, tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs=None, images=None
):
    if images:  # processor, [pictures]: the rendered prompt with the pictures' pixels and image tokens
        processor, pictures = images
        text = rendered_prompt(tokenizer, messages, tools, template_kwargs)
        enc = processor(text=[text], images=pictures, return_tensors="pt")
        return {k: v.to(model.device) for k, v in enc.items()}
    enc = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        **(template_kwargs or {}),
    )
    return {k: v.to(model.device) for k, v in enc.items()}


def rendered_prompt(tokenizer, messages: list[dict], tools=None, template_kwargs=None) -> str:
    """The text the model is given (what --show-prompt prints)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )


def run_template_kwargs(source: str) -> dict:
    """data.chat_template_kwargs of the run `source` belongs to (its config.yaml), {} for anything else: a
    run trained with enable_thinking=false is chatted with the same way."""
    run = resolve_source(source).run
    if run is None or not run.config.is_file():
        return {}
    recipe = yaml.safe_load(run.config.read_text()) or {}
    return dict((recipe.get("data") or {}).get("chat_template_kwargs") or {})


def parse_template_kwargs(items: list[str]) -> dict:
    """--template-kwarg KEY=VALUE items; VALUE read as YAML (false, 3, a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--template-kwarg {item!r}: expected KEY=VALUE, e.g. enable_thinking=false")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def read_tools(path: str, tokenizer, template_kwargs: dict) -> list[dict]:
    """--tools FILE: a JSON list of tool definitions that this model's chat template renders."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--tools {path}: no such file; give a JSON list of tool definitions")
    tools, problem = parse_tools(p.read_text(encoding="utf-8"), f"--tools {path}")
    if problem:
        raise UserError(problem)
    if why := probe_tools(tokenizer, template_kwargs):
        raise UserError(
            f"--tools {path}: this model's chat template cannot render tools: {why}. Give one that does: "
            f"--chat-template PATH (a Jinja file, e.g. data/tools/chatml_tools.jinja)"
        )
    return tools


def _sampling(temperature: float, top_p: float, max_new_tokens: int, tokenizer) -> dict:
    kw = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kw


@torch.no_grad()
def generate(
    model,
    tokenizer,
    messages: list[dict],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    images=None,
) -> str:
    """One reply (greedy when temperature is 0); images: (processor, pictures) for an image-text model."""
    inputs = _inputs(model, tokenizer, messages, tools, template_kwargs, images)
    out = model.generate(**inputs, **_sampling(temperature, top_p, max_new_tokens, tokenizer))
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


@torch.no_grad()
def complete(
    model, tokenizer, text: str, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0
) -> str:
    """Continue plain text, no chat template (base models, models pretrained from scratch)."""
    enc = tokenizer(text, return_tensors="pt").to(model.device)
    out = model.generate(**enc, **_sampling(temperature, top_p, max_new_tokens, tokenizer))
    return text + tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def stream(
    model,
    tokenizer,
    messages: list[dict],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    images=None,
) -> Iterator[str]:
    """Yield the reply text as it grows (a background thread runs generate)."""
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(
        **_inputs(model, tokenizer, messages, tools, template_kwargs, images),
        **_sampling(temperature, top_p, max_new_tokens, tokenizer),
        streamer=streamer,
    )
    thread = threading.Thread(target=torch.no_grad()(model.generate), kwargs=kwargs, daemon=True)
    thread.start()
    text = ""
    for piece in streamer:
        text += piece
        yield text
    thread.join()


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.chat", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "source", help="run directory, final/, checkpoint, adapter or model directory, hub name, bundled:NAME"
    )
    ap.add_argument("--prompt", help="one-shot: print the reply to this prompt and exit")
    ap.add_argument("--system", help="system prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument(
        "--raw", action="store_true", help="continue the prompt as plain text (base or from-scratch models)"
    )
    ap.add_argument(
        "--chat-template", metavar="PATH", help="a Jinja chat template file to use instead of the model's"
    )
    ap.add_argument(
        "--tools", metavar="FILE", help="a JSON list of tool definitions, passed to the chat template"
    )
    ap.add_argument(
        "--template-kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chat template variable, e.g. enable_thinking=false (repeatable; a run's data.chat_template_kwargs "
        "apply unless overridden)",
    )
    ap.add_argument("--show-prompt", action="store_true", help="print the rendered prompt to stderr")
    ap.add_argument(
        "--image", metavar="PATH", help="a picture for an image-text model, given with the first user message"
    )
    args = ap.parse_args(argv)
    picture = read_image(args.image) if args.image else None
    template_kwargs = {**run_template_kwargs(args.source), **parse_template_kwargs(args.template_kwarg)}
    template = read_chat_template(args.chat_template, "--chat-template") if args.chat_template else None
    transformers.logging.set_verbosity_error()
    model, tokenizer = load_for_chat(args.source)
    if template is not None:
        tokenizer.chat_template = template
    tools = read_tools(args.tools, tokenizer, template_kwargs) if args.tools else None
    images = (load_processor(args.source, model), [picture]) if picture is not None else None
    history = [{"role": "system", "content": args.system}] if args.system else []
    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        tools=tools,
        template_kwargs=template_kwargs,
        images=images,
    )
    if args.raw:
        if args.prompt is None:
            raise UserError("--raw needs --prompt TEXT to continue")
        if tools or args.chat_template or args.template_kwarg or images:
            raise UserError(
                "--raw continues plain text: --tools, --chat-template, --template-kwarg and --image do not apply"
            )
        print(complete(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p))
        return 0
    pictured = (lambda msgs: with_image(msgs, images[0])) if images else (lambda msgs: msgs)
    if args.prompt is not None:
        messages = pictured(history + [{"role": "user", "content": args.prompt}])
        if args.show_prompt:
            print(rendered_prompt(tokenizer, messages, tools, template_kwargs), file=sys.stderr, flush=True)
        print(generate(model, tokenizer, messages, **sampling))
        return 0
    print("chatting with", args.source, "(empty line or Ctrl-D to quit)")
    while True:
        try:
            prompt = input("> ").strip()
        except EOFError:
            break
        if not prompt:
            break
        history.append({"role": "user", "content": prompt})
        if args.show_prompt:
            print(
                rendered_prompt(tokenizer, pictured(history), tools, template_kwargs),
                file=sys.stderr,
                flush=True,
            )
        reply = ""
        for text in stream(model, tokenizer, pictured(history), **sampling):
            reply = text
        print(reply)
        history.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
