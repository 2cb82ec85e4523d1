"""Chat through an OpenAI-compatible server (python -m training.serve, vllm serve, transformers serve, ...): the
models it serves (GET /v1/models) and a reply streamed from POST /v1/chat/completions, through the `openai`
client. A served model is a Chat tab source written `NAME @ URL`; its API key comes from the tab's field or
LLM_FORGE_API_KEY, as the server reads it. Every failure (nothing answers, a refused key, a model it does not
serve, a refused request, an error mid-stream) is a ServerError whose message names the server and says what to
do: the tab shows it, never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import openai

from training.core.errors import UserError
from training.core.hosts import API_KEY_ENV

AT = " @ "  # NAME @ URL: a served model among the Chat tab's sources
TIMEOUT = openai.Timeout(600.0, connect=5.0)  # a reply may take minutes on a CPU; a dead address fails fast
START_ONE = "start one, e.g. python -m training.serve RUN --port 8000, and give http://127.0.0.1:8000/v1"


class ServerError(UserError):
    """A server that cannot answer what the Chat tab asks, said in words (the tab shows it as an error)."""


@dataclass(frozen=True)
class ServedModel:
    """A model a server serves, as a chat slot holds it."""

    url: str  # the API's base URL, ending in /v1
    name: str
    api_key: str | None = field(default=None, repr=False)

    @property
    def source(self) -> str:
        return f"{self.name}{AT}{self.url}"


def server_url(text: str) -> str:
    """The Server URL field as the API's base URL: http:// when no scheme is given, /v1 when no path is (every
    server above serves the API there); ServerError for anything that is not an http(s) address."""
    url = (text or "").strip().rstrip("/")
    if not url:
        raise ServerError(f"Server URL: give the address of an OpenAI-compatible server; {START_ONE}")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError as e:
        raise ServerError(f"Server URL {text.strip()!r}: not an address ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"Server URL {text.strip()!r}: expected http://HOST:PORT/v1")
    return url if parts.path else url + "/v1"


def api_key(given: str | None) -> str | None:
    """The API key field, else LLM_FORGE_API_KEY, else none."""
    return (given or "").strip() or os.environ.get(API_KEY_ENV) or None


def served_source(source: str | None) -> tuple[str, str] | None:
    """(name, url) of a source written NAME @ URL; None for any other source (a path, a bundled model)."""
    name, at, url = (source or "").strip().rpartition(AT)
    if at and name.strip() and url.startswith(("http://", "https://")):
        return name.strip(), url
    return None


def list_models(url: str, key: str | None) -> list[str]:
    """The names the server at `url` serves (GET /v1/models)."""
    with said(url, key is not None):
        names = [m.id for m in _client(url, key).models.list()]
    if not names:
        raise ServerError(f"the server at {url} serves no model")
    return names


def connect(url: str, name: str, key: str | None) -> ServedModel:
    """The model `name` of the server at `url`, once the server has said that it serves it."""
    names = list_models(url, key)
    if name not in names:
        raise ServerError(f"the server at {url} serves {', '.join(names)}, not {name!r}")
    return ServedModel(url, name, key)


def stream_reply(
    served: ServedModel, messages: list[dict], sampling: dict, tools: list[dict] | None = None
) -> Iterator[dict]:
    """The reply (an assistant message: content, reasoning_content, tool_calls) as it streams in. `sampling`:
    max_tokens, temperature, top_p, seed (None: left to the server). The request is sent here, so a refusal is
    raised before any reply; an error mid-stream is raised as it comes."""
    with said(served.url, served.api_key is not None, served.name):
        chunks = _client(served.url, served.api_key).chat.completions.create(
            model=served.name,
            messages=wire_messages(messages),
            stream=True,
            **({"tools": tools} if tools else {}),
            **{k: v for k, v in sampling.items() if v is not None},
        )
    return _grown(chunks, served)


def _grown(chunks, served: ServedModel) -> Iterator[dict]:
    reply: dict = {"role": "assistant", "content": ""}
    calls: dict[int, dict] = {}
    with said(served.url, served.api_key is not None, served.name), chunks:
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.index == 0:
                    _add(reply, calls, choice.delta)
                    yield _finished(reply, calls)


def _add(reply: dict, calls: dict[int, dict], delta) -> None:
    """One chunk's delta into the reply: text appended; tool calls by index, their arguments appended."""
    reply["content"] += delta.content or ""
    thought = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
    if thought:  # servers' own field (ours and vLLM's reasoning_content; reasoning in newer ones)
        reply["reasoning_content"] = reply.get("reasoning_content", "") + thought
    for c in delta.tool_calls or []:
        call = calls.setdefault(c.index, {"type": "function", "function": {"name": "", "arguments": ""}})
        call["id"] = c.id or call.get("id")
        if c.function is not None:
            call["function"]["name"] += c.function.name or ""
            call["function"]["arguments"] += c.function.arguments or ""


