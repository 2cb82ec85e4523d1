"""Installed, not only checked out: the project built as a wheel (`pip install .`, no -e) into a fresh
virtual environment, and the planner run from another directory on a shipped recipe with the shipped
accelerate files (found through the package, not through a checkout).

The fresh environment borrows the test environment's third-party packages (torch, transformers, ...)
through a .pth line, so nothing is downloaded; llm-forge itself is only the installed copy: the
editable install of the checkout is not visible there (its .pth hook is not processed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def run(cmd: list, cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh virtual environment with llm-forge installed from a wheel."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # the tracked files only, so the build leaves the checkout untouched
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in files.splitlines():
        if (ROOT / name).is_file() and not name.startswith(("tests/", "docs/", "data/", "benchmarks/")):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    wheels = tmp / "wheels"
    built = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            wheels,
            source,
        ],
        tmp,
    )
    assert built.returncode == 0, built.stderr
    venv = tmp / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", venv], tmp).returncode == 0
    python = venv / "bin" / "python"
    site = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).stdout.strip()
    )
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the third-party packages
    wheel = next(wheels.glob("llm_forge-*.whl"))
    done = run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        tmp,
    )
    assert done.returncode == 0, done.stderr
    return python


def test_the_installed_package_is_the_one_imported(installed, tmp_path):
    out = run([installed, "-c", "import training, accelerate_configs; print(training.__file__)"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(installed.parents[1]), out.stdout  # inside the venv
    assert not Path(out.stdout.strip()).is_relative_to(ROOT)


def test_the_planner_finds_the_shipped_files_from_another_directory(installed, tmp_path):
    where = run(
        [
            installed,
            "-c",
            "from training.core.paths import CONFIGS_DIR, RECIPES_DIR; print(CONFIGS_DIR, RECIPES_DIR)",
        ],
        tmp_path,
    )
    configs, recipes = map(Path, where.stdout.split())
    assert (configs / "zero3_offload.yaml").is_file() and (configs / "ds_zero3_offload.json").is_file()
    recipe = tmp_path / "lora.yaml"  # a shipped recipe, its run directory under this other directory
    recipe.write_text(
        (recipes / "lora.yaml").read_text().replace("output_dir: runs/", f"output_dir: {tmp_path}/")
    )
    out = run([installed, "-m", "training.plan", recipe, "--num-gpus", "2", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    plans = {p["backend"]: p for p in json.loads(out.stdout)}
    # every shipped accelerate file is planned, the DeepSpeed ones with their JSON found in the package
    assert {p.stem for p in configs.glob("*.yaml")} <= set(plans), sorted(plans)
    assert plans["zero3_offload"]["fits"] and plans["zero2"]["peak_gib"] > 0
