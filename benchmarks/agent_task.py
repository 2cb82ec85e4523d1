"""The bundled agent task (data/agent) scored in a fresh process with plain transformers and peft: for each
held-out question a greedy episode (up to 3 replies; a <tool_call> JSON in a reply is run with the task's own
calculator and its result appended as a tool message), the final reply checked by the task's own verifier.
Nothing of training.objectives runs here: the episode loop and the call parsing are written out again.

    python -m benchmarks.agent_task                         # SmolLM2-135M-Instruct as bundled
    python -m benchmarks.agent_task runs/agent_sft          # after training/recipes/agent_sft.yaml
    python -m benchmarks.agent_task runs/agent_grpo         # after agent_sft.yaml, then agent_grpo.yaml

Prints each question's episode in one line, then the pass rate, calls per episode and seconds.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import torch
from transformers.utils import get_json_schema

from benchmarks.common import bundled_policy, policy_parser

ROOT = Path(__file__).resolve().parents[1]
CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def task():
    spec = importlib.util.spec_from_file_location("agent_task", ROOT / "data/agent/task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def episode(
    model, tokenizer, prompt: list[dict], tools: list[dict], calculate, max_new_tokens: int
) -> list[dict]:
    """A greedy episode: the completion's messages (replies and tool results)."""
    messages, completion = list(prompt), []
    for _ in range(3):
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        calls = []
        for found in CALL.findall(text):
            try:
                call = json.loads(found)
                calls.append(
                    {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
                )
            except (ValueError, KeyError, TypeError):
                pass
        reply = {"role": "assistant", "content": CALL.sub("", text).strip() if calls else text}
        if calls:
            reply["tool_calls"] = calls
        messages.append(reply)
        completion.append(reply)
        if not calls:
            break
        for c in calls:
            f = c["function"]
            ok = f["name"] == "calculate" and isinstance(f["arguments"], dict)
            result = (
                calculate(**f["arguments"])
                if ok and set(f["arguments"]) == {"expression"}
                else "error: bad call"
            )
            tool = {"role": "tool", "name": f["name"], "content": result}
            messages.append(tool)
            completion.append(tool)
    return completion


def main(argv=None) -> None:
    ap = policy_parser(__doc__, 48)
    ap.add_argument("--limit", type=int, default=0, help="the first N held-out questions only")
    args = ap.parse_args(argv)
    t = task()
    model, tokenizer = bundled_policy(args.run)
    tokenizer.chat_template = (ROOT / "data/tools/chatml_tools.jinja").read_text()
    tools = [get_json_schema(t.calculate)]
    rows = [json.loads(x) for x in (ROOT / "data/agent/eval.jsonl").read_text().splitlines()]
    rows = rows[: args.limit] if args.limit else rows
    start, passed, calls = time.perf_counter(), 0, 0
    for r in rows:
        completion = episode(model, tokenizer, r["prompt"], tools, t.calculate, args.max_new_tokens)
        ok = t.correct([completion], [r["answer"]])[0]
        passed += ok
        calls += sum(len(m.get("tool_calls", [])) for m in completion)
        shown = " | ".join(
            f"{m['role']}: {json.dumps(m.get('tool_calls')) if m.get('tool_calls') else m['content']}"[:90]
            for m in completion
        )
        print(f"{'PASS' if ok else 'fail'} {r['prompt'][-1]['content'][:44]!r:48} {shown}")
    n = len(rows)
    print(
        f"{args.run or 'bundled SmolLM2-135M-Instruct'}: pass rate {passed / n:.3f} ({int(passed)}/{n}), "
        f"{calls / n:.2f} calls per episode, {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
