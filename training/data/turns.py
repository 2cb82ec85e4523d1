"""Messages beyond role and content: tool definitions, tool calls and their results, reasoning traces, and
per-turn train marks. Checked here (each problem a sentence; the loader adds file and line), cleaned into
the shape chat templates read (transformers / TRL / OpenAI):

  tools        [{"type": "function", "function": {"name", "description", "parameters"}}, ...]   (top level;
               a JSON string of that list, as TRL stores it, is read too)
  assistant    {"role": "assistant", "content": "" or null, "tool_calls": [{"type": "function",
                "function": {"name": ..., "arguments": {...} or a JSON string}}]}  (arguments become a dict)
  tool         {"role": "tool", "content": "...", "name"?, "tool_call_id"?}  answers the calls before it
  reasoning    {"role": "assistant", "reasoning_content": "...", "content": "..."}, or content opening
               with <think>...</think>
  train mark   "train": true/false on an assistant message: wins over data.train_on

Tool results never carry labels; which assistant turns do is `trained_turns`.
"""

from __future__ import annotations

import json
import re

THINK = re.compile(r"\s*<think>(.*?)</think>", re.DOTALL)
PASSED_ON = ("name", "tool_call_id")  # optional string keys of a message kept for the template
# the keys a message may have beside role and content
OPTIONAL = ("tool_calls", "reasoning_content", "train", *PASSED_ON)


def tool_name(tool) -> str | None:
    """The function name of one tool definition ({"type": "function", "function": {...}} or the bare
    function {"name", ...}); None if it has none."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else None


def parse_tools(value, label: str) -> tuple[list[dict] | None, str | None]:
    """(tool definitions or None, problem or None) of a record's tools field (a list, or its JSON string)."""
    if value is None:
        return None, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            return None, f"field {label} is a string but not valid JSON ({e.msg})"
    if not isinstance(value, list):
        return None, f"field {label} must be a list of tool definitions, not {type(value).__name__}"
    for i, tool in enumerate(value):
        if tool_name(tool) is None:
            return None, (
                f"{label}[{i}] must be a tool definition "
                '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
            )
    return value, None


def call_arguments(call) -> dict | None:
    """The arguments of a well-formed call as a dict (a JSON string is parsed)."""
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    return args if isinstance(args, dict) else None


def parsed_calls(m: dict) -> dict:
    """The message with tool_calls given as a JSON string (as some datasets, and the records handed to Arrow
    by Dataset.from_list, hold them) parsed; a string that is not JSON is left for calls_problem to name."""
    if isinstance(m.get("tool_calls"), str):
        try:
            return {**m, "tool_calls": json.loads(m["tool_calls"])}
        except json.JSONDecodeError:
            return m
    return m


def calls_as_json(messages):
    """Messages with their tool_calls lists as JSON strings (see RecordFormat.arrow_safe)."""
    if not isinstance(messages, list):
        return messages
    return [
        {**m, "tool_calls": json.dumps(m["tool_calls"])}
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list)
        else m
        for m in messages
    ]


def calls_problem(calls, where: str) -> str | None:
    if isinstance(calls, str):
        return f"{where}.tool_calls is a string but not valid JSON ({calls!r:.60})"
    if not isinstance(calls, list) or not calls:
        what = f"{type(calls).__name__} ({calls!r:.40})"
        return f"{where}.tool_calls must be a non-empty list of calls, not {what}"
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return (
                f"{where}.tool_calls[{j}] must be a call "
                '{"type": "function", "function": {"name": ..., "arguments": {...}}}'
            )
        if "arguments" in fn and fn["arguments"] is not None and call_arguments(call) is None:
            return (
                f"{where}.tool_calls[{j}] ({fn['name']}): arguments must be a JSON object or a string "
                f"holding one, not {fn['arguments']!r:.60}"
            )
    return None


def message_problem(m: dict, where: str, content_label: str) -> str | None:
    """What is wrong with a message's content, calls, reasoning or train mark (its role is checked by the
    caller). An assistant message with tool_calls may have empty or null content."""
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant":
            return f"{where} has tool_calls but role {m.get('role')!r}; only assistant messages call tools"
        if why := calls_problem(calls, where):
            return why
    content = m.get("content")
    if not isinstance(content, str) and not (content is None and calls is not None):
        return f"{where} must have a string {content_label}" + (
            " (null is allowed only beside tool_calls)"
            if content is None
            else f", not {type(content).__name__}"
        )
    trace = m.get("reasoning_content")
    if trace is not None and (not isinstance(trace, str) or m.get("role") != "assistant"):
        return f"{where}.reasoning_content must be a string on an assistant message"
    mark = m.get("train")
    if mark is not None and not isinstance(mark, bool):
        return f"{where}.train must be true or false, not {mark!r:.40}"
    if mark is not None and m.get("role") != "assistant":
        return f"{where}.train marks assistant turns only ({m.get('role')} messages never carry labels)"
    return None


