"""Record formats: check one record and turn it into chat messages; the chat template that renders them.

  text         {"text": ...}
  instruction  {"instruction", "input"?, "output"}       (alpaca)   -> system?/user/assistant messages
  chat         {"messages": [{"role", "content"}, ...]}
  sharegpt     {"conversations": [{"from", "value"}, ...], "system"?}
  chat also takes prompt-completion records {"prompt", "completion"} (strings or message lists; loss on the
  completion only, see completions.py); pairwise/unpaired preference records are checked in preference.py.
`data.columns` maps these standard names to the names used in a dataset, e.g.
{messages: dialog, role: speaker, content: text}. Every problem is reported as a sentence naming the
field (with its mapped name), so the caller only adds the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from training.config import DataSection
from training.data import completions

# The template given to tokenizers that have none (and to tokenizers trained from scratch).
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a tokenizer without a chat template the ChatML one."""
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML


@dataclass(frozen=True)
class RecordFormat:
    format: str
    columns: dict[str, str] = field(default_factory=dict)
    system_prompt: str | None = None

    def name(self, standard: str) -> str:
        return self.columns.get(standard, standard)

    def label(self, standard: str) -> str:
        """How a field is named in messages: 'body' (data.columns: text -> body) or 'text'."""
        actual = self.name(standard)
        return f"'{actual}' (data.columns: {standard} -> {actual})" if actual != standard else f"'{standard}'"

    @property
    def list_field(self) -> str:
        return "messages" if self.format == "chat" else "conversations"

    @property
    def turn_keys(self) -> tuple[str, str]:
        return ("role", "content") if self.format == "chat" else ("from", "value")

    # ------------------------------------------------------------------ checking

    def problem(self, rec) -> str | None:
        """Why this record cannot be used, or None if it can."""
        if not isinstance(rec, dict):
            return "expected a JSON object"
        if self.format == "text":
            if not isinstance(rec.get(self.name("text")), str):
                return self._not_string(rec, "text", "format: text")
        elif self.format == "instruction":
            for k in ("instruction", "output"):
                if not isinstance(rec.get(self.name(k)), str):
                    hint = "format: instruction needs instruction, output and optional input"
                    return self._not_string(rec, k, hint)
            if rec.get(self.name("input")) is not None and not isinstance(rec[self.name("input")], str):
                return f"field {self.label('input')} must be a string"
        elif self.is_prompt_completion(rec):
            return self._prompt_completion_problem(rec)
        else:
            return self._turns_problem(rec)
        return None

    def is_prompt_completion(self, rec: dict) -> bool:
        """A chat-format record in TRL's prompt-completion shape (no messages list, a completion)."""
        return self.format == "chat" and self.name("messages") not in rec and self.name("completion") in rec

    def _prompt_completion_problem(self, rec: dict) -> str | None:
        for side, completion in (("prompt", False), ("completion", True)):
            if why := completions.side_problem(rec.get(self.name(side)), self.label(side), completion):
                return why
        if not completions.learns_something(self.messages(rec), self.completion_start(rec)):
            return f"no assistant message in {self.label('completion')}, so nothing to learn from"
        return None

    def completion_start(self, rec: dict) -> int:
        """Index of the first message that carries labels' turns: the completion of a prompt-completion
        record, else 0 (every assistant turn)."""
        if not self.is_prompt_completion(rec):
            return 0
        return len(completions.side_messages(rec[self.name("prompt")], "user"))

    def _not_string(self, rec: dict, standard: str, hint: str) -> str:
        value = rec.get(self.name(standard))
        if value is None:
            return f"missing string field {self.label(standard)} ({hint}){self._present(rec)}"
        return f"field {self.label(standard)} must be a string, not {type(value).__name__} ({value!r:.40})"

    def _present(self, rec: dict) -> str:
        return f"; the record has {', '.join(map(repr, list(rec)[:8]))}" if rec else "; the record is empty"

    def _turns_problem(self, rec: dict) -> str | None:
        lf, (rk, ck) = self.list_field, self.turn_keys
        turns = rec.get(self.name(lf))
        if not isinstance(turns, list) or not turns:
            return (
                f"missing non-empty list field {self.label(lf)} (format: {self.format}){self._present(rec)}"
            )
        roles = ROLES if self.format == "chat" else SHAREGPT_ROLES
        for i, m in enumerate(turns):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get(self.name(ck)), str)
                or m.get(self.name(rk)) is None
            ):
                return (
                    f"{self.name(lf)}[{i}] must be an object with {self.label(rk)} "
                    f"and string {self.label(ck)}"
                )
            if m[self.name(rk)] not in roles:
                return (
                    f"{self.name(lf)}[{i}] has unknown role {m[self.name(rk)]!r} "
                    f"(expected one of {', '.join(sorted(roles))})"
                )
        if not any(m["role"] == "assistant" for m in self.messages(rec)):
            return "no assistant message, so nothing to learn from"
        return None

    # ------------------------------------------------------------------ converting

    def messages(self, rec: dict) -> list[dict]:
        """The record as a list of {"role", "content"} messages (for the chat template)."""
        if self.format == "instruction":
            inp = rec.get(self.name("input"))
            prompt = rec[self.name("instruction")] + (f"\n\n{inp}" if inp else "")
            msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            answer = rec[self.name("output")]
            return msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        if self.is_prompt_completion(rec):
            prompt = completions.side_messages(rec[self.name("prompt")], "user")
            return prompt + completions.side_messages(rec[self.name("completion")], "assistant")
        rk, ck = (self.name(k) for k in self.turn_keys)
        turns = rec[self.name(self.list_field)]
        if self.format == "chat":
            return [{"role": m[rk], "content": m[ck]} for m in turns]
        msgs = [{"role": SHAREGPT_ROLES[m[rk]], "content": m[ck]} for m in turns]
        system = rec.get(self.name("system"))
        if isinstance(system, str) and system and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        return msgs


def record_format(data: DataSection) -> RecordFormat:
    """The record format that the recipe's data section describes."""
    return RecordFormat(data.format, dict(data.columns), data.system_prompt)


def instruction_to_messages(rec: dict, system_prompt: str | None) -> list[dict]:
    return RecordFormat("instruction", {}, system_prompt).messages(rec)
