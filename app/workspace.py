"""The workspace: the one directory the app may read and write (runs/, recipes/, data/, models), and the
one place code a recipe names may come from (besides the operator's --allow-module list).

Every path that comes from the UI (or its API) goes through `Workspace.inside`, which resolves it
(symlinks and `..` included) and refuses anything that lands outside the workspace; every recipe goes
through `recipe_refusals` (training.launch.confine: the same rule the runs it starts are given).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from training.core.errors import UserError
from training.core.paths import CONFIGS_DIR
from training.launch.backend import Backend, read_backend
from training.launch.confine import RUNS, Confinement, Outside
from training.run.rundir import LOCK, RunDir, is_adapter, is_model

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODELS = ["bundled:smollm2-135m-instruct"]
RECIPE_DIRS = ("recipes", "training/recipes")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def is_run_dir(path: Path) -> bool:
    """Whether training wrote (or is writing) `path`, whoever started it: it holds any of status.json,
    metrics.jsonl, run.lock, checkpoints/, final/ or config.yaml (and is not itself a model directory)."""
    run = RunDir(path)
    written = (run.status, run.metrics, run.root / LOCK, run.checkpoints, run.final, run.config)
    return path.is_dir() and not is_model(path) and any(p.exists() for p in written)


PathRefused = Outside  # a path (or code) from the UI or a recipe that the workspace's rule refuses


def check_name(name: str, what: str) -> str:
    name = (name or "").strip()
    if not NAME_RE.match(name) or ".." in name:
        raise PathRefused(
            f"{what}: {name!r} is not a valid name (letters, digits, '_', '-', '.'; no slashes)"
        )
    return name


@dataclass(frozen=True)
class Workspace:
    """The directory the app works in, and the operator's allow-list of modules a recipe may import."""

    root: Path
    allow_modules: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).resolve())
        self.confinement  # noqa: B018 (built once, here: ValueError for a name on the allow-list that is not a module's)

    @cached_property
    def confinement(self) -> Confinement:
        """The rule every recipe and UI path is held to here (and that runs started here are given)."""
        return Confinement(self.root, self.allow_modules)

    @property
    def runs(self) -> Path:
        return self.root / RUNS

    @property
    def recipes(self) -> Path:
        return self.root / "recipes"

    def inside(self, path: str | Path, what: str, under: str | None = None) -> Path:
        """Resolve `path` (relative to the workspace root) and refuse it unless it stays inside the
        workspace (or inside `under`, a sub-directory of it)."""
        return self.confinement.inside(path, what, under)

    def rel(self, path: Path) -> str:
        """A path as the UI shows it: relative to the workspace root."""
        try:
            return str(Path(path).resolve().relative_to(self.root))
        except ValueError:
            return str(path)

    # ------------------------------------------------------------------ listings for the pickers

    def recipe_files(self) -> list[str]:
        out = []
        for d in RECIPE_DIRS:
            out += [self.rel(p) for p in sorted((self.root / d).glob("*.yaml"))]
        return out

    def accelerate_configs(self) -> dict[str, Path]:
        """Backend name -> accelerate config file (the workspace's accelerate_configs/, else the repo's)."""
        d = self.root / "accelerate_configs"
        if not d.is_dir():
            d = CONFIGS_DIR  # the ones shipped with the package
        return {p.stem: p for p in sorted(d.glob("*.yaml"))}

    def backends(self) -> dict[str, Backend | UserError]:
        """Backend name -> what its accelerate config asks for (training.launch.read_backend), or the
        error that file gives (the picker still lists it; launching it shows the error)."""
        out: dict[str, Backend | UserError] = {}
        for name, path in self.accelerate_configs().items():
            try:
                out[name] = read_backend(path)
            except UserError as e:
                out[name] = e
        return out

    def run_dirs(self) -> list[Path]:
        """Every run directory under runs/ (`is_run_dir`), by name: runs/NAME, or runs/GROUP/NAME when
        runs/GROUP is not a run itself. Hidden entries (the app's registry, temporary directories) and
        links that lead out of runs/ are skipped (as `inside(..., under="runs")` refuses them)."""
        found: list[Path] = []
        for path in self._visible_dirs(self.runs):
            if is_run_dir(path):
                found.append(path)
            else:
                found += [sub for sub in self._visible_dirs(path) if is_run_dir(sub)]
        return found

    def _visible_dirs(self, path: Path) -> list[Path]:
        try:
            entries = sorted(path.iterdir())
        except OSError:
            return []
        runs = self.runs.resolve()
        return [
            p
            for p in entries
            if not p.name.startswith(".") and p.is_dir() and p.resolve().is_relative_to(runs)
        ]

    def chat_sources(self, run_dirs: list[Path]) -> list[str]:
        """Everything the Chat tab can load: the final/, the exports (merged/, gguf/model.gguf) and complete
        checkpoints (newest first) of each of
        `run_dirs` (the runs as the Run tab lists them: `RunRegistry.run_dirs`), models under models/,
        bundled models."""
        out = []
        for path in run_dirs:
            run = RunDir(path)
            if run.final.is_dir():
                out.append(self.rel(run.final))
            # what the Export tab made of it: the merged model, the GGUF file
            out += [self.rel(p) for p in (run.merged, run.gguf) if is_model(p) or p.is_file()]
            out += [self.rel(c) for c in reversed(run.complete_checkpoints())]
        models = self.root / "models"
        if models.is_dir():
            out += [self.rel(m) for m in sorted(models.iterdir()) if is_model(m) or is_adapter(m)]
        return out + BUNDLED_MODELS


def recipe_refusals(ws: Workspace, raw: dict) -> dict[str, list[str]]:
    """{key: [why]} for every path of a (validated) recipe dict that leaves the workspace (or, for
    output_dir, runs/) and every piece of code it names outside the workspace and the allow-list. The
    recipe's schema says which fields are paths and code (`training.config.recipe_paths`, `recipe_code`);
    a hub name such as "org/model" resolves inside the workspace too, and then loads from the hub."""
    return ws.confinement.problems(raw)
