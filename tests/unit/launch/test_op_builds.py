"""DeepSpeed's op builds: each environment builds into its own directory, a lock left by a killed build
is refused with exit 2 and the file named, where DeepSpeed would wait on it forever, and `make install`
prebuilds the ops every run here compiles as it starts (training.parallel.deepspeed_ops)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from conftest import ROOT, run_cli
from training.core.errors import UserError
from training.launch import op_builds
from training.parallel import deepspeed_ops


def lock_at(root, op="cpu_adam", age_s=600.0):
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_dead_builds_lock_is_refused_naming_the_file(tmp_path, monkeypatch):
    from torch.utils import cpp_extension, file_baton

    monkeypatch.setattr(
        cpp_extension, "FileBaton", file_baton.FileBaton, raising=False
    )  # torch <= 2.13's lock
    lock = lock_at(tmp_path)
    assert op_builds.stale_locks(tmp_path) == [lock]
    with pytest.raises(UserError) as e:
        op_builds.check_op_build_locks(tmp_path)
    assert f"rm {lock}" in str(e.value) and "10 min old" in str(e.value)


def test_a_lock_file_is_no_trap_where_torch_builds_under_an_advisory_lock(tmp_path, monkeypatch):
    """torch 2.14's cpp_extension holds an OS advisory lock on the file (released when the builder dies) and
    leaves the file after every build: a lock file there must not refuse every DeepSpeed run after the first."""
    from torch.utils import cpp_extension

    lock_at(tmp_path)
    assert op_builds.lock_files_block() == hasattr(cpp_extension, "FileBaton")
    monkeypatch.delattr(cpp_extension, "FileBaton", raising=False)
    assert not op_builds.lock_files_block()
    op_builds.check_op_build_locks(tmp_path)  # not refused


def test_a_lock_of_the_default_root_layout_is_found(tmp_path):
    """Without TORCH_EXTENSIONS_DIR, torch builds under ~/.cache/torch_extensions/py311_cpu/<op>/."""
    lock = lock_at(tmp_path / "py311_cpu", op="deepspeed_shm_comm")
    assert op_builds.stale_locks(tmp_path) == [lock]


def test_a_build_in_progress_is_left_to_finish(tmp_path):
    """A lock some process holds open is a build still compiling (however old), and a young lock may be a
    build starting on another machine of the same launch: neither is refused."""
    held = lock_at(tmp_path, "cpu_adam")
    young = lock_at(tmp_path, "deepspeed_shm_comm", age_s=30)
    fd = os.open(held, os.O_RDONLY)  # as FileBaton holds it while the build runs
    try:
        assert op_builds.stale_locks(tmp_path) == []
        op_builds.check_op_build_locks(tmp_path)
    finally:
        os.close(fd)
    assert op_builds.stale_locks(tmp_path) == [held]
    assert young not in op_builds.stale_locks(tmp_path)


def test_ops_build_in_the_environments_own_directory(tmp_path, monkeypatch):
    # set, then deleted: monkeypatch records the worker's own value (or its absence) to put back, where a bare
    # delenv of an unset variable records nothing, and the directory use_environment_build_dir sets below was
    # left in the worker: its next DeepSpeed run compiled cpu_adam again there (60-130 s)
    monkeypatch.setenv(op_builds.ENV, "")
    monkeypatch.delenv(op_builds.ENV)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path / "python"))
    (tmp_path / "venv").mkdir()
    assert op_builds.use_environment_build_dir() == tmp_path / "venv" / "torch_extensions"
    assert os.environ[op_builds.ENV] == str(tmp_path / "venv" / "torch_extensions")
    monkeypatch.setenv(op_builds.ENV, str(tmp_path / "mine"))  # the user's own choice stands
    assert op_builds.use_environment_build_dir() == tmp_path / "mine"


def test_a_deepspeed_run_exits_2_on_a_dead_builds_lock(tmp_path, make_recipe):
    """The check runs in the training set-up before DeepSpeed's accelerator would build (and wait)."""
    lock = lock_at(tmp_path / "ext", op="deepspeed_shm_comm")
    env = {
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ROOT / "accelerate_configs/ds_zero2.json"),
    }
    proc = run_cli("training.train", make_recipe(), env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"rm {lock}" in proc.stderr
    assert lock.exists()  # named, never deleted behind the user's back


def test_prebuild_builds_the_start_up_ops_this_accelerator_offers_and_compiles(tmp_path, monkeypatch):
    """`make install` runs this in the background: the ops every DeepSpeed run here would compile as it
    starts, skipping those the accelerator has no builder for or DeepSpeed finds incompatible."""
    import cpuinfo
    import deepspeed.accelerator
    import deepspeed.ops

    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # prebuild caches it: put back after
    loaded = []

    class Builder:
        def __init__(self, name):
            self.NAME = name

        def load(self, verbose):
            loaded.append((self.NAME, os.environ[op_builds.ENV]))

    builders = {"CPUAdamBuilder": Builder("cpu_adam"), "ShareMemCommBuilder": Builder("deepspeed_shm_comm")}

    class Accelerator:
        def create_op_builder(self, name):
            return builders.get(name)

    monkeypatch.setenv(op_builds.ENV, str(tmp_path / "ext"))
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", Accelerator)
    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", {"cpu_adam": True}, raising=False)
    assert deepspeed_ops.prebuild() == ["cpu_adam"]
    assert loaded == [("cpu_adam", str(tmp_path / "ext"))]
    del builders["CPUAdamBuilder"]  # a GPU accelerator without the CPU collectives, say
    assert deepspeed_ops.prebuild() == []
    lock_at(tmp_path / "ext")  # a dead build is named, as before a run
    with pytest.raises(UserError, match="rm "):
        deepspeed_ops.prebuild()


def counting(probe):
    def get_cpu_info():
        get_cpu_info.calls += 1
        return probe()

    get_cpu_info.calls = 0
    return get_cpu_info


def test_deepspeed_asks_py_cpuinfo_once_per_machine_and_builds_with_the_same_flags(tmp_path, monkeypatch):
    import cpuinfo
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    probe = counting(cpuinfo.get_cpu_info)  # the real probe: a Python of its own, about a second
    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    op_builds.cache_cpu_info()
    op_builds.cache_cpu_info()  # a second set-up in the same process wraps nothing twice
    builder = CPUAdamBuilder()
    flags = builder.cpu_arch(), builder.simd_width()
    answer = cpuinfo.get_cpu_info()
    assert probe.calls == 1 and answer["arch"] and answer["flags"]
    answer["flags"].clear()  # what a caller does to its answer is its own
    assert cpuinfo.get_cpu_info()["flags"]
    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)  # as a new process on this machine starts
    op_builds.cache_cpu_info()
    assert (CPUAdamBuilder().cpu_arch(), CPUAdamBuilder().simd_width()) == flags and probe.calls == 1
    [(key, cached)] = json.loads((tmp_path / "cpuinfo.json").read_text()).items()
    assert "py-cpuinfo 9" in key and cached["flags"] and cached["arch"] == answer["arch"]


def test_an_unreadable_cache_or_an_empty_answer_is_probed_again(tmp_path, monkeypatch):
    import cpuinfo

    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    (tmp_path / "cpuinfo.json").write_text('{"torn')
    answers = iter([{}, {"arch": "X86_64", "flags": ["avx2"]}])
    probe = counting(lambda: next(answers))
    for calls, arch in ((1, None), (2, "X86_64"), (2, "X86_64")):  # a new process each time
        monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
        op_builds.cache_cpu_info()
        assert cpuinfo.get_cpu_info().get("arch") == arch and probe.calls == calls
