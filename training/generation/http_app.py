"""The HTTP side of the OpenAI-compatible server (FastAPI routes over the served models, every error as OpenAI's
error object) and uvicorn serving it: in the foreground (python -m training.serve) or in a thread of this
process on 127.0.0.1 (`serving`: the trainer serves the policy it trains to a verifiers environment)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from training.core.errors import UserError
from training.generation.adapters_api import (
    adapter_to_unload,
    load_adapter,
    parse_load,
    parse_unload,
    unload_adapter,
)
from training.generation.chat_batching import batchable, batched_choices, chat_draw
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
from training.generation.served import Cancelled, Served, draw

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one format for its lines and ours


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


def openai_errors(app: FastAPI) -> None:
    """Every error as OpenAI's error object: ours with their status, a missing route or wrong method as such,
    a bug as a 500 whose traceback goes to the log, not to the client."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return await api_error(
            request, APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        )

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):
        body = APIError(500, f"the server failed ({type(e).__name__}); see its log", "server_error").body()
        return JSONResponse(body, status_code=500)


def build_app(models: dict[str, Served], api_key: str | None = None) -> FastAPI:
    """The HTTP side: routes, the API key, and every error as OpenAI's error object."""
    app = FastAPI(title="llm-forge", docs_url=None, redoc_url=None, openapi_url=None)
    openai_errors(app)
    created = int(time.time())
    batchers = {name: Batcher(s) for name, s in models.items()}

    def authorized(request: Request) -> None:
        check_key(request.headers.get("authorization"), api_key)

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorized(request)
        return models_body(models, created)

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        authorized(request)
        return model_body(served_model(models, name), created)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorized(request)
        asked = parse_request(await request.body())
        prepared = prepare(asked, served_model(models, asked.model))
        id, now = completion_id(), int(time.time())
        if asked.stream:
            return StreamingResponse(events(prepared, id, now), media_type="text/event-stream")
        if batchable(prepared):  # drawn together with the requests that arrive beside it
            ids, mask = await asyncio.wrap_future(batchers[asked.model].submit(chat_draw(prepared)))
            choices = await run_in_threadpool(batched_choices, prepared, ids, mask)
        else:
            choices = await run_in_threadpool(draw, prepared.served, prepared.prompt_ids, prepared.sampling)
        return completion(prepared, choices, id, now)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorized(request)
        asked = parse_completion(await request.body())
        prepared = prepare_completion(asked, served_model(models, asked.model))
        ids, mask = await asyncio.wrap_future(batchers[asked.model].submit(prepared))
        return completion_body(prepared, ids, mask, asked.model, bool(asked.return_token_ids))

    adapter_routes(app, models, batchers, authorized)

    @app.post("/v1/weights")
    async def weights(request: Request):
        authorized(request)
        name = request.query_params.get("model") or next(iter(models))
        loaded = await run_in_threadpool(load_weights, served_model(models, name), await request.body())
        log.info("weights: %d tensor(s) loaded into %s", loaded, name)
        return {"object": "weights", "model": name, "loaded": loaded}

    return app


def adapter_routes(app: FastAPI, models: dict[str, Served], batchers: dict[str, Batcher], authorized) -> None:
    """vLLM's routes that load and unload LoRA adapters while serving (training/generation/adapters_api.py)."""
    changing = asyncio.Lock()  # one load or unload at a time; `models` changes on this loop only

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        authorized(request)
        asked = parse_load(await request.body())
        async with changing:
            served = await run_in_threadpool(load_adapter, models, asked)
            if asked.lora_name not in models:
                models[asked.lora_name], batchers[asked.lora_name] = served, Batcher(served)
        log.info("adapter %s loaded from %s on %s", asked.lora_name, asked.lora_path, served.parent)
        return PlainTextResponse(f"Success: LoRA adapter '{asked.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        authorized(request)
        asked = parse_unload(await request.body())
        async with changing:
            served = adapter_to_unload(models, asked)
            del models[asked.lora_name]
            await run_in_threadpool(batchers.pop(asked.lora_name).close)  # its draws asked for before: done
            await run_in_threadpool(unload_adapter, models, served)
        log.info("adapter %s unloaded", asked.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{asked.lora_name}' removed successfully.")


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


@contextlib.contextmanager
def serving(models: dict[str, Served]):
    """`models` served on a free port of 127.0.0.1 by uvicorn in a daemon thread, behind a fresh API key;
    yields (base URL, key). The server stops when the block ends."""
    key = secrets.token_urlsafe(16)
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(models, key), log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the loopback server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", key
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
