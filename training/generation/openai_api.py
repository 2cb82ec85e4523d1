"""The OpenAI chat-completions API as python -m training.serve answers it, without the HTTP: requests read and
checked (pydantic, strict types, unknown parameters refused), the prompt rendered by the model's own chat
template (tools and template variables included), the context length checked, and the replies assembled:
whole (`completion`), or as the chunks of a stream (`ChoiceStream`), with tool calls read from the reply in
the model's own format (parse_reply). Every refusal is an `APIError`: OpenAI's status and error shape
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.data.tokenize import probe_tools
from training.data.turns import clean, message_problem, parse_reply
from training.generation.chat import rendered_prompt
from training.generation.served import Choice, Sampling, Served, TokenLogprob

MAX_N = 16
MAX_STOP = 4


class APIError(Exception):
    """A refused request: its HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- the request -----------------------------------------------------------------------------------------


class _Lenient(BaseModel):
    """Parts a client may send back as it received them (an earlier reply's message has refusal, annotations,
    ...): keys beside the ones read are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Lenient):
    type: str
    text: str | None = None


class CallFunction(_Lenient):
    name: str
    arguments: str | dict | None = None


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """POST /v1/chat/completions. Unknown parameters are refused (a setting silently ignored would be a
    surprise); `chat_template_kwargs` (template variables, e.g. enable_thinking) is this server's addition."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    chat_template_kwargs: dict | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids in the reply


def parse_request(body: bytes) -> ChatRequest:
    """The request in a POST body; APIError 400 naming the first problem (a body that is not JSON, a missing
    field, a wrong type, an unknown parameter, a value out of range)."""
    request = validated(body, ChatRequest)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise bad_request(f"{name} is not supported by this server (give 0 or leave it out)", param=name)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > MAX_STOP or not all(stops):
        raise bad_request(f"stop: at most {MAX_STOP} non-empty strings", param="stop")
    return request


def validated(body: bytes, kind: type[BaseModel]):
    """A POST body as `kind`; APIError 400 for a body that is not a JSON object or that `kind` does not take."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, as `param: message` (a union's alternatives joined with "or")."""
    errors = e.errors()
    param = _param(errors[0]["loc"])
    if errors[0]["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if errors[0]["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param=param)
    said = list(dict.fromkeys(x["msg"] for x in errors if _param(x["loc"]) == param))
    return bad_request(f"{param}: {' or '.join(said)}", param=param)


