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
drawn here (rl.generator: server, training/generation/completions_api.py).

It listens on 127.0.0.1 only unless `--host` says otherwise, and then only with an API key (`--api-key KEY`
or LLM_FORGE_API_KEY) that every request carries (Authorization: Bearer KEY). A request that is malformed,
names an unknown model or does not fit the context gets OpenAI's error object and status (400, 401, 404),
and one line in the log. One model generates one request at a time.

The request/response logic is training/generation/openai_api.py; the models and draws
training/generation/served.py; this file is the command line and the HTTP wiring (FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import threading
import time

import torch
import transformers
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from training.core.errors import UserError, cli
from training.core.hosts import is_loopback
from training.data.formats import read_chat_template
from training.generation import parse_template_kwargs
from training.generation.completions_api import (
    Batcher,
    completion_body,
    load_weights,
    parse_completion,
    prepare_completion,
)
from training.generation.openai_api import (
    APIError,
    ChoiceStream,
    Prepared,
    check_key,
    chunk,
    completion,
    completion_id,
    model_body,
    models_body,
    parse_request,
    prepare,
    served_model,
    usage,
)
from training.generation.served import Cancelled, Served, default_name, draw, load_served
from training.generation.server_engine import API_KEY_ENV

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one format for its lines and ours


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


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: a free one); UserError when it cannot be (the port is taken,
    the address is not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    sock.listen(2048)  # a client that connects while the models load waits instead of being refused
    return sock


def build_app(models: dict[str, Served], api_key: str | None = None) -> FastAPI:
    """The HTTP side: routes, the API key, and every error as OpenAI's error object."""
    app = FastAPI(title="llm-forge", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # no such route, wrong method
        return await api_error(
            request, APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        )

    @app.exception_handler(Exception)
    async def crash(
        request: Request, e: Exception
    ):  # a bug: its traceback goes to the log, not to the client
        body = APIError(500, f"the server failed ({type(e).__name__}); see its log", "server_error").body()
        return JSONResponse(body, status_code=500)

    def authorized(request: Request) -> None:
        check_key(request.headers.get("authorization"), api_key)

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorized(request)
        return models_body(models, created)

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        authorized(request)
        served_model(models, name)
        return model_body(name, created)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorized(request)
        asked = parse_request(await request.body())
        prepared = prepare(asked, served_model(models, asked.model))
        id, now = completion_id(), int(time.time())
        if asked.stream:
            return StreamingResponse(events(prepared, id, now), media_type="text/event-stream")
        choices = await run_in_threadpool(draw, prepared.served, prepared.prompt_ids, prepared.sampling)
        return completion(prepared, choices, id, now)

    batchers = {name: Batcher(s) for name, s in models.items()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorized(request)
        asked = parse_completion(await request.body())
        prepared = prepare_completion(asked, served_model(models, asked.model))
        ids, mask = await asyncio.wrap_future(batchers[asked.model].submit(prepared))
        return completion_body(prepared, ids, mask, asked.model, bool(asked.return_token_ids))

    @app.post("/v1/weights")
    async def weights(request: Request):
        authorized(request)
        name = request.query_params.get("model") or next(iter(models))
        loaded = await run_in_threadpool(load_weights, served_model(models, name), await request.body())
        log.info("weights: %d tensor(s) loaded into %s", loaded, name)
        return {"object": "weights", "model": name, "loaded": loaded}

    return app


async def events(prepared: Prepared, id: str, created: int):
    """The server-sent events of a stream: a chunk per choice as its reply grows, the usage if asked
    (stream_options.include_usage), `data: [DONE]`. The draw runs in a thread of its own; a client that goes
    away cancels it at the next token."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def tell(kind: str, value) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is gone (the server stopped)
            cancel.set()

    def work() -> None:
        try:
            tell("done", draw(prepared.served, prepared.prompt_ids, prepared.sampling, on_step, cancel))
        except Cancelled:
            log.info("a stream's client went away: its generation stopped")
            tell("cancelled", None)
        except Exception as e:  # a bug: its traceback goes to the log, the client gets an error event
            log.exception("generation failed")
            tell("error", e)

    def on_step(choices) -> None:
        tell("step", [c.snapshot() for c in choices])

    streams = [ChoiceStream(prepared, i) for i in range(prepared.sampling.n)]
    threading.Thread(target=work, name="serve-draw", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "cancelled":
                return
            if kind == "error":
                body = APIError(
                    500, f"the server failed ({type(value).__name__}); see its log", "server_error"
                )
                yield sse(body.body())
                return
            for c in value:
                if (delta := streams[c.index].update(c)) is not None:
                    yield sse(chunk(prepared, id, created, [delta]))
            if kind == "done":
                options = prepared.request.stream_options
                if options is not None and options.include_usage:
                    yield sse(chunk(prepared, id, created, [], usage(prepared, value)))
                yield "data: [DONE]\n\n"
                return
    finally:
        cancel.set()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


if __name__ == "__main__":
    raise SystemExit(main())
