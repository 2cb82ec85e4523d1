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

import transformers

from training.core.errors import UserError, cli
from training.data.formats import read_chat_template
from training.generation import (
    ChatOptions,
    complete,
    generate,
    load_for_chat,
    load_processor,
    parse_template_kwargs,
    read_image,
    read_tools,
    rendered_prompt,
    run_template_kwargs,
    stream,
    with_image,
)


def parser() -> argparse.ArgumentParser:
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
    return ap


@cli
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    picture = read_image(args.image) if args.image else None
    template_kwargs = {**run_template_kwargs(args.source), **parse_template_kwargs(args.template_kwarg)}
    template = read_chat_template(args.chat_template, "--chat-template") if args.chat_template else None
    transformers.logging.set_verbosity_error()
    model, tokenizer = load_for_chat(args.source)
    if template is not None:
        tokenizer.chat_template = template
    tools = read_tools(args.tools, tokenizer, template_kwargs) if args.tools else None
    images = (load_processor(args.source, model), [picture]) if picture is not None else None
    options = ChatOptions(args.max_new_tokens, args.temperature, args.top_p, tools, template_kwargs, images)
    if args.raw:
        return continue_text(args, model, tokenizer, options)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        messages = pictured(history + [{"role": "user", "content": args.prompt}], options)
        show_prompt(args, tokenizer, messages, options)
        print(generate(model, tokenizer, messages, options))
        return 0
    return converse(args, model, tokenizer, history, options)


def continue_text(args, model, tokenizer, options: ChatOptions) -> int:
    """--raw: the prompt continued as plain text."""
    if args.prompt is None:
        raise UserError("--raw needs --prompt TEXT to continue")
    if options.tools or args.chat_template or args.template_kwarg or options.images:
        raise UserError(
            "--raw continues plain text: --tools, --chat-template, --template-kwarg and --image do not apply"
        )
    print(complete(model, tokenizer, args.prompt, options))
    return 0


def pictured(messages: list[dict], options: ChatOptions) -> list[dict]:
    """The messages with --image's picture before the first user message's text (none without --image)."""
    return with_image(messages, options.images[0]) if options.images else messages


def show_prompt(args, tokenizer, messages: list[dict], options: ChatOptions) -> None:
    """--show-prompt: the rendered prompt on stderr."""
    if args.show_prompt:
        text = rendered_prompt(tokenizer, messages, options.tools, options.template_kwargs)
        print(text, file=sys.stderr, flush=True)


def converse(args, model, tokenizer, history: list[dict], options: ChatOptions) -> int:
    """The interactive loop: each reply streamed, the conversation kept, until an empty line or Ctrl-D."""
    print("chatting with", args.source, "(empty line or Ctrl-D to quit)")
    while True:
        try:
            prompt = input("> ").strip()
        except EOFError:
            break
        if not prompt:
            break
        history.append({"role": "user", "content": prompt})
        show_prompt(args, tokenizer, pictured(history, options), options)
        reply = ""
        for text in stream(model, tokenizer, pictured(history, options), options):
            reply = text
        print(reply)
        history.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
