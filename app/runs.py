"""Every run in the workspace: the launch command, the subprocess, and the registry that says which runs
there are and whether each is alive (what each one shows is app/run_views.py).

The app never imports the training loop. It writes the recipe into the run directory, starts
`accelerate launch ... -m training.train RECIPE` (or `python -m training.train RECIPE` for one
process) with an argv list in a session of its own, sends its output to `<run>/train.log`, and
reads its status and metrics through `training.run.rundir.RunDir`.

It lists every run directory under runs/, whoever started it (`Workspace.run_dirs`), and reads each
one's state from the directory (run.lock held by a live process, status.json). A small registry
(`runs/.app-runs.json`) adds what only the app knows about the runs it started: backend, argv, its
child's pid and process start time (a pid whose start time no longer matches is a different process)
and exit code. A page reload or an app restart finds every run again, and the app's end never ends
a run.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from app.workspace import REPO_ROOT, PathRefused, Workspace
from training.core.errors import UserError
from training.core.fs import write_atomic
from training.launch.backend import Backend
from training.run.lock import holder, in_use, is_held
from training.run.rundir import LOCK, RunDir

PYTHON_BACKEND = "python (one process, no accelerate)"
REGISTRY = ".app-runs.json"
RECIPE = "recipe.yaml"  # the app's copy of the recipe in the run directory (the trainer writes its own)
LOG = "train.log"


class LaunchRefused(RuntimeError):
    """A run the app will not start (another run holds the device, bad backend, ...)."""


def default_processes(backend: Backend | UserError | None) -> int:
    """The process count the picker proposes for a backend: the file's num_processes (for a mesh file,
    the processes its parallelism_config sizes multiply to), one for single-process files."""
    if not isinstance(backend, Backend) or backend.kind == "single":
        return 1
    return backend.mesh_size if backend.mesh else max(1, backend.num_processes)


def backend_label(name: str, backend: Backend | UserError | None) -> str:
    """How the picker shows a backend: its file name, and its mesh and process count for a mesh file."""
    if isinstance(backend, UserError):
        return f"{name} (unreadable: see the launch command)"
    if isinstance(backend, Backend) and backend.mesh:
        return f"{name} (mesh {backend.mesh}: {backend.mesh_size} processes)"
    if isinstance(backend, Backend) and backend.sp_size > 1:  # DeepSpeed Ulysses: groups of sp_size
        return f"{name} (sequence parallel sp={backend.sp_size}: processes a multiple of {backend.sp_size})"
    if isinstance(backend, Backend) and backend.ep_size > 1:
        return f"{name} (MoE experts over {backend.ep_size} processes)"
    return name


def launch_argv(ws: Workspace, recipe_rel: str, backend: str, num_processes: int) -> list[str]:
    """The exact command the app runs (from the workspace root). A mesh file (parallelism_config) runs
    on exactly the processes its sizes multiply to: another count is refused here, as accelerate and the
    trainer would refuse it."""
    if backend == PYTHON_BACKEND:
        if num_processes != 1:
            raise LaunchRefused(
                "number of processes: the python backend runs one process; pick an accelerate config for more"
            )
        return [sys.executable, "-m", "training.train", recipe_rel]
    configs = ws.accelerate_configs()
    if backend not in configs:
        raise LaunchRefused(
            f"backend: {backend!r} is not one of the accelerate configs ({', '.join(configs) or 'none found'})"
        )
    if num_processes < 1:
        raise LaunchRefused("number of processes: must be at least 1")
    read = ws.backends().get(backend)
    if isinstance(read, UserError):
        raise LaunchRefused(str(read))
    if read is not None and read.mesh and num_processes != read.mesh_size:
        raise LaunchRefused(
            f"number of processes: {backend} runs its mesh {read.mesh} (parallelism_config_* in "
            f"{ws.rel(configs[backend])}) on exactly {read.mesh_size} processes; set Processes to {read.mesh_size}"
        )
    if read is not None and read.sp_size > 1 and num_processes % read.sp_size:
        raise LaunchRefused(
            f"number of processes: {backend} splits every sequence over groups of parallelism_config_sp_size="
            f"{read.sp_size} processes; set Processes to a multiple of {read.sp_size}"
        )
    accelerate = Path(sys.executable).with_name("accelerate")
    launcher = (
        [str(accelerate), "launch"]
        if accelerate.is_file()
        else [sys.executable, "-m", "accelerate.commands.launch"]
    )
    cfg = configs[backend]
    cfg_arg = ws.rel(cfg) if cfg.is_relative_to(ws.root) else str(cfg)
    return [
        *launcher,
        "--config_file",
        cfg_arg,
        "--num_processes",
        str(num_processes),
        "-m",
        "training.train",
        recipe_rel,
    ]


def display_command(ws: Workspace, argv: list[str]) -> str:
    return f"cd {shlex.quote(str(ws.root))}\n{shlex.join(argv)}"


def tool_env(ws: Workspace) -> dict[str, str]:
    """The environment of every process the app starts (runs and jobs): this repository importable,
    output unbuffered (the page shows it as it comes), tokenizers quiet about forks, and the workspace's
    rule (training.launch.confine), which the trainer checks the recipe against before it reads or imports
    anything."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **ws.confinement.env()}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def tool_json(ws: Workspace, module_args: list[str], timeout_s: int, what: str) -> dict:
    """The JSON object a training tool prints last (`python -m MODULE ARGS...`, run in the workspace and in
    tool_env, waited for); a RuntimeError with the tool's error line when it refuses or fails, or when it has
    not answered within `timeout_s` (`what` names it)."""
    argv = [sys.executable, "-m", *module_args]
    try:
        proc = subprocess.run(
            argv, cwd=ws.root, env=tool_env(ws), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what}: no answer within {timeout_s} s") from None
    if proc.returncode != 0:
        said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        raise RuntimeError(said[-1].removeprefix("error: ") if said else proc.stderr[-1000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_tool(ws: Workspace, argv: list[str], log) -> subprocess.Popen:
    """Start `argv` as the app starts every run and job: from the workspace root, in tool_env, its output to
    `log` (an open file), nothing on its input, and in a session of its own: the app's end (Ctrl-C, a closed
    terminal, a restart) never reaches it, and Stop can signal a run's group."""
    return subprocess.Popen(
        argv,
        cwd=ws.root,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=tool_env(ws),
        start_new_session=True,
    )


def read_tail(path: Path, lines: int) -> str | None:
    """The last `lines` lines of a run's or a job's log (read from its last 64 kB) as a terminal shows them: a
    progress bar that tqdm redraws with \r shows its last state. None when the file cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 64_000))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    shown = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    return "\n".join(shown[-lines:])


def proc_start_time(pid: int) -> str | None:
    """The kernel's start time of a process (field 22 of /proc/PID/stat), None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return fields[19]


def process_alive(pid: int, start_time: str | None) -> bool:
    if Path("/proc").is_dir():
        now = proc_start_time(pid)
        return now is not None and (start_time is None or now == start_time)
    try:  # no /proc (macOS): signal 0 checks existence
        os.kill(pid, 0)
        return True
    except OSError:
        return False


@dataclass
class RunRecord:
    """What only the app knows about a run it started (the registry entry); the run directory says the rest."""

    name: str
    run_dir: str  # relative to the workspace
    pid: int
    start_time: str | None
    argv: list[str]
    backend: str
    num_processes: int
    started: float
    returncode: int | None = None
    stop_requested: bool = False
    ended: float | None = None  # when this app process reaped it (returncode is then known)


@dataclass
class Found:
    """One run as the app lists it: its directory, when it started (the registry's time for a run the
    app started; else `dir_started`), and the app's registry entry if the app started it."""

    name: str  # relative to runs/: "demo", "group/name"
    dir: RunDir
    started: float
    record: RunRecord | None = None


class Live(NamedTuple):
    """Who runs a live run: the pid Stop signals (None for the instant before its holder writes run.lock)
    and the host it runs on."""

    pid: int | None
    host: str


def dir_started(run_dir: Path) -> float:
    """When a run the app did not start began: the `started` its lock holder wrote (the latest start:
    a resume writes it again), else the directory's modification time."""
    try:
        return time.mktime(time.strptime((holder(run_dir) or {})["started"], "%Y-%m-%d %H:%M:%S"))
    except (KeyError, TypeError, ValueError):
        return Path(run_dir).stat().st_mtime


def signal_stop(pid: int) -> str:
    """SIGTERM to the process that stops a run, and what was signalled (for the message).

    `pid` is the run's lock holder (global rank 0) once it holds run.lock, else the app's own child (a
    run still loading). Its process group is signalled when `pid` leads one, else `pid` alone:

    - under `accelerate launch` (torchrun) every rank leads a session of its own, so rank 0's group is
      rank 0 and its data-loader workers, not the launcher. The trainer's SIGTERM handler on rank 0
      raises the stop flag that every step all-reduces, so all ranks save the same checkpoint and exit
      0, and then the launcher exits 0. Signalling the launcher instead would make torchrun SIGTERM its
      workers and SIGKILL them after its grace period, possibly in the middle of the save.
    - `python -m training.train` typed in a shell leads its job's group (the group Ctrl-C signals), and
      a run the app started leads the session the app gave it: the group is that run.
    - a trainer started inside another program's group (`make demo` runs training.demo, which runs
      training.train) is signalled alone, so the program that started it is not.
    """
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGTERM)
            return f"process group {pid}"
        os.kill(pid, signal.SIGTERM)
        return f"pid {pid}"
    except ProcessLookupError:
        return ""


class RunRegistry:
    """Every run under the workspace's runs/, whoever started it (the app, `accelerate launch`, `make
    demo`): listed from the directories themselves (`Workspace.run_dirs`) plus the app's registry.

    The run directory is the source of truth for a run's state: run.lock held by a live process means
    running; status.json says finished or stopped; status "running" with nobody holding the lock means
    the process died. The registry adds what only the app knows: the backend and process count, the
    argv, its child's pid (alive while the run is still loading, before the trainer takes the lock)
    and exit code, and whether Stop was pressed. `state` is the one place that combines the two.
    """

    def __init__(self, ws: Workspace):
        self.ws = ws
        self._lock = threading.RLock()
        self._children: dict[int, subprocess.Popen] = {}  # runs this app process started (to reap them)
        self._stops: dict[str, int] = {}  # runs the app did not start -> the pid Stop signalled

    # ------------------------------------------------------------------ registry

    @property
    def registry_path(self) -> Path:
        return self.ws.runs / REGISTRY

    def records(self) -> list[RunRecord]:
        try:
            raw = json.loads(self.registry_path.read_text())
        except (OSError, json.JSONDecodeError):
            return []
        return [RunRecord(**r) for r in raw]

    def _save(self, records: list[RunRecord]) -> None:
        self.ws.runs.mkdir(parents=True, exist_ok=True)
        write_atomic(self.registry_path, json.dumps([asdict(r) for r in records], indent=1))

    def _refresh(self) -> list[RunRecord]:
        """Reap children this process started and record their exit codes (under the lock: the page's
        handlers and the job worker ask at the same time)."""
        with self._lock:
            records = self.records()
            changed = False
            for r in records:
                child = self._children.get(r.pid)
                if child is not None and child.poll() is not None:
                    r.returncode, r.ended = child.returncode, time.time()
                    del self._children[r.pid]
                    changed = True
            if changed:
                self._save(records)
            return records

    def is_running(self, r: RunRecord) -> bool:
        """Whether the app's child for `r` is still alive (its pid and process start time both match)."""
        child = self._children.get(r.pid)
        if child is not None:  # our own child: poll it (a finished child is a zombie until reaped)
            if child.poll() is None:
                return True
            self._refresh()
            r.returncode, r.ended = child.returncode, time.time()
            return False
        return r.returncode is None and process_alive(r.pid, r.start_time)

    # ------------------------------------------------------------------ discovery

    def runs(self) -> list[Found]:
        """Every run, newest first: each run directory under runs/, and each registry entry whose
        directory exists (a run the app just started may have written nothing the trainer writes yet)."""
        records = {r.name: r for r in self._refresh()}
        paths = {p.relative_to(self.ws.runs).as_posix(): p for p in self.ws.run_dirs()}
        for name, r in records.items():
            if name not in paths and (self.ws.root / r.run_dir).is_dir():
                paths[name] = self.ws.root / r.run_dir
        found = []
        for name, path in paths.items():
            r = records.get(name)
            try:
                started = r.started if r is not None else dir_started(path)
            except OSError:  # deleted while we looked
                continue
            found.append(Found(name, RunDir(path), started, r))
        return sorted(found, key=lambda f: f.started, reverse=True)

    def find(self, name: str) -> Found | None:
        """The listed run called `name` (only listed runs: a name from the page is never a path)."""
        return next((f for f in self.runs() if f.name == name), None)

    def run_dirs(self) -> list[Path]:
        """The listed runs' directories, newest first (the Chat tab lists their final/ and checkpoints)."""
        return [f.dir.root for f in self.runs()]

    def names(self) -> list[str]:
        """Every run under runs/, newest first, whoever started it (the Run and Export pickers)."""
        return [f.name for f in self.runs()]

    def get(self, name: str) -> Found:
        """The listed run called `name`, or LaunchRefused naming it."""
        f = self.find(name)
        if f is None:
            raise LaunchRefused(f"run: no run named {name!r} under {self.ws.rel(self.ws.runs)}/")
        return f

    # ------------------------------------------------------------------ state: the one place

    def _live(self, f: Found) -> Live | None:
        """Who runs `f` now (None once nothing does): the lock holder (global rank 0) while run.lock is
        held, else the app's own child while it lives (a run still loading, before it takes the lock)."""
        if is_held(f.dir.root):
            who = holder(f.dir.root) or {}  # {} for an instant: the holder writes it just after locking
            pid = who.get("pid")
            return Live(pid if isinstance(pid, int) else None, who.get("host", ""))
        if f.record is not None and self.is_running(f.record):
            return Live(f.record.pid, socket.gethostname())
        return None

    def state(self, f: Found, status: dict) -> tuple[str, str]:
        """(state, why it failed): the one place that decides, from the run directory and, for a run the
        app started, its registry entry."""
        r = f.record
        live = self._live(f)
        if live is not None:
            asked = (r is not None and r.stop_requested and self.is_running(r)) or (
                live.pid is not None and self._stops.get(f.name) == live.pid
            )
            return ("stopping" if asked else "running"), ""
        said = status.get("state")
        # the app's exit code counts unless the directory was written after it (resumed from the command line)
        resumed = r is not None and r.ended is not None and status.get("time", 0) > r.ended
        if r is not None and r.returncode not in (None, 0) and not resumed:
            return "failed", f"exit code {r.returncode}; see the log tail"
        if said in ("finished", "stopped"):
            return said, ""
        if said == "failed":  # the run said why (e.g. it lost a peer)
            return "failed", status.get("reason", "the run says it failed; see its log")
        if said == "running":
            return (
                "failed",
                "status.json says running but no process holds run.lock: it was killed or it crashed",
            )
        if f.dir.has_final():
            return "finished", ""
        if r is not None:
            return "failed", "the process ended before training started; see the log tail"
        return "failed", f"no {f.dir.status.name}: training never reached its first step here"

    def active(self) -> Found | None:
        """The run that holds the device: a live run on this machine, whoever started it."""
        with self._lock:
            here = socket.gethostname()
            return next(
                (f for f in self.runs() if (live := self._live(f)) is not None and live.host in (here, "")),
                None,
            )

    # ------------------------------------------------------------------ start / stop

    def start(self, recipe_yaml: str, run_dir: Path, backend: str, num_processes: int) -> RunRecord:
        """Write the recipe into `run_dir` and start training on it. Refused while another run is going."""
        with self._lock:
            run_dir = self.ws.inside(run_dir, "output_dir", under="runs")
            if run_dir == self.ws.runs.resolve():
                raise PathRefused("output_dir: give the run its own directory, e.g. runs/my-run")
            if is_held(run_dir):  # a run started elsewhere (command line, another app) holds it
                raise LaunchRefused(in_use(run_dir, self.ws.rel(run_dir)))
            busy = self.active()  # any live run on this machine, the command line's too
            if busy is not None:
                pid = getattr(self._live(busy), "pid", "?")
                raise LaunchRefused(
                    f"run '{busy.name}' (pid {pid}) is still running and holds the device; stop it or wait for it to finish"
                )
            recipe_rel = self.ws.rel(run_dir / RECIPE)
            argv = launch_argv(self.ws, recipe_rel, backend, num_processes)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / RECIPE).write_text(recipe_yaml)
            RunDir(run_dir).status.unlink(missing_ok=True)  # a fresh start; the trainer writes a new one
            with open(run_dir / LOG, "ab") as log:
                log.write(f"\n$ {shlex.join(argv)}\n".encode())
                log.flush()
                proc = start_tool(self.ws, argv, log)
            self._children[proc.pid] = proc
            rec = RunRecord(
                name=self.ws.rel(run_dir).removeprefix("runs/"),
                run_dir=self.ws.rel(run_dir),
                pid=proc.pid,
                start_time=proc_start_time(proc.pid),
                argv=argv,
                backend=backend,
                num_processes=num_processes,
                started=time.time(),
            )
            records = [r for r in self._refresh() if r.name != rec.name] + [rec]
            self._save(records)
            return rec

    def stop(self, name: str) -> str:
        """SIGTERM to the live run (`signal_stop`: its lock holder, or the app's child while it loads),
        whoever started it: the trainer finishes the step, saves a checkpoint, exits 0."""
        with self._lock:
            f = self.get(name)
            live = self._live(f)
            if live is None:
                return f"run '{name}' is not running"
            if live.host not in (socket.gethostname(), ""):
                raise LaunchRefused(f"run '{name}' runs on {live.host} (pid {live.pid}): stop it there")
            if live.pid is None:
                raise LaunchRefused(f"run '{name}': its {LOCK} names no pid yet; try again in a moment")
            signalled = signal_stop(live.pid)
            if not signalled:
                return f"run '{name}' had already ended"
            r = f.record
            if r is not None and self.is_running(r):
                records = self.records()
                for rec in records:
                    rec.stop_requested = rec.stop_requested or rec.name == name
                self._save(records)
            else:
                self._stops[name] = live.pid
            return f"asked run '{name}' to stop (SIGTERM to {signalled}); it saves a checkpoint and exits"
