"""Huge pages for our commands (training/core/pages.py): which command lines relaunch, why not where they do not, the
relaunch's command line and environment, and a real `python -m training.core` relaunched in the same process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.core import pages

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "argv, module",
    [
        (["python", "-m", "training.train", "r.yaml"], "training.train"),
        (["python", "-u", "-m", "training.train", "r.yaml"], "training.train"),  # torchrun's ranks
        (["python", "-X", "dev", "-W", "ignore", "-mbenchmarks.agent_task"], "benchmarks.agent_task"),
        (["python", "script.py", "-m", "training.train"], None),
        (["python", "-c", "import training", "-m", "training.train"], None),
        (["python"], None),
    ],
)
def test_the_module_a_command_line_runs(argv, module):
    assert pages.command_module(argv) == module


def test_why_not_names_each_reason():
    ok = dict(glibc=(2, 36), thp="madvise", platform="linux")
    assert pages.why_not({}, **ok) is None
    assert pages.why_not({}, **{**ok, "thp": "always"}) is None
    assert "already sets it (glibc.malloc.hugetlb=0)" in pages.why_not(
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, **ok
    )
    assert pages.why_not({"LLM_FORGE_HUGE_PAGES": "0"}, **ok) == "LLM_FORGE_HUGE_PAGES=0"
    assert pages.why_not({}, **{**ok, "platform": "darwin"}) == "not Linux (darwin)"
    assert pages.why_not({}, **{**ok, "glibc": (2, 31)}) == "needs glibc 2.35 or later (this is 2.31)"
    assert pages.why_not({}, **{**ok, "glibc": None}) == "needs glibc 2.35 or later"
    assert pages.why_not({}, **{**ok, "thp": "never"}) == "the kernel's transparent huge pages are off"
    assert "cannot be read" in pages.why_not({}, **{**ok, "thp": None})


def test_the_tunable_joins_those_already_set():
    assert pages.with_tunable({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    both = pages.with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"]
    assert both == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_relaunch_executes_the_same_command_with_the_tunable(monkeypatch):
    calls = []
    monkeypatch.setattr(pages.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(pages.sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LLM_FORGE_HUGE_PAGES", raising=False)
    monkeypatch.delenv(pages.RELAUNCHED, raising=False)
    command = ["python3", "-u", "-m", "training.train", "a recipe.yaml", "train.lr=1e-4"]
    monkeypatch.setattr(pages.sys, "orig_argv", command, raising=False)
    pages.relaunch()
    ((executable, argv, env),) = calls
    assert executable == sys.executable and argv == [sys.executable, *command[1:]]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["PATH"] == os.environ["PATH"]
    # relaunched once only, even were the tunable dropped on the way
    monkeypatch.setenv(pages.RELAUNCHED, "1")
    pages.relaunch()
    monkeypatch.delenv(pages.RELAUNCHED)
    # not one of our commands, or opted out: nothing executed
    monkeypatch.setattr(pages.sys, "orig_argv", ["python3", "-m", "pytest"], raising=False)
    pages.relaunch()
    monkeypatch.setattr(pages.sys, "orig_argv", command, raising=False)
    monkeypatch.setenv("LLM_FORGE_HUGE_PAGES", "0")
    pages.relaunch()
    assert len(calls) == 1


@pytest.mark.parametrize("opt_out", [False, True])
def test_a_command_relaunches_itself_in_the_same_process(opt_out):
    """`python -m training.core` as a user starts it: on a machine where huge pages can be had it runs (same PID)
    with the tunable set and says so; elsewhere, and with LLM_FORGE_HUGE_PAGES=0, it says why not."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GLIBC_TUNABLES", "LLM_FORGE_HUGE_PAGES", pages.RELAUNCHED)
    }
    if opt_out:
        env["LLM_FORGE_HUGE_PAGES"] = "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.core"], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    assert lines["pid"] == str(proc.pid)
    reason = pages.why_not(env, pages.glibc_version(), pages.thp_mode())
    expected = "huge pages on (glibc.malloc.hugetlb=1)" if reason is None else f"huge pages off ({reason})"
    assert lines["memory"] == expected
    assert (reason == "LLM_FORGE_HUGE_PAGES=0") == opt_out
