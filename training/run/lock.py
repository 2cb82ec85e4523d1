"""One run per directory: a second run started on an output_dir that a live run holds is refused,
naming the holder's pid and command; a holder that died (kill -9, a node reboot) keeps nothing.

The lock is the kernel's advisory lock (`fcntl.flock`) on output_dir/run.lock, taken by the launch's
first process (global rank 0) for the whole run: the kernel drops it when that process ends, however it
ends, so no stale lock is ever left to clean up. The file itself keeps the holder's pid, host, command
and start time for the message (and for the app).

`is_held` asks by taking the lock for an instant, so the app's poll can briefly hold a free directory;
`acquire` therefore tries again for a moment (ACQUIRE_RETRY_S) before it calls the directory in use.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from training.core.errors import RecipeError
from training.run.rundir import LOCK

ACQUIRE_RETRY_S = 0.5  # far longer than an is_held probe holds the lock; far shorter than any real run


def holder(run_dir: Path) -> dict | None:
    """Who holds (or last held) `run_dir`'s lock, as written by that run; None if nobody wrote it."""
    try:
        return json.loads((Path(run_dir) / LOCK).read_text() or "null")
    except (OSError, ValueError):
        return None


def in_use(run_dir: Path, shown_as: str | None = None) -> str:
    """The message for a directory a live run holds: who holds it (pid, host, start, command) and what to
    do; `shown_as` names the directory as the reader knows it (the app: relative to its workspace)."""
    who = holder(run_dir) or {}
    return (
        f"{shown_as or run_dir} is in use by a live run (pid {who.get('pid', '?')} on {who.get('host', '?')}, "
        f"started {who.get('started', '?')}: {who.get('command', '?')}); wait for it, stop it, or choose "
        f"another output_dir"
    )


def is_held(run_dir: Path) -> bool:
    """Whether a live process holds `run_dir`'s lock now (without taking it)."""
    path = Path(run_dir) / LOCK
    if not path.is_file():
        return False
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def this_command() -> list[str]:
    """This process's command line as typed: `python -m training.train ...` for a module run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    return [sys.executable, *sys.argv]


class RunLock:
    """output_dir's lock for one run: `acquire()` where the run first writes its directory (after the
    checks that refuse a launch before anything is written), released when the `with` block ends,
    however it ends.

        with RunLock(recipe.output_dir) as lock:
            ...            # checks that may refuse the launch: nothing written yet
            lock.acquire() # RecipeError (exit 2) naming the live run that holds the directory
            ...            # the run
    """

    def __init__(self, run_dir: Path, command: list[str] | None = None):
        self.run_dir, self.command, self._file = Path(run_dir), command, None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if self._file is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = open(self.run_dir / LOCK, "a+")  # noqa: SIM115 (held open: the lock lives with the file)
        except OSError as e:
            raise RecipeError(f"output_dir: cannot write to {self.run_dir} ({e.strerror})") from None
        deadline = time.monotonic() + ACQUIRE_RETRY_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:  # a live run, not an is_held probe
                    f.close()
                    raise RecipeError(f"output_dir: {in_use(self.run_dir)}") from None
                time.sleep(0.05)
        command = self.command if self.command is not None else this_command()
        f.seek(0)
        f.truncate()
        f.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": " ".join(command),
                }
            )
        )
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file releases the lock
            self._file = None
