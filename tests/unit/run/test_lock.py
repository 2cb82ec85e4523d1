"""training.run.lock: one run per directory. A reader that asks whether a directory is held (is_held,
which the app's poll calls every few seconds) takes the lock for an instant; a run starting in that
instant must not be refused, while a live holder still is."""

from __future__ import annotations

import fcntl
import threading

import pytest

from training.core.errors import RecipeError
from training.run.lock import RunLock, is_held
from training.run.rundir import LOCK


def test_a_probe_holding_the_lock_for_an_instant_does_not_refuse_a_start(tmp_path):
    (tmp_path / LOCK).touch()
    probe = open(tmp_path / LOCK, "a+")  # noqa: SIM115 (closed below)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as is_held does, for longer than it does
    threading.Timer(0.1, probe.close).start()
    with RunLock(tmp_path, ["python", "-m", "training.train", "r.yaml"]) as lock:
        lock.acquire()
        assert is_held(tmp_path)
    assert not is_held(tmp_path)


def test_a_live_holder_is_refused(tmp_path):
    with RunLock(tmp_path, ["first"]) as first:
        first.acquire()
        with (
            pytest.raises(RecipeError, match="is in use by a live run .*: first"),
            RunLock(tmp_path) as second,
        ):
            second.acquire()
