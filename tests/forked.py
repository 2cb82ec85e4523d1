"""Command lines run as children of a fork server instead of fresh interpreters.

Most of the suite's CPU is interpreters starting: each imports torch, transformers and accelerate (~8 CPU-s
on the 2-core test machines) before doing a second of work. A test that runs `python -m training.train ...`
or `accelerate launch ...` to check what it prints, writes and exits with gets the same from a child
forked from a server (one per test worker, started on first use) that has imported them once: the child
takes the argv, environment and working directory it would have had, runs the same entry point (runpy's
`-m`, accelerate's console script), runs its atexit handlers, and exits with the code the command would
have. The ranks an `accelerate launch` starts are fresh interpreters, exactly as from a shell.

Not for a command whose environment changes what a library reads when it is imported (HF_HUB_OFFLINE,
PYTHONWARNINGS, DeepSpeed's op-build variables: conftest.run_cli with env), nor for a launch whose ranks
read the launcher's own command line (pipeline and expert-parallel keys: training.launch.backend.
launcher_config_file reads the parent's `--config_file`, which a forked child's /proc cmdline does not
show): those run in a fresh interpreter (`fresh=True`).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = [
    "accelerate.commands.accelerate_cli",
    "torch.distributed.run",
    "training.train",
    "training.chat",
    "training.export",
    "training.evaluate",
]
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(PRELOAD)


def run(
    argv: list[str], *, env: dict, cwd: Path, timeout: float, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`argv` ([sys.executable, "-m", module, ...] or [path of `accelerate`, ...]) as a forked child (or,
    `fresh`, a new interpreter) in its own process group (a timeout kills it with everything it started),
    with stdout and stderr captured."""
    if fresh:
        return _fresh(argv, env=env, cwd=cwd, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = _SERVER.Process(target=_child, args=(list(argv), dict(env), str(cwd), str(out), str(err)))
        child.start()
        child.join(timeout)
        timed_out = child.exitcode is None
        if timed_out:
            os.killpg(child.pid, signal.SIGKILL)
            child.join()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, child.exitcode, stdout, stderr)


def _fresh(argv: list[str], *, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    with subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(argv, popen.returncode, stdout, stderr)


def _child(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    try:
        if Path(argv[0]).name == "accelerate":
            from accelerate.commands.accelerate_cli import main

            sys.argv = list(argv)
            main()
        else:
            assert argv[1] == "-m", argv
            module = argv[2]
            sys.argv = [module, *argv[3:]]  # runpy sets argv[0] to the module's file, as `python -m` does
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends a child with os._exit, which skips them
        sys.stdout.flush()
        sys.stderr.flush()
