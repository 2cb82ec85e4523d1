"""The calculator task's tool and verifier (data/make_agent_task.py makes its data; training/recipes/agent_sft.yaml
and agent_grpo.yaml train on it): the tool is named in a recipe as data/agent/task.py:calculate, the verifier as
the reward data/agent/task.py:correct."""

from __future__ import annotations

import ast
import operator
import re

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only numbers, + - * / and parentheses")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression, e.g. (3 + 4) * 2
    """
    try:
        value = _value(ast.parse(expression.replace("x", "*"), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def final_number(text: str) -> str | None:
    """The last whole number in a reply (digits with optional thousands commas), without the commas."""
    found = re.findall(r"-?\d[\d,]*", text or "")
    return found[-1].replace(",", "") if found else None


def correct(completions, answer, **kwargs) -> list[float]:
    """1.0 where the episode's final reply ends with the answer (its last number), else 0.0: the verifier."""
    out = []
    for completion, want in zip(completions, answer):
        replies = (
            [m for m in completion if m.get("role") == "assistant"] if isinstance(completion, list) else []
        )
        text = replies[-1].get("content") if replies else completion if isinstance(completion, str) else ""
        out.append(float(final_number(text) == str(want)))
    return out
