"""The Chat tab's conversations and the Run tab's agent episodes as a Chatbot shows them: a reply's reasoning
and tool calls as titled sections, a tool's result as a titled message, and back again into the messages a
chat template renders; and why a message cannot be sent now."""

from __future__ import annotations

import json

from app.chat_models import ChatModels


def chat_refusal(chats: ChatModels, msg) -> str | None:
    """Why a message cannot be sent now (checked before the chat event, so that its panes and message box
    are not marked as failed), or None."""
    if not (msg or "").strip():
        return "message: type something first"
    if chats.slots["A"] is None and chats.slots["B"] is None:
        return "no model loaded: pick one and press Load A"
    return None


REASONING, TOOL_CALL = "Reasoning", "Tool call: "  # the titles of a reply's collapsible sections
TOOL_RESULT = "Tool result: "  # the title of a message sent as a tool's result


def pending_call(messages: list[dict]) -> str | None:
    """The name of the model's first tool call that no tool message after it answers yet (None: none)."""
    answered = 0
    for m in reversed(messages):
        if m["role"] == "tool":
            answered += 1
        elif m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            return calls[answered]["function"]["name"] if answered < len(calls) else None
        else:
            return None
    return None


def reply_messages(reply: dict, streaming: bool) -> list[dict]:
    """How one reply (an assistant message: training.data.turns.parse_reply) shows in a Chatbot: its
    reasoning as a collapsible section titled Reasoning (pending while it streams), each tool call as a
    section titled with the tool's name holding its arguments as JSON, then the answer."""
    shown = []
    if reply.get("reasoning_content"):
        status = "pending" if streaming and not reply.get("content") else "done"
        shown.append(_section(REASONING, reply["reasoning_content"], status))
    for call in reply.get("tool_calls") or []:
        f = call.get("function", call)
        arguments = f.get("arguments", {})
        text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, indent=2, ensure_ascii=False)
        )
        shown.append(_section(TOOL_CALL + str(f.get("name")), f"```json\n{text}\n```", "done"))
    if reply.get("content") or not shown:
        shown.append({"role": "assistant", "content": reply.get("content") or ""})
    return shown


def _section(title: str, text: str, status: str) -> dict:
    return {"role": "assistant", "content": text, "metadata": {"title": title, "status": status}}


def model_messages(hist: list[dict]) -> list[dict]:
    """A Chatbot's history as the model's conversation: the messages of one reply (reply_messages) become
    one assistant message again, with its reasoning_content and tool_calls, as the chat template renders
    them; a message sent as a tool result becomes a `tool` message named after its tool."""
    out = []
    for m in hist:
        text, title = _text(m["content"]), ((m.get("metadata") or {}).get("title") or "")
        if m["role"] == "user" and title.startswith(TOOL_RESULT):
            out.append({"role": "tool", "name": title[len(TOOL_RESULT) :], "content": text})
            continue
        if m["role"] != "assistant":
            out.append({"role": m["role"], "content": text})
            continue
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        reply = out[-1]
        if title == REASONING:
            reply["reasoning_content"] = text
        elif title.startswith(TOOL_CALL):
            body = text.strip().removeprefix("```json").removesuffix("```").strip()
            try:
                arguments = json.loads(body)
            except ValueError:
                arguments = body
            call = {"type": "function", "function": {"name": title[len(TOOL_CALL) :], "arguments": arguments}}
            reply.setdefault("tool_calls", []).append(call)
        else:
            reply["content"] += text
    return out


def _text(content) -> str:
    """A Chatbot message's content as plain text (gradio 6 sends a list of typed parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(_text(c) for c in content)
    return str(content)
