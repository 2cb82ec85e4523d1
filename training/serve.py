"""Serve a run's result, a checkpoint, an adapter or any model over the OpenAI chat-completions API.

    python -m training.serve RUN_OR_MODEL [--model NAME=PATH ...] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Any OpenAI client talks to it (base URL http://HOST:PORT/v1): GET /v1/models lists the served names (a run's
directory name by default; `--model NAME=PATH`, repeatable, serves more under names of your choosing) and POST
/v1/chat/completions answers with messages rendered by the model's own chat template, `tools` included (a
reply that calls tools comes back as message.tool_calls), `stream`, `n`, `temperature` (0 = greedy),
`top_p`, `max_tokens` (default: the rest of the context), `seed` (the same seed draws the same completion),
`logprobs`/`top_logprobs`, `stop`. LoRA adapters of one base share it: the base is loaded once and each
adapter is switched in by name, and the base itself may be served beside them. POST /v1/completions draws from
a prompt given as text or token ids (`return_token_ids`: vLLM's), batching the requests that arrive together;
POST /v1/weights?model=NAME loads a trainer's weights (a safetensors body) into a served model: a run's rollouts
drawn here (rl.generator: server, training/generation/completions_api.py). POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's) serve an adapter directory by name while the server runs, or stop serving it
(training/generation/adapters_api.py; a trainer's rl.server_push: adapter).

It listens on 127.0.0.1 only unless `--host` says otherwise, and then only with an API key (`--api-key KEY`
or LLM_FORGE_API_KEY) that every request carries (Authorization: Bearer KEY). A request that is malformed,
names an unknown model or does not fit the context gets OpenAI's error object and status (400, 401, 404),
and one line in the log. Non-streamed chat requests without stop strings or top log-probabilities that arrive
together are drawn in one batch, as /v1/completions' are (training/generation/chat_batching.py); a stream draws
alone.

The request/response logic is training/generation/openai_api.py; the models and draws
training/generation/served.py; this file is the command line and the HTTP wiring (FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
import uvicorn

from training.core.errors import UserError, cli
from training.core.hosts import API_KEY_ENV, is_loopback
from training.data.formats import read_chat_template
from training.generation import parse_template_kwargs
from training.generation.http_app import build_app, listen
from training.generation.served import default_name, load_served

__all__ = [
    "build_app",
    "listen",
    "main",
    "served_sources",
]  # build_app and listen: the HTTP side's, re-exported


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "source",
        nargs="?",
        help="run directory, final/, checkpoint, adapter or model directory, hub name, bundled:NAME; served "
        "under its name (a run's directory name)",
    )
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve PATH (as SOURCE) under NAME as well (repeatable); adapters of one base share it",
    )
    ap.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--api-key",
        default=None,
        help=f"the key every request must carry (Authorization: Bearer KEY; or set {API_KEY_ENV}); required "
        "with a --host other than loopback",
    )
    ap.add_argument(
        "--chat-template", metavar="PATH", help="a Jinja chat template file to use instead of the models' own"
    )
    ap.add_argument(
        "--template-kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chat template variable, e.g. enable_thinking=false (repeatable; a run's data.chat_template_kwargs "
        "apply unless overridden; a request's chat_template_kwargs win over both)",
    )
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if there is one)")
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="the weights' dtype (auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    return ap


@cli
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and key is None:
        raise UserError(
            f"--host {args.host} makes the server reachable from other machines: give it an API key "
            f"(--api-key KEY, or set {API_KEY_ENV}) that every request must carry, or keep the default "
            f"--host 127.0.0.1"
        )
    named = served_sources(args.source, args.model)
    template = read_chat_template(args.chat_template, "--chat-template") if args.chat_template else None
    template_kwargs = parse_template_kwargs(args.template_kwarg)
    sock = listen(args.host, args.port)  # before the models load: a busy port is said at once
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    )
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    models = load_served(named, template, template_kwargs, device, dtype)
    server = uvicorn.Server(uvicorn.Config(build_app(models, key), log_level="info"))
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {', '.join(models)} at http://{shown}:{sock.getsockname()[1]}/v1", flush=True)
    server.run(sockets=[sock])
    return 0


def served_sources(source: str | None, models: list[str]) -> dict[str, str]:
    """{name: source}: SOURCE under its default name, then each --model NAME=PATH; UserError for none, a
    malformed --model or a name given twice."""
    named: dict[str, str] = {}
    pairs = [(default_name(source), source, "SOURCE")] if source else []
    for item in models:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UserError(f"--model {item!r}: expected NAME=PATH, e.g. --model tuned=runs/lora")
        pairs.append((name.strip(), path.strip(), f"--model {item}"))
    if not pairs:
        raise UserError("nothing to serve: give a run, checkpoint or model (SOURCE) or --model NAME=PATH")
    for name, path, given in pairs:
        if name in named:
            raise UserError(
                f"{given}: the name {name!r} is already served ({named[name]}); give another NAME"
            )
        named[name] = path
    return named


if __name__ == "__main__":
    raise SystemExit(main())
