"""app/tool_server.py: a tool forked from the warm server is the process `python -m MODULE` would have been (its
output, exit code, working directory first on sys.path, environment, arguments), a hung one ends at its timeout,
and the app process that starts the server imports no training code itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from app import tool_server
from conftest import ROOT

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                      "var": os.environ.get("PROBE_VAR"), "sid": os.getsid(0) == os.getpid()}))
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "hang":
        time.sleep(60)
    if sys.argv[1] == "raise":
        raise ValueError("the probe failed")
    raise SystemExit(int(sys.argv[1]))
    """
)


@pytest.fixture
def probe_dir(tmp_path):
    (tmp_path / "probe_tool.py").write_text(
        PROBE
    )  # importable only from its directory, as `python -m` finds it
    return tmp_path


def forked(probe_dir, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROBE_VAR": "from the app"}
    return tool_server.run(["probe_tool", *args], cwd=probe_dir, env=env, timeout=timeout)


def test_a_forked_tool_is_what_python_dash_m_would_have_been(probe_dir):
    fresh = subprocess.run(
        [sys.executable, "-m", "probe_tool", "0", "--json"],
        cwd=probe_dir,
        env={**os.environ, "PROBE_VAR": "from the app"},
        capture_output=True,
        text=True,
    )
    got = forked(probe_dir, "0", "--json")
    assert got.returncode == fresh.returncode == 0
    assert json.loads(got.stdout) == {**json.loads(fresh.stdout), "sid": True}  # and in a session of its own
    assert json.loads(got.stdout)["path0"] == str(probe_dir) and got.stderr == fresh.stderr == "to stderr\n"


def test_exit_codes_and_a_traceback_reach_the_app(probe_dir):
    assert forked(probe_dir, "2").returncode == 2
    failed = forked(probe_dir, "raise")
    assert failed.returncode == 1
    assert "ValueError: the probe failed" in failed.stderr and failed.stderr.startswith("to stderr\n")


def test_a_child_that_ends_before_the_tool_runs_reads_as_empty_output(probe_dir, monkeypatch):
    monkeypatch.setattr(tool_server, "_child", _dies_at_once)
    got = forked(probe_dir, "0")
    assert (got.returncode, got.stdout, got.stderr) == (-9, "", "")


def _dies_at_once(*args) -> None:
    os.kill(os.getpid(), 9)


def test_a_hung_tool_is_killed_at_its_timeout(probe_dir):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forked(probe_dir, "hang", timeout=3)
    assert time.monotonic() - start < 30
    assert '"argv": ["hang"]' in e.value.stdout  # what it wrote before it hung comes with the error


def test_the_apps_server_imports_the_tools_and_the_app_process_none(tmp_path):
    """In a fresh interpreter, as `python -m app` is: after set_up(), the first tool starts the server with PRELOAD
    imported and answers; the app process has imported neither torch nor training.preview."""
    script = textwrap.dedent(
        """
        import json, os, sys, time
        from app import tool_server
        tool_server.set_up()
        t = time.monotonic()
        done = tool_server.run(["training.preview", "--help"], cwd=sys.argv[1], env=dict(os.environ), timeout=300)
        import multiprocessing.forkserver as fs
        print(json.dumps({"rc": done.returncode, "usage": done.stdout.splitlines()[0],
                          "mine": sorted(m for m in ("torch", "training.preview") if m in sys.modules),
                          "preload": fs._forkserver._preload_modules}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["usage"].startswith("usage: python -m training.preview"), got
    assert got["mine"] == [] and got["preload"] == tool_server.PRELOAD, got