def _param(loc) -> str:
    """pydantic's location as a parameter path (messages[0].role), without the type tags of unions."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            part.isidentifier() and part[0].islower() and part not in {"str", "int", "float", "bool", "dict"}
        ):
            out += ("." if out else "") + part
    return out


def check_key(authorization: str | None, key: str | None) -> None:
    """APIError 401 unless `key` is unset or the request carries `Authorization: Bearer <key>`."""
    if key is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise APIError(
            401,
            "You didn't provide an API key. Give it in the Authorization header: Bearer KEY",
            code="invalid_api_key",
        )
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def served_model(models: dict[str, Served], name: str) -> Served:
    if name not in models:
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves {', '.join(models)}",
            param="model",
            code="model_not_found",
        )
    return models[name]


# ---- the prompt ------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """A checked request for one served model: the rendered prompt (text and token ids), the tools given to
    the template, and how to draw."""

    request: ChatRequest
    served: Served
    prompt: str
    prompt_ids: list[int]
    tools: list[dict] | None
    sampling: Sampling


def prepare(request: ChatRequest, served: Served) -> Prepared:
    """Render the messages with the model's chat template and check that prompt + max_tokens fit its context.
    APIError 400 for messages the template cannot render, tools it cannot render, a request too long."""
    messages = [_message(m, i) for i, m in enumerate(request.messages)]
    kwargs = {**served.template_kwargs, **(request.chat_template_kwargs or {})}
    tools = _tools(request, served, kwargs)
    tok = served.tokenizer
    try:
        prompt = rendered_prompt(tok, messages, tools, kwargs)
        ids = list(
            tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, return_dict=True, **kwargs
            )["input_ids"]
        )
    except Exception as e:  # jinja's errors and whatever a template raises ("roles must alternate", ...)
        first = str(e).splitlines()[0] if str(e) else ""
        raise bad_request(
            f"the chat template of {served.name} cannot render these messages ({type(e).__name__}: {first})",
            param="messages",
        ) from None
    return Prepared(request, served, prompt, ids, tools, _sampling(request, served, len(ids)))


def _message(m: Message, i: int) -> dict:
    """A request message as the chat template reads it (content parts joined, tool-call arguments as dicts,
    developer -> system); APIError 400 naming it if it is not one a template can render."""
    where = f"messages[{i}]"
    content = m.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"{where}.content[{j}]: only text parts are served ({{'type': 'text', 'text': ...}}), "
                    f"not {part.type!r}",
                    param=f"{where}.content",
                )
        content = "".join(part.text for part in content)
    role = "system" if m.role == "developer" else m.role
    out = {"role": role, "content": content}
    if m.tool_calls is not None:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    if why := message_problem(out, where, "content"):
        raise bad_request(why, param=where)
    return clean(out, role, content)


def _tools(request: ChatRequest, served: Served, kwargs: dict) -> list[dict] | None:
    """The tool definitions for the template: none without tools or with tool_choice "none"; APIError 400 for a
    tool_choice this server cannot force, or a template that cannot render tools."""
    choice = request.tool_choice
    if choice not in (None, "auto", "none"):
        raise bad_request(
            f"tool_choice {choice!r} is not supported by this server: give 'auto' (the model decides) or 'none'",
            param="tool_choice",
        )
    if not request.tools or choice == "none":
        return None
    if why := probe_tools(served.tokenizer, kwargs):
        raise bad_request(
            f"the chat template of {served.name} cannot render tools: {why}. Start the server with one that "
            f"does: --chat-template PATH (a Jinja file, e.g. data/tools/chatml_tools.jinja)",
            param="tools",
        )
    return [t.model_dump(exclude_none=True) for t in request.tools]


def _sampling(request: ChatRequest, served: Served, n_prompt: int) -> Sampling:
    context = served.context
    asked = request.max_completion_tokens or request.max_tokens
    max_tokens = asked if asked is not None else context - n_prompt
    if n_prompt + max(max_tokens, 1) > context:
        completion = f"{max_tokens} in the completion" if asked else "none left for the completion"
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{n_prompt + (asked or 0)} tokens ({n_prompt} in the messages, {completion}). Please reduce the "
            f"length of the messages or completion.",
            param="messages",
            code="context_length_exceeded",
        )
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    return Sampling(
        n=request.n or 1,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        max_tokens=max_tokens,
        seed=request.seed,
        stop=tuple(stops),
        top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
    )


# ---- the reply -------------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def reply(choice: Choice, prepared: Prepared) -> tuple[dict, str]:
    """(the assistant message in OpenAI's shape, finish_reason) of a finished choice: reasoning and tool calls
    read from the reply in the model's own format; finish_reason "tool_calls" when it calls tools."""
    parsed = parse_reply(choice.text.strip(), prepared.served.tokenizer, prepared.prompt)
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": _arguments(c["function"].get("arguments")),
            },
        }
        for c in parsed.get("tool_calls") or []
    ]
    message = {"role": "assistant", "content": parsed.get("content") or (None if calls else "")}
    if parsed.get("reasoning_content"):
        message["reasoning_content"] = parsed["reasoning_content"]
    if calls:
        message["tool_calls"] = calls
    finish = "length" if choice.finish_reason == "length" else "tool_calls" if calls else "stop"
    return message, finish


