"""Export, merge, GGUF, push and evaluation as background jobs: one at a time, the others waiting.

A job is one of the CLIs (`python -m training.export ...`, `python -m training.evaluate ...`: an argv
list, no shell) run from the workspace root on one run. It keeps two files in that run's directory:

    jobs/<id>.json   what the page polls: action, command, state, pid, exit code, times
    jobs/<id>.log    the command's output

with <id> = <YYYYmmdd-HHMMSS>-<action>. States: queued -> running -> done (exit 0) | failed (any
other exit, or killed after TOOL_TIMEOUT_S); `ended` for a job whose process ended while no app was
there to see its exit code (see its log).

The queue lives in the app: one worker thread starts the oldest queued job once no job is running.
Each job runs in a session of its own, so the app's end never ends it; a restarted app lists every
job again from the run directories, waits for one still running, and starts the queued ones.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from app.export_size import megabytes, size_on_disk, written
from app.runs import LaunchRefused, proc_start_time, process_alive, read_tail, start_tool
from app.workspace import Workspace
from training.core.fs import write_atomic

JOBS_DIR = "jobs"
POLL_S = 1.0  # how often the worker looks again while a job from an earlier app instance runs
EXPORT_ACTIONS = ("merge", "gguf", "push")
TOOL_TIMEOUT_S = 3600  # a job still running after this is killed


def export_argv(
    run_rel: str, action: str, *, outtype: str = "f16", repo: str = "", private: bool = False
) -> list[str]:
    """`python -m training.export` for one Export-tab button (argv list: no shell)."""
    argv = [sys.executable, "-m", "training.export", run_rel]
    if action == "merge":
        return [*argv, "--merge"]
    if action == "gguf":
        return [*argv, "--gguf", "--outtype", outtype]
    if action == "push":
        if not repo.strip():
            raise LaunchRefused("push to hub: give the repository as ORG/NAME")
        return [*argv, "--push-to-hub", repo.strip(), *(["--private"] if private else [])]
    raise LaunchRefused(f"export: unknown action {action!r} (one of {', '.join(EXPORT_ACTIONS)})")


def evaluate_argv(run_rel: str, tasks: str, limit: int | str | None = None) -> list[str]:
    """`python -m training.evaluate` for the Evaluate button; `limit`: examples per task (the page's text box:
    empty, or None, for all)."""
    names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    if not names:
        raise LaunchRefused("evaluate: give at least one task (e.g. dates_exact_match)")
    argv = [sys.executable, "-m", "training.evaluate", run_rel, "--tasks", ",".join(names)]
    text = "" if limit is None else str(limit).strip()
    if not text:
        return argv
    if not text.isdigit() or int(text) == 0:
        raise LaunchRefused(f"evaluate: limit: {text!r} is not a number of examples (empty: all of them)")
    return [*argv, "--limit", str(int(text))]


@dataclass
class Job:
    id: str
    run_dir: str  # relative to the workspace
    action: str  # merge | gguf | push | evaluate
    argv: list[str]
    created: float
    state: str = "queued"  # queued | running | done | failed | ended
    pid: int | None = None
    start_time: str | None = None  # the process's kernel start time (a reused pid is not the job)
    started: float | None = None
    finished: float | None = None
    returncode: int | None = None

    @property
    def key(self) -> str:
        """Unique in the workspace (an id is unique in its run)."""
        return f"{self.run_dir}/{self.id}"

    def path(self, ws: Workspace, suffix: str) -> Path:
        return ws.root / self.run_dir / JOBS_DIR / f"{self.id}{suffix}"


class JobQueue:
    """The jobs of every run that `run_dirs` lists (the Run tab's runs), and the worker that runs them."""

    def __init__(self, ws: Workspace, run_dirs: Callable[[], list[Path]]):
        self.ws, self.run_dirs = ws, run_dirs
        self._wake = threading.Condition()
        self._submitted = False  # set by submit, under _wake: the worker looks again before it sleeps
        self._worker: threading.Thread | None = None
        self._current: str | None = None  # the job this app's worker runs (its exit is about to be written)
        self._tried: set[str] = set()  # jobs this worker has started (or failed to): never started twice
        if any(j.state == "queued" for j in self.jobs()):  # left waiting by an earlier app instance
            self._start_worker()

    # ------------------------------------------------------------------ what the page shows

    def jobs(self) -> list[Job]:
        """Every job of every listed run, newest first, with its state as of now."""
        found = []
        for run_dir in self.run_dirs():
            for path in sorted((run_dir / JOBS_DIR).glob("*.json")):
                job = self._read(path)
                if job is not None:
                    found.append(self._seen(job))
        return sorted(found, key=lambda j: (j.created, j.id), reverse=True)

    def latest(self, run_dir: Path) -> Job | None:
        """The run's newest job (what the Export tab shows for the picked run)."""
        rel = self.ws.rel(run_dir)
        return next((j for j in self.jobs() if j.run_dir == rel), None)

    def waiting_before(self, job: Job) -> int:
        """How many jobs run or wait before `job`."""
        return sum(
            j.state == "running" or (j.state == "queued" and (j.created, j.id) < (job.created, job.id))
            for j in self.jobs()
        )

    def log_tail(self, job: Job, lines: int = 40) -> str:
        return read_tail(job.path(self.ws, ".log"), lines) or ""

    # ------------------------------------------------------------------ submit

    def submit(self, run_dir: Path, action: str, argv: list[str]) -> Job:
        """Queue `argv` (run from the workspace root) as a job of `run_dir`; it starts when no job runs."""
        jobs_dir = run_dir / JOBS_DIR
        jobs_dir.mkdir(parents=True, exist_ok=True)
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
        job_id = f"{stamp}-{action}"
        while (jobs_dir / f"{job_id}.json").exists():  # two of one action in one second
            n += 1
            job_id = f"{stamp}-{action}-{n}"
        job = Job(job_id, self.ws.rel(run_dir), action, argv, created=time.time())
        self._write(job)
        self._start_worker()
        with self._wake:
            self._submitted = True
            self._wake.notify_all()
        return job

    # ------------------------------------------------------------------ the worker

    def _start_worker(self) -> None:
        with self._wake:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="app-jobs", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        while True:
            jobs = self.jobs()
            queued = sorted(
                (j for j in jobs if j.state == "queued" and j.key not in self._tried),
                key=lambda j: (j.created, j.id),
            )
            if queued and not any(j.state == "running" for j in jobs):
                job = queued[0]
                self._tried.add(job.key)
                self._current = job.key
                try:
                    self._run(job)
                except OSError:  # its run directory went away, or cannot be written: the next job
                    pass
                finally:
                    self._current = None
                continue
            with self._wake:  # nothing to start: a job of an earlier app instance runs, or none waits
                if not self._submitted:  # (one submitted while we looked is not missed)
                    self._wake.wait(POLL_S if queued else None)
                self._submitted = False

    def _run(self, job: Job) -> None:
        with open(job.path(self.ws, ".log"), "ab") as log:
            log.write(f"$ {shlex.join(job.argv)}\n".encode())
            log.flush()
            try:
                proc = start_tool(self.ws, job.argv, log)  # the app's end never ends a job
            except OSError as e:
                log.write(f"cannot start: {e}\n".encode())
                job.state, job.returncode, job.finished = "failed", 127, time.time()
                self._write(job)
                return
        job.state, job.pid, job.start_time = "running", proc.pid, proc_start_time(proc.pid)
        job.started = time.time()
        self._write(job)
        try:
            code = proc.wait(timeout=TOOL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            with open(job.path(self.ws, ".log"), "a") as log:
                log.write(f"\nkilled: still running after {TOOL_TIMEOUT_S} s\n")
            code = 124
        job.state = "done" if code == 0 else "failed"
        job.returncode, job.finished = code, time.time()
        self._write(job)

    # ------------------------------------------------------------------ files

    def _seen(self, job: Job) -> Job:
        """A job the file says is running whose process is gone ended unseen (the app was not there)."""
        if (
            job.state == "running"
            and job.key != self._current
            and job.pid is not None
            and not process_alive(job.pid, job.start_time)
        ):
            job.state = "ended"
        return job

    def _read(self, path: Path) -> Job | None:
        try:
            return Job(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None  # being replaced, or not a job file

    def _write(self, job: Job) -> None:
        write_atomic(job.path(self.ws, ".json"), json.dumps(asdict(job), indent=1))


# ---------------------------------------------------------------------------- how the Export tab shows jobs


def job_markdown(ws: Workspace, job: Job, waiting: int) -> str:
    """One job's state as the Export tab shows it."""
    head = f"**{job.action}** `{job.id}` — **{job.state}**"
    log = f"`{ws.rel(job.path(ws, '.log'))}`"
    if job.state == "queued":
        return f"{head}: waiting for {waiting} job(s) before it"
    if job.state == "running":
        return f"{head} (output in {log})"
    if job.state == "ended":
        return f"{head}: it ended while no app was watching, so its exit code is unknown; see {log}"
    done = f"{head} (exit code {job.returncode}; output in {log})"
    out = written(ws.root / job.run_dir, job.action) if job.state == "done" else None
    return (
        f"{done}: wrote `{ws.rel(out)}`, **{megabytes(size_on_disk(out))}**" if out and out.exists() else done
    )


def jobs_rows(jobs: list[Job]) -> list[list]:
    """Rows of the jobs table, newest first."""
    return [
        [
            j.id,
            j.run_dir.removeprefix("runs/"),
            j.state,
            "" if j.returncode is None else j.returncode,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created)),
        ]
        for j in jobs
    ]
