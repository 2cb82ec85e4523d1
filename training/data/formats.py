"""Record formats: check one record and turn it into chat messages; the chat template that renders them.

  text         {"text": ...}
  instruction  {"instruction", "input"?, "output"}       (alpaca)   -> system?/user/assistant messages
  chat         {"messages": [{"role", "content"}, ...]}
  sharegpt     {"conversations": [{"from", "value"}, ...], "system"?}
  chat also takes prompt-completion records {"prompt", "completion"} (strings or message lists; loss on the
  completion only, see completions.py); pairwise/unpaired preference records are checked in preference.py.
Chat and sharegpt records may carry tools, tool calls and results, reasoning traces and per-turn train marks
(turns.py); a sharegpt `function_call` turn holds its call as JSON {"name", "arguments"} (or a list of them)
and becomes an assistant message with tool_calls.
`data.columns` maps these standard names to the names used in a dataset, e.g.
{messages: dialog, role: speaker, content: text}. Every problem is reported as a sentence naming the
field (with its mapped name), so the caller only adds the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from training.config import DataSection, ImageTokens
from training.core.errors import DataError
from training.data import completions, images, turns

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


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase, data: DataSection | None = None) -> None:
    """Give the tokenizer data.chat_template (a Jinja file) when the recipe sets one, else ChatML if it has
    no template."""
    if data is not None and data.chat_template is not None:
        tokenizer.chat_template = read_chat_template(data.chat_template)
        try:  # a broken template is named now, not in the middle of tokenizing
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                tokenize=False,
                **data.chat_template_kwargs,
            )
        except Exception as e:  # jinja2's errors, and whatever a template raises
            raise DataError(
                f"data.chat_template: {data.chat_template} cannot render a chat "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from None
    elif not tokenizer.chat_template:
        tokenizer.chat_template = CHATML


def read_chat_template(path: str, label: str = "data.chat_template") -> str:
    """The Jinja text of a chat template file; DataError naming `label` (the key or flag that gave it)."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise DataError(f"{label}: {path} {what}; name a Jinja chat template file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{label}: cannot read {path} ({e})") from None
    if not text.strip():
        raise DataError(f"{label}: {path} is empty")
    return text


