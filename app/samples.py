"""Online RL's samples in the Run tab: the latest step's prompt / completion / reward table, and its agent
episodes as conversations (each reply's tool calls and each tool's result as titled sections, as the Chat tab
shows them)."""

from __future__ import annotations

import json

from app.chat_messages import TOOL_RESULT, reply_messages


def samples_markdown(samples: list[dict]) -> str:
    """Online RL: the latest step's prompt / completion / reward samples, as a table."""
    if not samples:
        return ""

    def cell(x) -> str:
        text = x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)
        return text.replace("|", "\\|").replace("\n", " ")[:160]

    lines = [
        f"**Samples of step {samples[0]['step']}** (online RL)",
        "",
        "| prompt | completion | reward | advantage |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {cell(s['prompt'])} | {cell(s['completion'])} | {s['reward']:.3f} | {s['advantage']:+.3f} |"
        for s in samples
    ]
    return "\n".join(lines)


def prompt_text(prompt) -> str:
    """The user's last message of a prompt (or the prompt string)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"]
    return str((users[-1] if users else prompt[-1]).get("content") or "")


def episode_messages(samples: list[dict]) -> list[dict]:
    """The samples that are agent episodes (they carry `messages`) as one Chatbot conversation: per episode,
    its prompt, then each reply (reasoning and tool calls as sections) and each tool result (a section titled
    with the tool's name), closed by its reward and advantage. [] when the run's samples are single replies."""
    shown = []
    for k, s in enumerate(x for x in samples if x.get("messages")):
        title = f"Episode {k + 1} (step {s['step']}, row {s['row']})"
        shown.append({"role": "user", "content": prompt_text(s["prompt"]), "metadata": {"title": title}})
        for m in s["messages"]:
            if m.get("role") == "tool":
                title = TOOL_RESULT + str(m.get("name") or "tool")
                shown.append(
                    {"role": "user", "content": m.get("content") or "", "metadata": {"title": title}}
                )
            else:
                shown += reply_messages(m, streaming=False)
        summary = f"reward {s['reward']:.3f}, advantage {s['advantage']:+.3f}"
        shown.append(
            {"role": "assistant", "content": summary, "metadata": {"title": "Scored", "status": "done"}}
        )
    return shown
