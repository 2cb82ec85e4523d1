"""Command lines run as children of a fork server instead of fresh interpreters.

Most of the suite's CPU is interpreters starting: each imports torch, transformers and accelerate (~8 CPU-s
on the 2-core test machines) before doing a second of work. A test that runs `python -m training.train ...`
or `accelerate launch ...` to check what it prints, writes and exits with gets the same from a child
forked from a server (one per test worker, started on first use) that has imported them once: the child
takes the argv, environment and working directory it would have had, runs the same entry point (runpy's
`-m`, accelerate's console script), runs its atexit handlers, and exits with the code the command would
have. The ranks such a launch starts are forked from the same server too: torch's elastic agent, running in
the forked launcher, starts each worker through `SubprocessHandler._popen`, which here asks the server for a
child that runs the worker's `python -u -m MODULE ...` the same way, in its own session (the agent signals
its process group), writing to the launcher's stdout and stderr (or the agent's redirect files), and
reports its exit code or signal to the agent as a Popen would; a one-process launch (accelerate's simple
launcher, `distributed_type: "NO"`, which starts its `python -m MODULE ...` with subprocess.Popen) gets its
process the same way. What differs from a fresh interpreter is only what the server imported before the
launch set the worker's environment: libraries that read an environment variable at import see the test
worker's value (OMP_NUM_THREADS is applied again with torch.set_num_threads).

A forked rank's parent is the server, not the launcher, so it cannot read the launcher's `--config_file`
from its parent's command line as training.launch.backend.launcher_config_file does (for the pipeline
and expert-parallel keys accelerate does not pass on): it is given LLM_FORGE_ACCELERATE_CONFIG, the
variable that function reads first (what launchers other than `accelerate launch` set). A launch that
proves the command-line reading runs fresh (`fresh=True`), as does a command whose environment changes
what a library reads when it is imported (HF_HUB_OFFLINE, PYTHONWARNINGS, DeepSpeed's op-build
variables: conftest.run_cli with env).

Past its timeout a forked command is asked for every thread's stack in each of its processes (faulthandler on
SIGUSR2, written to its stderr) before it is killed, so that a hang's failure says where each process waited.
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
import time
from pathlib import Path

PRELOAD = [
    "accelerate.commands.accelerate_cli",
    "torch.distributed.run",
    "training.train",
    "training.chat",
    "training.export",
    "training.evaluate",
    # imported by each run's main process to draw loss.png (training.run.metrics.plot_loss); preloaded, a forked
    # 2-step tiny run took 1.12 s instead of 1.35 s (quiet 2-core Zen 4). Its backend is chosen at the first figure.
    "matplotlib.pyplot",
    # DeepSpeed (about 1 s of imports, in the launcher and each rank of a ZeRO launch); it starts no thread and
    # initialises no device when imported (its accelerator is the CPU's here; a CUDA machine runs fresh ones)
    "deepspeed",
    "warm_server",  # last: warms what each child would do once, then freezes the heap (its docstring)
]
STACKS = signal.SIGUSR2  # a forked child or rank writes every thread's Python stack to its stderr on it
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(PRELOAD)


def run(
    argv: list[str], *, env: dict, cwd: Path, timeout: float, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`argv` ([sys.executable, "-m", module, ...] or [path of `accelerate`, ...]) as a forked child (or,
    `fresh`, a new interpreter) in its own process group (a timeout kills it with everything it started),
    with stdout and stderr captured."""
    if fresh or _cuda():
        return _fresh(argv, env=env, cwd=cwd, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err, ranks = Path(tmp) / "stdout", Path(tmp) / "stderr", Path(tmp) / "ranks"
        child = _SERVER.Process(
            target=_child, args=(list(argv), dict(env), str(cwd), str(out), str(err), _address(), str(ranks))
        )
        child.start()
        child.join(timeout)
        timed_out = child.exitcode is None
        if timed_out:
            rank_pids = ranks.read_text().split() if ranks.exists() else []  # each in its own session
            groups = [child.pid, *map(int, rank_pids)]
            _signal_all(groups, STACKS)  # every thread's stack to stderr: where a hang hangs, in the failure
            time.sleep(2)
            _signal_all(groups, signal.SIGKILL)
            child.join()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, child.exitcode, stdout, stderr)


def _signal_all(groups: list[int], sig: int) -> None:
    for pid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _cuda() -> bool:
    """A machine with CUDA runs every command fresh: the server's imports initialise CUDA (bitsandbytes does
    when imported), and a child forked after that cannot use it ("Cannot re-initialize CUDA in forked
    subprocess", seen on an H100 on 2026-11-27)."""
    import torch

    return torch.cuda.is_available()


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


def _address() -> str:
    """The fork server's socket (started here if it is not yet), for the launchers to ask it for ranks."""
    server = multiprocessing.forkserver._forkserver
    # the server imports PRELOAD on its own sys.path (3.11's forkserver.main ignores the one it is handed):
    # this directory on its PYTHONPATH lets it find warm_server
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), before]))
    try:
        server.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return server._forkserver_address


