"""Huge memory pages for our commands: each `python -m training.X` (and `benchmarks.X`) runs with glibc's malloc
asking the kernel for transparent huge pages.

Where the kernel gives transparent huge pages only to memory that asks for them (`madvise`, the common default),
every tensor torch allocates on the host lives in 4 KiB pages: a model's weights, their casts, the activations and
the KV cache span hundreds of thousands of pages, far more than the TLB holds, and each decoding step walks the page
tables again. glibc's tunable `glibc.malloc.hugetlb=1` (glibc 2.35 and later) makes malloc ask for huge pages. A
tunable is read when the process starts, so the command executes itself again, at once, with it set: the same
process (its PID stays), arguments and environment, before torch is imported. Nothing computed changes (the same
values in other pages): on the bundled agent task's steps 2-3 (2-core Intel Xeon with AMX, two pairs, 2026-11-30)
13% less time a step, 15% less generating, the same losses (docs/benchmarks.md).

Not done where it cannot help or is not wanted: not Linux, glibc older than 2.35 (or another C library),
transparent huge pages off (`never`), the tunable already set (by the user, or by this relaunch), or
LLM_FORGE_HUGE_PAGES=0. The run's "speed:" line says which, as does `python -m training.core`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# set by the relaunch: never a second one (were the tunable dropped on the way)
RELAUNCHED = "LLM_FORGE_RELAUNCHED"
OPTIONS_WITH_VALUE = ("-W", "-X")  # the interpreter's options that take the next argument as their value


def command_module(argv: list[str]) -> str | None:
    """The module a `python [options] -m MODULE ...` command line runs (None: a script, -c, or none)."""
    args = iter(argv[1:])
    for arg in args:
        if arg.startswith("-m"):
            return arg[2:] or next(args, None)
        if arg in OPTIONS_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-") or arg.startswith("-c"):
            return None
    return None


def glibc_version() -> tuple[int, ...] | None:
    """glibc's version ((2, 36)), None under another C library or on another system."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    return tuple(int(p) for p in version.split(".") if p.isdigit()) if name == "glibc" else None


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ('always', 'madvise', 'never'), None where it cannot be read."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text and "]" in text else None


def why_not(
    env: dict, glibc: tuple[int, ...] | None, thp: str | None, platform: str = sys.platform
) -> str | None:
    """Why this process does not (or need not) run with the tunable set (None: it should)."""
    if TUNABLE.split("=")[0] in env.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES already sets it ({env['GLIBC_TUNABLES']})"
    if env.get("LLM_FORGE_HUGE_PAGES") == "0":
        return "LLM_FORGE_HUGE_PAGES=0"
    if platform != "linux":
        return f"not Linux ({platform})"
    if glibc is None or glibc < (2, 35):
        return "needs glibc 2.35 or later" + (f" (this is {'.'.join(map(str, glibc))})" if glibc else "")
    if thp in (None, "never"):
        return "the kernel's transparent huge pages are off" if thp else f"{THP} cannot be read"
    return None


def with_tunable(env: dict) -> dict:
    """`env` with the tunable added to GLIBC_TUNABLES (after any tunables already there)."""
    tunables = env.get("GLIBC_TUNABLES")
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def relaunch() -> None:
    """Execute this command again with the tunable set, where it is one of ours and `why_not` has nothing to say;
    else return (nothing done)."""
    argv = getattr(sys, "orig_argv", [])
    module = command_module(argv)
    if module is None or not module.startswith(("training.", "benchmarks.")) or os.environ.get(RELAUNCHED):
        return
    if why_not(dict(os.environ), glibc_version(), thp_mode()) is not None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(
        sys.executable, [sys.executable, *argv[1:]], {**with_tunable(dict(os.environ)), RELAUNCHED: "1"}
    )


def state() -> str:
    """One line: whether this process's malloc asks for huge pages, and why not where it does not."""
    glibc, thp = glibc_version(), thp_mode()
    if TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
        blocked = why_not({}, glibc, thp)  # what the tunable cannot overcome: the system
        return f"huge pages {'on (glibc.malloc.hugetlb=1)' if blocked is None else f'off ({blocked})'}"
    return (
        f"huge pages off ({why_not(dict(os.environ), glibc, thp) or 'not started as python -m training.X'})"
    )
