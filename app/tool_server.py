"""The app's short tools (training.preview's data check and preview, training.support) as children forked from a
warm interpreter, instead of fresh ones.

A fresh `python -m training.preview` spends most of its time importing torch, transformers and training (8-9 s on
a 2-core CPU, 16 s for a data check on a busy one) before it reads a record. The first tool the app runs starts
one server (multiprocessing's forkserver: a fresh interpreter that imports PRELOAD once, `set_up`, and then forks a
child per request); each tool then runs in a child of it, as the same process it would have
been: its own session, the workspace as its working directory (first on sys.path, as `python -m` puts it), the
environment the app gives its tools, stdout and stderr to files, `runpy`'s `-m` with its arguments, atexit
handlers run, and its exit code (SystemExit's, 1 for an exception, minus the signal that killed it). The app
process itself still imports no training code, and a tool that crashes or hangs ends only its child. The
server holds about 0.6 GB while the app runs and ends with it.

What a child cannot take from its environment is what a library read when the server imported it: the server
is started with the app's environment (and this repository on PYTHONPATH), which is what tool_env gives every
tool besides variables read when the tool runs (app/runs.py). Where forkserver does not exist (Windows), tools
run as fresh interpreters.

SIGUSR2 makes a child write every thread's Python stack to its stderr (a hang's whereabouts; tests use it).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from app.workspace import REPO_ROOT

PRELOAD = ["training.preview", "training.support"]
STACKS = signal.SIGUSR2
_FORKSERVER = "forkserver" in multiprocessing.get_all_start_methods()
_START = threading.Lock()


def set_up() -> None:
    """The app's start: the server that the first tool starts imports PRELOAD before its first fork. Not started
    here, in the background: beside a headless Chromium loading the page on 2 cores, that start left the page's
    renderer busy on a whole core for the rest of the browser walk in 4 runs of 9 (walk 331-363 s against 63-95 s;
    0 of 3 without it)."""
    if _FORKSERVER:
        multiprocessing.set_forkserver_preload(PRELOAD)


def _ensure_running() -> None:
    """The server, started if it is not yet, with this repository importable whatever the app's working directory."""
    with _START:
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), before]))
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before


def run(module_args: list[str], *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS...` (`module_args`) in `cwd` with `env`, waited for, its output captured: a forked child
    of the server, or a fresh interpreter where there is none. subprocess.TimeoutExpired past `timeout` (the child's
    session killed)."""
    argv = [sys.executable, "-m", *module_args]
    if not _FORKSERVER:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    _ensure_running()
    with tempfile.TemporaryDirectory(prefix="llm-forge-tool-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        for path in (out, err):  # a child that ends before it runs the tool reads as one with no output
            path.touch()
        child = multiprocessing.get_context("forkserver").Process(
            target=_child, args=(module_args, dict(env), str(cwd), str(out), str(err)), daemon=False
        )
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.join()
            raise subprocess.TimeoutExpired(
                argv, timeout, out.read_text(errors="replace"), err.read_text(errors="replace")
            )
        return subprocess.CompletedProcess(
            argv, child.exitcode, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def _child(module_args: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    become(env, cwd, stdout, stderr, truncate=True)
    # the child came with the app's sys.path (multiprocessing's preparation data): its first entry is the app's own
    # directory, where `python -m` puts its working directory
    sys.path[0] = cwd
    try:
        run_module(module_args[0], module_args[1:])
    finally:
        end()


def become(env: dict, cwd: str, stdout: str, stderr: str, truncate: bool) -> None:
    """This child's session, working directory, environment and output files (`truncate`d, or appended to: a
    launcher and its ranks write to the same files), whole lines written at once as `python -u` writes them."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0), 0o644)
        os.dup2(f, fd)
        os.close(f)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    faulthandler.register(STACKS, file=sys.stderr, all_threads=True)


def run_module(module: str, args: list[str]) -> None:
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def end() -> None:
    """What an interpreter does at its end that a multiprocessing child skips (it ends with os._exit)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
