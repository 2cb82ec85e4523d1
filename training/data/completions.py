"""Prompts and completions, the parts of TRL's standard dataset types (prompt-completion, preference, KTO).

A side of a record is a string or a list of {"role", "content"} messages:
  prompt      "What is 2+2?"                 -> [{"role": "user", "content": ...}]
  completion  "4"                            -> [{"role": "assistant", "content": ...}]
  either      [{"role": ..., "content": ...}, ...]  (kept as it is)
The prompt goes through the chat template; only the completion's assistant turns carry labels
(`tokenize.tokenize_chat(..., train_from=len(prompt))`). Chat-shaped pairs without a prompt
(UltraFeedback: chosen/rejected are whole conversations) share their longest common prefix as the prompt.
"""

from __future__ import annotations

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
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            return f"{label}[{i}] must be an object with 'role' ({', '.join(ROLES)}) and string 'content'"
    return None


def side_messages(value, role: str) -> list[dict]:
    """A checked side as chat messages (a string becomes one message of `role`)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return [{"role": m["role"], "content": m["content"]} for m in value]


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
    return any(m["role"] == "assistant" and m["content"].strip() for m in messages[start:])
