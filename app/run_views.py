"""What the app shows of each run: its state and progress (`RunView`, read from the run directory and the
registry's verdict on whether it is alive), the runs table, its log tail and latest RL samples, and the
progress, tracker and evaluation lines of the Run tab. The runs themselves, and starting and stopping them,
are app/runs.py's `RunRegistry`.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.runs import LOG, Found, RunRegistry, read_tail
from app.workspace import Workspace
from training.run.metrics import read_metrics
from training.run.rundir import EVAL_RESULTS, MLFLOW_STORE, TENSORBOARD_DIR, WANDB_DIR, RunDir


@dataclass
class RunView:
    """What the Run tab shows about one run."""

    name: str
    state: str  # running | stopping | finished | stopped | failed
    step: int = 0
    total_steps: int | None = None
    elapsed_s: float | None = None
    remaining_s: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None  # model FLOPs utilisation (GPU datasheet peak, or the CPU's measured ceiling)
    message: str = ""
    rows: list[dict] = field(default_factory=list)


class RunViews:
    """The registry's runs as the page shows them: each run's view, the runs table, log tails and samples."""

    def __init__(self, runs: RunRegistry):
        self.runs = runs
        self.ws = runs.ws

    def view(self, name: str) -> RunView:
        return self.of(self.runs.get(name))

    def of(self, f: Found, all_rows: bool = True) -> RunView:
        """The run's state and progress; `all_rows=False` reads only the end of metrics.jsonl (the table)."""
        status = f.dir.read_status() or {}
        rows = read_metrics(f.dir.metrics) if all_rows else _tail_rows(f.dir.metrics)
        train = [x for x in rows if x.get("loss") is not None]
        evals = [x for x in rows if x.get("eval_loss") is not None]
        state, message = self.runs.state(f, status)
        step = status.get("step", train[-1]["step"] if train else 0)
        if train and train[-1]["step"] > step:
            step = train[-1]["step"]
        total = status.get("total_steps") or (train[-1].get("total_steps") if train else None)
        elapsed, remaining = run_clock(status, train, state, step, total, all_rows)
        if state == "stopped":
            ckpt = f.dir.latest_checkpoint()
            message = f"stopped at step {step}; checkpoint {self.ws.rel(ckpt) if ckpt else '(none)'}; start it again to resume"
        return RunView(
            name=f.name,
            state=state,
            step=step,
            total_steps=total,
            elapsed_s=elapsed,
            remaining_s=remaining,
            loss=train[-1]["loss"] if train else None,
            eval_loss=evals[-1]["eval_loss"] if evals else None,
            tokens_per_s=train[-1].get("tokens_per_s") if train else None,
            mfu=train[-1].get("mfu") if train else None,
            message=message,
            rows=rows,
        )

    def latest_samples(self, name: str) -> list[dict]:
        """Online RL: the prompt/completion/reward samples of the last step that wrote some ([] otherwise)."""
        f = self.runs.find(name)
        path = f.dir.samples if f is not None else None
        if path is None or not path.is_file():
            return []
        rows = _json_rows(path.read_text(encoding="utf-8", errors="replace").splitlines()[-64:])
        last = rows[-1]["step"] if rows else None
        return [x for x in rows if x.get("step") == last]

    def log_tail(self, name: str, lines: int = 40) -> str:
        f = self.runs.find(name)
        if f is None:
            return ""
        tail = read_tail(f.dir.root / LOG, lines)
        if tail is None:
            if f.record is None:
                return f"(started outside the app: no {LOG}; its output went where it was started)"
            return ""
        return tail

    def table(self) -> list[list]:
        """Rows for the runs table, newest first."""
        out = []
        for f in self.runs.runs():
            v = self.of(f, all_rows=False)
            steps = f"{v.step}/{v.total_steps}" if v.total_steps else str(v.step)
            loss = f"{v.loss:.4f}" if v.loss is not None else "-"
            started = time.strftime("%Y-%m-%d %H:%M", time.localtime(f.started))
            r = f.record
            backend = f"{r.backend} x{r.num_processes}" if r is not None else "command line"
            out.append([f.name, v.state, steps, loss, backend, started])
        return out


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _tail_rows(path: Path, nbytes: int = 64_000) -> list[dict]:
    """The last rows of metrics.jsonl (for the runs table: the latest step and loss, without parsing a
    long run's whole file every refresh)."""
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, 2) - nbytes)
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return _json_rows(lines[1:] if start else lines)  # a read from the middle starts with a cut line