def _child(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str, address: str, ranks: str) -> None:
    _become(env, cwd, stdout, stderr, truncate=True)
    if Path(argv[0]).name == "accelerate":
        _fork_ranks(argv, address, stdout, stderr, ranks)
    try:
        if Path(argv[0]).name == "accelerate":
            from accelerate.commands.accelerate_cli import main

            sys.argv = list(argv)
            main()
        else:
            assert argv[1] == "-m", argv
            _run_module(argv[2], argv[3:])
    finally:
        _end()


def _become(env: dict, cwd: str, stdout: str, stderr: str, truncate: bool) -> None:
    """This child's session, working directory, environment and output files (appended to: the launcher
    and its ranks write to the same files)."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0), 0o644)
        os.dup2(f, fd)
        os.close(f)
    for stream in (sys.stdout, sys.stderr):  # whole lines, as `python -u` writes them
        stream.reconfigure(line_buffering=True, write_through=True)
    faulthandler.register(STACKS, file=sys.stderr, all_threads=True)  # run()'s timeout asks for them


def _run_module(module: str, args: list[str]) -> None:
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _end() -> None:
    atexit._run_exitfuncs()  # multiprocessing ends a child with os._exit, which skips them
    sys.stdout.flush()
    sys.stderr.flush()


def _fork_ranks(argv: list[str], address: str, stdout: str, stderr: str, ranks: str) -> None:
    """In a forked launcher: torch's elastic agent gets its `python -u -m MODULE` workers from the fork
    server (module docstring); any other command still starts as a process of its own."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    server = multiprocessing.forkserver._forkserver
    server._forkserver_address = address
    server.ensure_running = lambda: None  # it runs, and it is the test worker's child, not this process's
    popen = subprocess_handler.SubprocessHandler._popen

    def _popen(handler, args: tuple, env: dict):
        if len(args) < 4 or tuple(args[1:3]) != ("-u", "-m"):
            return popen(handler, args, env)
        out = handler._stdout.name if handler._stdout else stdout
        err = handler._stderr.name if handler._stderr else stderr
        if "--config_file" in argv:  # what the rank would read from its parent's command line
            env = {"LLM_FORGE_ACCELERATE_CONFIG": argv[argv.index("--config_file") + 1], **env}
        return _Rank(list(args), dict(env), os.getcwd(), out, err, ranks)

    subprocess_handler.SubprocessHandler._popen = _popen
    _fork_simple_launch(argv, stdout, stderr, ranks)


def _fork_simple_launch(argv: list[str], stdout: str, stderr: str, ranks: str) -> None:
    """In a forked launcher: accelerate's simple launcher (one process) gets its `python -m MODULE ...` from the fork
    server too, writing to the launcher's stdout and stderr as the child it would start inherits them."""
    import types

    import accelerate.commands.launch as accelerate_launch

    def popen(cmd, env=None, **kwargs):
        if len(cmd) < 3 or cmd[1] != "-m" or kwargs:
            return subprocess.Popen(cmd, env=env, **kwargs)
        env = dict(os.environ if env is None else env)
        if "--config_file" in argv:  # what the process would read from its parent's command line
            env.setdefault("LLM_FORGE_ACCELERATE_CONFIG", argv[argv.index("--config_file") + 1])
        return _Rank([cmd[0], "-u", *cmd[1:]], env, os.getcwd(), stdout, stderr, ranks)

    accelerate_launch.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})


class _Rank:
    """What the elastic agent uses of a worker's Popen (pid, poll, wait, returncode, send_signal), for a
    worker forked from the server."""

    def __init__(self, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str, ranks: str):
        self.args = argv
        self._process = _SERVER.Process(target=_rank, args=(argv, env, cwd, stdout, stderr))
        self._process.start()
        self.pid = self._process.pid
        with open(ranks, "a") as f:  # for run()'s timeout: the ranks are in sessions of their own
            f.write(f"{self.pid}\n")

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: list[str], *, env: dict, cwd: Path, log: Path) -> _Rank:
    """`argv` ([sys.executable, "-m", module, ...]) forked from the server and left running, its stdout and stderr
    appended to `log`: a Popen-like handle (pid, poll, wait, returncode, terminate, kill) for a server a test
    starts (the app), which then starts with the libraries the fork server has imported."""
    _address()  # the server runs, with this directory on its path
    return _Rank([argv[0], "-u", *argv[1:]], dict(env), str(cwd), str(log), str(log), os.devnull)


def _rank(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    _become(env, cwd, stdout, stderr, truncate=False)
    if threads := env.get("OMP_NUM_THREADS"):  # read by torch's thread pool when the server imported it
        import torch

        torch.set_num_threads(int(threads))
    try:
        _run_module(argv[3], argv[4:])
    finally:
        _end()