def _arguments(arguments) -> str:
    """A call's arguments as OpenAI gives them: a JSON string."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def logprobs_body(entries: list[TokenLogprob]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries
        ],
        "refusal": None,
    }


def usage(prepared: Prepared, choices: list[Choice]) -> dict:
    completion = sum(c.generated for c in choices)
    prompt = len(prepared.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(prepared: Prepared, choices: list[Choice], id: str, created: int) -> dict:
    """The chat.completion object of finished choices."""
    out = []
    for c in choices:
        message, finish = reply(c, prepared)
        logprobs = logprobs_body(c.logprobs) if prepared.sampling.top_logprobs is not None else None
        out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        if prepared.request.return_token_ids:  # what was generated, its end token included (vLLM's token_ids)
            out[-1]["token_ids"] = c.tokens + ([c.ended] if c.ended is not None else [])
    body = {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": prepared.served.name,
        "system_fingerprint": None,
        "choices": out,
        "usage": usage(prepared, choices),
    }
    if prepared.request.return_token_ids:
        body["prompt_token_ids"] = list(prepared.prompt_ids)
    return body


def chunk(prepared: Prepared, id: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    """One chat.completion.chunk of a stream."""
    out = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": prepared.served.name,
        "system_fingerprint": None,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = usage
    return out


# an opening tag (or the start of one cut off at the end): <name ...> or </name
TAG = re.compile(r"<(/?)([A-Za-z_][\w-]*)[^<>]*(>|$)")


class ChoiceStream:
    """One choice of a stream: the deltas that grow its content (and reasoning) as the reply grows, so that
    they join to what the whole reply would say. Text that may still change its meaning is held back until it
    settles: trailing whitespace (the whole reply is stripped), a tag still open (<tool_call>... before its
    </tool_call>, which may become a tool call), the start of a stop string, a character still being
    decoded. Tool calls come whole in the last delta, with the finish_reason."""

    FIELDS = ("reasoning_content", "content")

    def __init__(self, prepared: Prepared, index: int):
        self.prepared, self.index = prepared, index
        self.sent = dict.fromkeys(self.FIELDS, "")
        self.logprobs_sent = 0
        self.started = self.finished = False

    def update(self, choice: Choice) -> dict | None:
        """The chunk choice ({"index", "delta", "logprobs", "finish_reason"}) that brings the client up to
        `choice` (a snapshot of it), or None when there is nothing new."""
        if self.finished:
            return None
        delta = {} if self.started else {"role": "assistant"}
        if choice.finish_reason is None:
            values = parse_reply(
                self._visible(choice.text), self.prepared.served.tokenizer, self.prepared.prompt
            )
            values = {k: _settled(values.get(k) or "") for k in self.FIELDS}
            finish = None
        else:
            message, finish = reply(choice, self.prepared)
            values = {k: message.get(k) or "" for k in self.FIELDS}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
            self.finished = True
        for k in self.FIELDS:
            if values[k].startswith(self.sent[k]) and len(values[k]) > len(self.sent[k]):
                delta[k] = values[k][len(self.sent[k]) :]
                self.sent[k] = values[k]
        logprobs = None
        if self.prepared.sampling.top_logprobs is not None and len(choice.logprobs) > self.logprobs_sent:
            logprobs = logprobs_body(choice.logprobs[self.logprobs_sent :])
            self.logprobs_sent = len(choice.logprobs)
        if self.started and len(delta) == 0 and logprobs is None and finish is None:
            return None
        if not self.started:
            delta.setdefault("content", "")
        self.started = True
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _visible(self, text: str) -> str:
        """The reply so far, without what may still change: leading whitespace, a character being decoded,
        the start of a stop string at its end."""
        text = text.lstrip().rstrip("\ufffd")
        for stop in self.prepared.sampling.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    text = text[:-k]
                    break
        return text


def _settled(text: str) -> str:
    """`text` up to the first tag that is cut off or still open (no closing tag after it), trailing whitespace
    held back."""
    for found in TAG.finditer(text):
        closed = found.group(3) == ">"
        if not closed or (not found.group(1) and f"</{found.group(2)}>" not in text[found.end() :]):
            text = text[: found.start()]
            break
    if text.endswith("<"):
        text = text[:-1]
    return text.rstrip()


def models_body(models: dict[str, Served], created: int) -> dict:
    """GET /v1/models."""
    return {"object": "list", "data": [model_body(s, created) for s in models.values()]}


def model_body(served: Served, created: int) -> dict:
    """A model's card; an adapter loaded while serving names its base as `parent`, as vLLM's cards do."""
    card = {"id": served.name, "object": "model", "created": created, "owned_by": "llm-forge"}
    return card | ({"parent": served.parent} if served.parent else {})