def _json_rows(lines: list[str]) -> list[dict]:
    """The rows of JSON lines (metrics.jsonl, samples.jsonl), but for a line being written."""
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def run_clock(status: dict, train: list[dict], state: str, step: int, total, all_rows: bool):
    """(elapsed, remaining) seconds: the trainer's own, from status.json (written every step: its clock goes on
    over a resume, and its estimate is its progress bar's), counted down since it was written; for a run whose
    trainer does not say, from the metrics rows."""
    if "elapsed_s" in status:
        since = max(time.time() - status.get("time", time.time()), 0.0) if state == "running" else 0.0
        left = status.get("remaining_s")
        remaining = max(left - since, 0.0) if left is not None and state == "running" else None
        return status["elapsed_s"] + since, remaining
    elapsed = train[-1].get("elapsed_s") if train else None
    remaining = None
    if state == "running" and all_rows and elapsed and train and total:
        done = max(step - (train[0]["step"] - 1), 1)  # steps timed in this process (resume-aware)
        remaining = elapsed / done * max(total - step, 0)
    return elapsed, remaining


def progress_bar(step: int, total: int | None, cells: int = 24) -> str:
    """The run's progress as a bar of `cells` blocks."""
    if not total:
        return ""
    full = round(cells * min(step / total, 1.0))
    return "`" + "█" * full + "░" * (cells - full) + "`"


def progress_markdown(v: RunView) -> str:
    steps = f"{v.step} / {v.total_steps}" if v.total_steps else f"{v.step}"
    pct = f" ({100 * v.step / v.total_steps:.0f}%)" if v.total_steps else ""
    parts = [
        f"**{v.name}** — **{v.state}**",
        f"step **{steps}**{pct} {progress_bar(v.step, v.total_steps)}".strip(),
        f"elapsed {_fmt_time(v.elapsed_s)}",
        f"remaining ~{_fmt_time(v.remaining_s)}" if v.state == "running" else "",
        f"loss {v.loss:.4f}" if v.loss is not None else "",
        f"eval loss {v.eval_loss:.4f}" if v.eval_loss is not None else "",
        f"{v.tokens_per_s:.0f} tokens/s" if v.tokens_per_s else "",
        f"MFU {v.mfu:.1%}" if v.mfu is not None else "",
    ]
    if v.state == "running" and not v.rows:
        parts[1:] = ["starting: loading the model and data (see the log)"]
    text = " · ".join(p for p in parts if p)
    return text + (f"\n\n{v.message}" if v.message else "")


# ---------------------------------------------------------------------------- trackers and evaluation

TRACKER_DIRS = (  # (label, name in the run dir, how to look at it)
    ("TensorBoard", TENSORBOARD_DIR, "tensorboard --logdir {path}"),
    ("MLflow", MLFLOW_STORE, "MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {path}"),
    ("Weights & Biases", WANDB_DIR, "wandb sync {path}/offline-run-*"),
)


def tracker_markdown(ws: Workspace, run_dir: RunDir) -> str:
    """The run's tracker directories that exist, each with the command that opens it."""
    lines = []
    for label, name, how in TRACKER_DIRS:
        path = run_dir.root / name
        if path.is_dir():
            rel = ws.rel(path)
            lines.append(f"- {label}: `{rel}` — `{how.format(path=shlex.quote(rel))}`")
    return "**Trackers**\n" + "\n".join(lines) if lines else ""


def eval_markdown(run_dir: RunDir) -> str:
    """The run's lm-evaluation-harness results (eval_results.json), one line per task."""
    try:
        tasks = json.loads(run_dir.eval_results.read_text()).get("tasks", {})
    except (OSError, json.JSONDecodeError):
        return ""
    lines = []
    for name, r in sorted(tasks.items()):
        scores = ", ".join(
            f"{k.split(',')[0]} {v:.4f}"
            for k, v in r.get("metrics", {}).items()
            if isinstance(v, float) and "stderr" not in k
        )
        lines.append(f"- {name}: {scores} (n={r.get('n')}, {r.get('date', '')})")
    return "**Evaluation** (`" + EVAL_RESULTS + "`)\n" + "\n".join(lines) if lines else ""
