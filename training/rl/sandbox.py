"""The built-in `python` tool of agent episodes: the model's code run in a separate, limited process.

Each call is a fresh `python -I` (isolated: no user site, no PYTHON* variables) in its own temporary
directory, which is its working directory and its only writable place, with:
  - a wall-clock timeout (the whole process group is killed) and a CPU-time limit (RLIMIT_CPU);
  - an address-space limit (RLIMIT_AS): a 10 GB allocation is a MemoryError inside the call;
  - output written to a file capped by RLIMIT_FSIZE and read back cut to `output_chars` characters;
  - no network: a new user and network namespace (unshare) where the kernel allows it, and in every case
    an audit hook (sys.addaudithook, installed before the code runs) that refuses sockets, new processes
    (fork, exec, spawn, subprocess), loading native code (ctypes) and opening any file outside the call's
    directory and the Python installation (so the run's own files cannot be read).
An audit hook is not a security boundary against a determined attacker (Python's documentation says so);
with the rlimits and the namespace it contains what a small policy model writes by accident or by reward
hacking. Whatever the code does, the tool returns text: its output, or an error line, never an exception
that stops the run.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000

# Runs before the model's code, in the child (a fresh, single-threaded interpreter): its limits, its own
# network namespace where the kernel allows one, then the audit hook that confines it (see the module doc).
# Set here rather than in a preexec_fn, which is not safe in the training process's threads.
GUARD = r"""
import ctypes, os, resource, sys
for _which, _value in {limits!r}:
    resource.setrlimit(_which, (_value, _value))
ctypes.CDLL(None, use_errno=True).unshare({unshare})  # where refused (no user namespaces) the hook remains
del ctypes, _which, _value
_ROOTS = tuple(os.path.realpath(p) + os.sep for p in {roots!r})
_HERE = os.path.realpath(os.getcwd()) + os.sep
_DENY = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
         "subprocess.", "ctypes.", "os.kill", "os.killpg", "pty.", "resource.setrlimit", "sys.addaudithook")
def _guard(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"{{event}} is not allowed in this sandbox")
    if event == "open" and isinstance(args[0], (str, bytes)):
        path = os.path.realpath(os.fsdecode(args[0])) + os.sep
        if path.startswith(_HERE):
            return
        writing = isinstance(args[1], str) and any(c in args[1] for c in "wax+")
        if writing or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)) \
                or not path.startswith(_ROOTS):
            raise PermissionError(f"opening {{os.fsdecode(args[0])}} is not allowed in this sandbox")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod", "os.symlink"):
        for a in args:
            if isinstance(a, (str, bytes)) and not (os.path.realpath(os.fsdecode(a)) + os.sep).startswith(_HERE):
                raise PermissionError(f"{{event}} outside the sandbox's directory is not allowed")
sys.addaudithook(_guard)
del _guard
__code = open("main.py").read()
try:
    exec(compile(__code, "main.py", "exec"), {{"__name__": "__main__"}})
except SystemExit:
    raise
except BaseException as e:  # the traceback of the model's code only, not of this guard
    import traceback
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "main.py"]
    sys.stdout.flush()
    sys.stderr.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
                     + "".join(traceback.format_exception_only(e)))
    sys.exit(1)
"""


def python_roots() -> list[str]:
    """Where the child may read: the Python installation (its standard library and installed packages)."""
    paths = sysconfig.get_paths()
    return sorted({sys.base_prefix, sys.prefix, paths["stdlib"], paths["platstdlib"], paths["purelib"]})


@dataclass(frozen=True)
class Sandbox:
    """The limits of one call (rl.tool_timeout_s, rl.tool_output_chars)."""

    timeout_s: float = 10.0
    output_chars: int = 2000
    memory_bytes: int = 1 << 30
    file_bytes: int = 1 << 20

    def guard(self) -> str:
        """The child's preamble (GUARD) with this call's limits."""
        cpu = int(self.timeout_s) + 1
        limits = [
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_AS, self.memory_bytes),
            (resource.RLIMIT_FSIZE, self.file_bytes),
            (resource.RLIMIT_CORE, 0),
        ]
        return GUARD.format(limits=limits, unshare=CLONE_NEWUSER | CLONE_NEWNET, roots=python_roots())

    def run(self, code: str) -> str:
        """The output of `code` (stdout and stderr together), or an error line; never raises."""
        with tempfile.TemporaryDirectory(prefix="llm-forge-tool-") as here:
            Path(here, "main.py").write_text(code, encoding="utf-8")
            out_path = Path(here, ".output")
            with open(out_path, "wb") as out:
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-I", "-c", self.guard()],
                        cwd=here,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={"PATH": "/usr/bin:/bin", "HOME": here, "TMPDIR": here, "LANG": "C.UTF-8"},
                        start_new_session=True,  # its own process group: killed whole on timeout
                    )
                except OSError as e:
                    return f"error: the code could not be started ({e})"
                timed_out = False
                try:
                    proc.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    kill_group(proc)
            flooded = out_path.stat().st_size >= self.file_bytes
            text = out_path.read_bytes()[: self.output_chars * 4].decode("utf-8", "replace")
        return self.report(text, proc.returncode, timed_out, flooded)

    def report(self, text: str, code: int, timed_out: bool, flooded: bool = False) -> str:
        if flooded:
            return f"{text[: self.output_chars]}\nerror: output over the limit of {self.file_bytes} bytes; stopped"
        if len(text) > self.output_chars:  # a failure's message is at the end, other output at the start
            text = (
                f"[output cut to its last {self.output_chars} characters]\n{text[-self.output_chars :]}"
                if code != 0 or timed_out
                else f"{text[: self.output_chars]}\n[output cut at {self.output_chars} characters]"
            )
        if timed_out:
            return f"{text}\nerror: timed out after {self.timeout_s:g} s".lstrip()
        if code < 0:
            why = {
                signal.SIGXCPU: "CPU time limit",
                signal.SIGXFSZ: f"output limit of {self.file_bytes} bytes",
                signal.SIGKILL: "killed",
            }
            name = why.get(-code, signal.Signals(-code).name)
            return f"{text}\nerror: stopped ({name})".lstrip()
        if code != 0:
            return f"{text}\nerror: exit code {code}".lstrip()
        return text


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def make_python_tool(sandbox: Sandbox):
    """The built-in tool `python`, with its schema's docstring (transformers' get_json_schema reads it)."""

    def python(code: str) -> str:
        """Run Python code in a fresh, sandboxed interpreter and return what it prints.

        Args:
            code: A complete Python program; print the values you want to see.
        """
        return sandbox.run(code)

    return python