def clean(m: dict, role: str, content) -> dict:
    """A checked message as the chat template gets it: role, content (null -> ""), and the tool calls
    (arguments as dicts), reasoning trace, train mark and tool-result keys that are set (null values, which
    Arrow gives keys another record had, are dropped)."""
    out = {"role": role, "content": content if content is not None else ""}
    if m.get("tool_calls") is not None:
        out["tool_calls"] = [clean_call(call) for call in m["tool_calls"]]
    for k in OPTIONAL[1:]:
        if m.get(k) is not None:
            out[k] = m[k]
    return out


def clean_call(call: dict) -> dict:
    args = call_arguments(call) if call["function"].get("arguments") is not None else {}
    out = {k: v for k, v in call.items() if v is not None}
    fn = {k: v for k, v in call["function"].items() if v is not None}
    return {**out, "type": out.get("type") or "function", "function": {**fn, "arguments": args}}


def conversation_problem(messages: list[dict], tools: list[dict] | None, list_label: str) -> str | None:
    """Calls name tools of the record's tools list; every tool message answers a call before it."""
    known = {tool_name(t) for t in tools or []}
    open_calls = 0  # calls of the last assistant message not yet answered
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            open_calls = len(m.get("tool_calls", []))
            for call in m.get("tool_calls", []):
                name = call["function"]["name"]
                if name not in known:
                    have = (
                        f"the record's tools are {', '.join(sorted(known))}"
                        if known
                        else "the record has no tools"
                    )
                    return f"{list_label}[{i}] calls tool {name!r}, which is not in tools ({have})"
        elif m["role"] == "tool":
            if open_calls == 0:
                return (
                    f"{list_label}[{i}] is a tool result with no call before it (a tool message answers "
                    f"a call in the tool_calls of the assistant message before it)"
                )
            open_calls -= 1
        else:
            open_calls = 0
    return None


def trace_of(m: dict) -> str | None:
    """The reasoning trace of an assistant message: reasoning_content, or <think>...</think> opening the
    content; None without one."""
    if m.get("role") != "assistant":
        return None
    if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"].strip():
        return m["reasoning_content"]
    found = THINK.match(m.get("content") or "")
    return found.group(1) if found and found.group(1).strip() else None


def inline_trace(m: dict) -> dict:
    """For templates that do not render reasoning_content: the trace put into the content, as
    <think>\\n...\\n</think>\\n\\n before the answer."""
    if m.get("reasoning_content") is None:
        return m
    out = {k: v for k, v in m.items() if k != "reasoning_content"}
    if m["reasoning_content"].strip():
        out["content"] = f"<think>\n{m['reasoning_content'].strip()}\n</think>\n\n{m['content']}"
    return out


OPEN_THINK = re.compile(r"\s*<think>(.*?)(?:</think>|$)", re.DOTALL)  # closed, or still streaming
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_reply(text: str, tokenizer=None, prefix: str = "") -> dict:
    """A generated reply as the assistant message a chat template renders back: {"role", "content"}, with
    "reasoning_content" and "tool_calls" where the reply has them. The tokenizer's response template
    (transformers' `parse_response`; `prefix`: the rendered prompt) where it has one; else the Hermes/Qwen
    tags that data/tools/chatml_tools.jinja writes: <think>...</think> opening the reply (unclosed: the
    reasoning so far, while it streams) and <tool_call>{"name": ..., "arguments": {...}}</tool_call> (a call
    that is not such a JSON object stays in the content as written)."""
    if tokenizer is not None and getattr(tokenizer, "response_template", None):
        try:
            return {"role": "assistant", "content": "", **tokenizer.parse_response(text, prefix=prefix)}
        except Exception:  # a reply the template does not fit (cut short, say): read as the tags below
            pass
    message = {"role": "assistant"}
    if found := OPEN_THINK.match(text):
        message["reasoning_content"] = found.group(1).strip()
        text = text[found.end() :]
    calls = []

    def call(found: re.Match) -> str:
        try:
            c = json.loads(found.group(1))
        except ValueError:
            return found.group(0)
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return found.group(0)
        arguments = c.get("arguments", c.get("parameters", {}))
        calls.append({"type": "function", "function": {"name": c["name"], "arguments": arguments}})
        return ""

    rest = TOOL_CALL.sub(call, text)
    message["content"] = rest.strip() if calls or "reasoning_content" in message else rest  # else as written
    if calls:
        message["tool_calls"] = calls
    return message


def learns(m: dict) -> bool:
    """An assistant message with something to learn (an answer, a call or a trace)."""
    return bool((m.get("content") or "").strip() or m.get("tool_calls") or trace_of(m))


def trained_turns(messages: list[dict], start: int, train_on: str) -> list[int]:
    """Indices of the assistant messages that carry labels, from message `start` on (a prompt-completion
    record's completion): a message's "train" mark wins; unmarked ones follow train_on (all: every one;
    last: the last assistant message; marked: none)."""
    assistants = [i for i in range(start, len(messages)) if messages[i]["role"] == "assistant"]
    last = assistants[-1] if assistants else None
    chosen = []
    for i in assistants:
        mark = messages[i].get("train")
        default = train_on == "all" or (train_on == "last" and i == last)
        if mark if mark is not None else default:
            chosen.append(i)
    return chosen
