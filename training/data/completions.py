"""Prompts and completions, the parts of TRL's standard dataset types (prompt-completion, preference, KTO).

A side of a record is a string or a list of {"role", "content"} messages (with tool calls, reasoning
traces and train marks as in turns.py):
  prompt      "What is 2+2?"                 -> [{"role": "user", "content": ...}]
  completion  "4"                            -> [{"role": "assistant", "content": ...}]
  either      [{"role": ..., "content": ...}, ...]  (kept as it is)
The prompt goes through the chat template; only the completion's assistant turns carry labels
(`tokenize.tokenize_chat(..., train_from=len(prompt))`). Chat-shaped pairs without a prompt
(UltraFeedback: chosen/rejected are whole conversations) share their longest common prefix as the prompt.
"""

from __future__ import annotations

from training.data import turns

ROLES = ("system", "user", "assistant", "tool")


def side_problem(value, label: str, completion: bool) -> str | None:
    """Why one side of a record (a prompt, completion, chosen or rejected) cannot be used; None if it can."""
    if value is None:
        return f"missing field {label}"
    if isinstance(value, str):
        if completion and not value.strip():
            return f"field {label} is an empty completion"
        return None
    if not isinstance(value, list) or (completion and not value):
        return f"field {label} must be a string or a non-empty list of messages, not {type(value).__name__}"
    for i, m in enumerate(value):
        m = turns.parsed_calls(m) if isinstance(m, dict) else m
        if not isinstance(m, dict) or not has_content(m, "content") or m.get("role") not in ROLES:
            return f"{label}[{i}] must be an object with 'role' ({', '.join(ROLES)}) and string 'content'"
        if why := turns.message_problem(m, f"{label}[{i}]", "'content'"):
            return why
    return None


def has_content(m: dict, key: str) -> bool:
    """A string content, or none beside tool calls (an assistant turn that only calls tools)."""
    return isinstance(m.get(key), str) or (m.get(key) is None and m.get("tool_calls") is not None)


def side_messages(value, role: str) -> list[dict]:
    """A checked side as chat messages (a string becomes one message of `role`)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return [turns.clean(m, m["role"], m.get("content")) for m in map(turns.parsed_calls, value)]


def split_shared_prompt(
    chosen: list[dict], rejected: list[dict]
) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen completion, rejected completion) of two whole conversations: the prompt is their
    longest common prefix of messages (each keeps at least its last message)."""
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def learns_something(messages: list[dict], start: int) -> bool:
    return any(m["role"] == "assistant" and turns.learns(m) for m in messages[start:])
