"""The built-in python tool (training/objectives/sandbox.py) under attack: each attack ends as an error text
returned to the episode, within the limits, and leaves nothing behind; ordinary code runs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import ROOT
from training.rl.sandbox import Sandbox, make_python_tool
from training.rl.tools import call_tool

BOX = Sandbox(timeout_s=2, output_chars=300)
# for the attacks that are not about time: a fresh interpreter in a new network namespace took over 2 s to start
# on a 2-core machine busy with the suite's other worker, and the socket attack read "timed out" instead of refused
PATIENT = Sandbox(timeout_s=8, output_chars=300)


def test_ordinary_code_runs_and_prints():
    assert BOX.run("print(sum(range(10)))") == "45\n"
    assert BOX.run("open('a.txt', 'w').write('kept'); print(open('a.txt').read())") == "kept\n"  # its own dir
    assert "ZeroDivisionError: division by zero" in BOX.run("1 / 0")
    assert BOX.run("raise SystemExit(3)").endswith("error: exit code 3")


@pytest.mark.parametrize(
    "attack, said",
    [
        ("while True: pass", "error: timed out after 2 s"),
        ("import time; time.sleep(60)", "error: timed out after 2 s"),
        ("import os\nwhile True: os.fork()", "os.fork is not allowed"),
        ("import subprocess; subprocess.run(['ls'])", "not allowed"),
        ("x = bytearray(10 * 1024**3)", "MemoryError"),
        (f"print(open({str(ROOT / 'pyproject.toml')!r}).read())", "is not allowed in this sandbox"),
        ("open('/tmp/llm-forge-sandbox-escape.txt', 'w').write('x')", "is not allowed in this sandbox"),
        ("import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)", "not allowed"),
        ("while True: print('x' * 10000)", "error: output over the limit"),
    ],
    ids=[
        "loop",
        "sleep",
        "fork-bomb",
        "subprocess",
        "10GB",
        "read-run-files",
        "write-outside",
        "socket",
        "flood",
    ],
)
def test_each_attack_ends_as_a_tool_error(attack, said):
    start = time.perf_counter()
    out = (BOX if "timed out" in said else PATIENT).run(attack)
    assert said in out and "error" in out
    assert len(out) < 700  # the output is cut to its stated size (and a line saying so)
    assert time.perf_counter() - start < 10
    assert not Path("/tmp/llm-forge-sandbox-escape.txt").exists()


def test_the_tool_reports_its_failure_to_the_episode():
    tools = {"python": make_python_tool(BOX)}
    msg, failed = call_tool(tools, {"function": {"name": "python", "arguments": {"code": "1/0"}}}, 2000)
    assert failed and msg["role"] == "tool" and "ZeroDivisionError" in msg["content"]
    msg, failed = call_tool(tools, {"function": {"name": "python", "arguments": {"code": "print(2)"}}}, 2000)
    assert not failed and msg["content"] == "2\n"