@dataclass(frozen=True)
class RecordFormat:
    format: str
    columns: dict[str, str] = field(default_factory=dict)
    system_prompt: str | None = None
    train_on: str = "all"  # data.train_on: which assistant turns carry labels (turns.trained_turns)
    images: ImageTokens | None = None  # an image-text run's image tokens (records normalised by images.py)

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
        elif (
            self.images is None
            and self.format in ("chat", "sharegpt")
            and images.has_images(rec, self.name(self.list_field), self.name(self.turn_keys[1]))
        ):
            return (
                "the record carries images, but the model takes text only: train an image-text checkpoint "
                "(model.name_or_path), add model.vision (a new image-text model) to the recipe, or remove the images"
            )
        elif self.is_prompt_completion(rec):
            if self.images is not None:
                return "image-text runs read messages/conversations records, not prompt/completion ones (yet)"
            return self._prompt_completion_problem(rec) or self._agent_problem(rec)
        else:
            return self._turns_problem(rec) or self._agent_problem(rec)
        return None

    def tools(self, rec: dict) -> list[dict] | None:
        """The record's tool definitions (chat and sharegpt records), or None."""
        if self.format not in ("chat", "sharegpt"):
            return None
        return turns.parse_tools(rec.get(self.name("tools")), self.label("tools"))[0] or None

    def _agent_problem(self, rec: dict) -> str | None:
        """Tools, calls and results that fit together; something to learn under data.train_on."""
        tools, why = turns.parse_tools(rec.get(self.name("tools")), self.label("tools"))
        if why:
            return why
        msgs = self.messages(rec)
        where = "prompt + completion" if self.is_prompt_completion(rec) else self.name(self.list_field)
        if why := turns.conversation_problem(msgs, tools, where):
            return why
        if not turns.trained_turns(msgs, self.completion_start(rec), self.train_on):
            if self.train_on == "marked":
                return (
                    'no assistant message is marked "train": true (data.train_on: marked trains only those)'
                )
            return (
                f"every assistant message that data.train_on: {self.train_on} trains is marked "
                '"train": false, so nothing to learn from'
            )
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
        turns_ = rec.get(self.name(lf))
        if not isinstance(turns_, list) or not turns_:
            return (
                f"missing non-empty list field {self.label(lf)} (format: {self.format}){self._present(rec)}"
            )
        roles = ROLES if self.format == "chat" else SHAREGPT_ROLES
        for i, m in enumerate(turns_):
            if (
                not isinstance(m, dict)
                or not completions.has_content(m, self.name(ck))
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
            turn = self._turn(m)
            if m[self.name(rk)] == "function_call" and not isinstance(turn["tool_calls"], list):
                return (
                    f"{self.name(lf)}[{i}]: a function_call turn holds its call as JSON "
                    f'{{"name": ..., "arguments": {{...}}}} or a list of them, not {m[self.name(ck)]!r:.60}'
                )
            if why := turns.message_problem(turn, f"{self.name(lf)}[{i}]", self.label(ck)):
                return why
        if not any(m["role"] == "assistant" for m in self.messages(rec)):
            return "no assistant message, so nothing to learn from"
        return None

    # ------------------------------------------------------------------ converting

    def _turn(self, m: dict) -> dict:
        """One turn of a checked record with standard keys: role, content, and the optional keys of turns.py
        (tool_calls read from a JSON string; a sharegpt function_call's value is its calls)."""
        rk, ck = (self.name(k) for k in self.turn_keys)
        role = m[rk] if self.format == "chat" else SHAREGPT_ROLES[m[rk]]
        out = {**{k: m.get(k) for k in turns.OPTIONAL}, "role": role, "content": m.get(ck)}
        if self.format == "sharegpt" and m[rk] == "function_call":
            out.update(content="", tool_calls=m[ck])
        out = turns.parsed_calls(out)
        if self.format == "sharegpt" and m[rk] == "function_call":
            # {"name", "arguments"} or a list of them, as LLaMA-Factory writes them
            calls = out["tool_calls"]
            calls = [calls] if isinstance(calls, dict) else calls
            if isinstance(calls, list):
                out["tool_calls"] = [
                    {"type": "function", "function": c} if isinstance(c, dict) and "function" not in c else c
                    for c in calls
                ]
        return out

    def arrow_safe(self, rec: dict) -> dict:
        """The record with its tools and tool calls as JSON strings, for Dataset.from_list: Arrow would merge
        the keys of every record's arguments and schemas into one struct (filling the rest with null), or
        refuse arguments that are a dict in one record and a string in another."""
        if self.format not in ("chat", "sharegpt") or not isinstance(rec, dict):
            return rec
        out = dict(rec)
        if isinstance(out.get(self.name("tools")), list):
            out[self.name("tools")] = json.dumps(out[self.name("tools")])
        for k in (self.list_field, "prompt", "completion"):
            if self.name(k) in out:
                out[self.name(k)] = turns.calls_as_json(out[self.name(k)])
        return out

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
        msgs = [self._turn(m) for m in rec[self.name(self.list_field)]]
        msgs = [turns.clean(m, m["role"], m["content"]) for m in msgs]
        if self.format == "chat":
            return msgs
        system = rec.get(self.name("system"))
        if isinstance(system, str) and system and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        return msgs


def record_format(data: DataSection) -> RecordFormat:
    """The record format that the recipe's data section describes."""
    return RecordFormat(data.format, dict(data.columns), data.system_prompt, data.train_on, data.images)


def instruction_to_messages(rec: dict, system_prompt: str | None) -> list[dict]:
    return RecordFormat("instruction", {}, system_prompt).messages(rec)
