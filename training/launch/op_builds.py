"""Where DeepSpeed builds its C++ ops, and a build lock left behind by a killed build.

DeepSpeed compiles its ops on first use (CPU Adam for optimizer offload, the shared-memory collectives of
its CPU accelerator, fused kernels on GPUs) with torch.utils.cpp_extension, into TORCH_EXTENSIONS_DIR,
by default ~/.cache/torch_extensions, shared by every Python environment of the user. Two facts make that
default a trap:
- each build is against one environment's torch headers, so two environments sharing the directory
  rebuild each other's ops whenever they alternate (minutes each time on a small CPU);
- a build holds a `lock` file in the op's directory while it compiles, and every other process that needs
  the op waits until the file is gone. A build killed while holding it (kill -9, the OOM killer, a machine
  stopped mid-build) leaves the file behind, and every later run that needs the op then waits forever
  without a word.

So before a DeepSpeed run builds its accelerator (training.loop.setup.start):
- `use_environment_build_dir`: ops build into this environment's own directory, `<sys.prefix>/torch_extensions`
  of a virtual environment, unless TORCH_EXTENSIONS_DIR is set;
- `check_op_build_locks`: a lock that no process on this machine holds open (the building process keeps it
  open until it removes it) and that is older than `GRACE_S` is refused with exit 2, naming the file to
  delete. The grace leaves alone a build another machine runs on a shared file system, which starts with
  the same launch. From torch 2.14 on, cpp_extension holds an OS advisory lock on that file instead (the kernel
  releases it when the builder dies, and the file stays after every build): there a lock file is no trap, and
  none is refused (`lock_files_block`).

`python -m training.parallel.deepspeed_ops` builds them ahead of the first run (`make install` runs it in
the background), into the directory `use_environment_build_dir` names.

And `cache_cpu_info`: DeepSpeed asks py-cpuinfo's `get_cpu_info` three times as a ZeRO-offload rank starts (CPU
Adam's vendor, then its op's `-march` and SIMD flags, which name the build to load), and each call starts a Python of
its own that probes the CPU: 1.2 s of CPU a call on a 2-core Xeon, 3.6 s a rank before its first step. The answer is
the machine's, so it is probed once per machine and kept in `cache_root()/cpuinfo.json` under the CPU's model, flags
and py-cpuinfo's version (written atomically; an unreadable file or an empty answer is probed again).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from training.core.errors import UserError
from training.core.fs import cache_root, read_json_object, write_atomic
from training.core.machine import cpu_key

ENV = "TORCH_EXTENSIONS_DIR"
GRACE_S = 120.0


def use_environment_build_dir() -> Path:
    """Point TORCH_EXTENSIONS_DIR at this virtual environment's `torch_extensions` (unless set, or outside a
    virtual environment, or not writable); return the directory ops build into."""
    if ENV not in os.environ and sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        os.environ[ENV] = str(Path(sys.prefix) / "torch_extensions")
    return build_root()


def build_root() -> Path:
    """The directory torch.utils.cpp_extension builds ops under (each op in a directory of its own, below a
    `py311_cpu`-style folder when TORCH_EXTENSIONS_DIR is unset)."""
    if ENV in os.environ:
        return Path(os.environ[ENV])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def held_open(path: Path) -> bool:
    """Whether a process on this machine (that this user may inspect) has `path` open (Linux /proc)."""
    target = os.path.realpath(path)
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fds.iterdir():
                try:
                    if os.readlink(fd) == target:
                        return True
                except OSError:
                    continue
        except OSError:
            continue
    return False


def stale_locks(root: Path, grace_s: float = GRACE_S, now: float | None = None) -> list[Path]:
    """The op build locks under `root` (at `<op>/lock` or `<python>_<device>/<op>/lock`) that no process here
    holds open and that are older than `grace_s`."""
    if not root.is_dir() or not Path("/proc/self/fd").is_dir():
        return []  # nothing built yet, or no /proc to tell a live build from a dead one
    now = time.time() if now is None else now
    stale = []
    for lock in sorted([*root.glob("*/lock"), *root.glob("*/*/lock")]):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue  # the build finished meanwhile
        if age > grace_s and not held_open(lock):
            stale.append(lock)
    return stale


def lock_files_block() -> bool:
    """Whether torch's cpp_extension waits while a build's lock file exists (its FileBaton, to torch 2.13), rather
    than holding an advisory lock on it that a dead builder cannot keep (its FileLock, from torch 2.14)."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def check_op_build_locks(root: Path) -> None:
    """UserError (exit 2) naming each dead build's lock, instead of waiting on it forever."""
    stale = stale_locks(root) if lock_files_block() else []
    if stale:
        minutes = ", ".join(f"{p} ({(time.time() - p.stat().st_mtime) / 60:.0f} min old)" for p in stale)
        raise UserError(
            f"DeepSpeed's op build would wait forever on a lock that no running process holds: {minutes}. "
            f"A build of that op was killed while compiling (kill -9, out of memory, a machine stopped). "
            f"Delete the lock (rm {' '.join(str(p) for p in stale)}) and launch again; the op is rebuilt once"
        )


CPU_INFO_FILE = "cpuinfo.json"


def cache_cpu_info() -> None:
    """py-cpuinfo's `get_cpu_info` answered from this machine's cached probe (module docstring): probed at most once
    per machine, read at most once per process. Nothing changes where py-cpuinfo is not installed."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "cached_by_llm_forge", False):
        return
    probe, known = cpuinfo.get_cpu_info, {}

    def get_cpu_info() -> dict:
        if not known:
            known.update(_cached_cpu_info(probe, getattr(cpuinfo, "CPUINFO_VERSION_STRING", "?")))
        return json.loads(json.dumps(known))  # a copy: callers may change what they get

    get_cpu_info.cached_by_llm_forge = True
    cpuinfo.get_cpu_info = get_cpu_info


def _cached_cpu_info(probe, version: str) -> dict:
    key, path = f"{cpu_key()} | py-cpuinfo {version}", cache_root() / CPU_INFO_FILE
    cache = read_json_object(path)
    if isinstance(cache.get(key), dict) and cache[key]:
        return cache[key]
    info = probe()
    if info:  # py-cpuinfo answers {} when its probe fails: asked again next time
        cache[key] = info
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(cache, indent=1))
    return info