def _finished(reply: dict, calls: dict[int, dict]) -> dict:
    """The reply so far, its tool calls' arguments read as JSON where they are (as the tab shows them)."""
    out = dict(reply)
    if calls:
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _json(c["function"]["arguments"])}}
            for _, c in sorted(calls.items())
        ]
    return out


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def wire_messages(messages: list[dict]) -> list[dict]:
    """The tab's conversation as OpenAI's messages: a tool call's arguments as a JSON string with an id, and a
    tool result answering the calls in order by their ids (tool_call_id)."""
    out, waiting = [], []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_wire_call(c, len(out), k) for k, c in enumerate(m["tool_calls"])]
            waiting = [c["id"] for c in m["tool_calls"]]
        elif m["role"] == "tool" and waiting:
            m["tool_call_id"] = waiting.pop(0)
        out.append(m)
    return out


def _wire_call(call: dict, turn: int, k: int) -> dict:
    arguments = call["function"].get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call.get("id") or f"call_{turn}_{k}",
        "type": "function",
        "function": {"name": call["function"]["name"], "arguments": text},
    }


def _client(url: str, key: str | None) -> openai.OpenAI:
    # a server without a key takes any; the client insists on one
    return openai.OpenAI(base_url=url, api_key=key or "none", max_retries=0, timeout=TIMEOUT)


@contextlib.contextmanager
def said(url: str, keyed: bool, model: str | None = None):
    """The `openai` client's errors as ServerErrors that say what went wrong and what to do (`keyed`: whether a
    key was sent)."""
    try:
        yield
    except openai.APIConnectionError as e:
        cause = e.__cause__ or e
        raise ServerError(
            f"no server answers at {url} ({str(cause) or type(cause).__name__}); {START_ONE}"
        ) from None
    except openai.AuthenticationError as e:
        refused = f"refused the API key given ({_message(e)})" if keyed else "asks for an API key"
        raise ServerError(
            f"the server at {url} {refused}: give its key in the API key field (or set {API_KEY_ENV} where the "
            "app starts)"
        ) from None
    except openai.NotFoundError as e:
        what = f"does not serve {model!r}; list its models again" if model else "has no /models here"
        raise ServerError(
            f"the server at {url} {what} ({_message(e)}); is the URL the API's base, ending in /v1?"
        ) from None
    except openai.APIStatusError as e:
        raise ServerError(f"the server at {url} answered {e.status_code}: {_message(e)}") from None
    except openai.APIError as e:  # an error event mid-stream, a reply that is not the API's
        raise ServerError(f"the server at {url} failed: {_message(e)}") from None


def _message(e: openai.APIError) -> str:
    """The server's own words: OpenAI's error object's message (FastAPI's detail: transformers serve), else the
    body, else the client's message."""
    body = e.body
    for key in ("message", "detail"):
        if isinstance(body, dict) and isinstance(body.get(key), str):
            return body[key]
    if isinstance(body, (str, dict)) and body:
        return str(body)[:300]
    return e.message
