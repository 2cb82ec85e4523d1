"""The fault-injection spec (training.core.faults) and the elastic start-up line: a fault with a rank fires
on that global rank only, and only in the first attempt of an elastic job (one worker dies once)."""

import pytest

from training.core import faults
from training.launch.backend import elastic_attempt


@pytest.mark.parametrize(
    "spec, rank, restart, expected",
    [
        ("kill@mid_step:5", "1", "0", [("kill", "mid_step", 5)]),  # no rank: every process
        ("kill@mid_step:5:1", "1", "0", [("kill", "mid_step", 5)]),
        ("kill@mid_step:5:1", "0", "0", []),  # another rank's fault
        ("kill@mid_step:5:1", "1", "1", []),  # the restarted group lives
        ("kill@mid_step:5:1,nan@loss:2", "0", "0", [("nan", "loss", 2)]),
    ],
)
def test_a_fault_with_a_rank_fires_on_that_rank_in_the_first_attempt(
    monkeypatch, spec, rank, restart, expected
):
    monkeypatch.setenv(faults.ENV, spec)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    assert faults._faults() == expected


def test_the_elastic_line_names_the_attempt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert elastic_attempt() is None  # a plain launch says nothing
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert elastic_attempt() is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic_attempt().startswith("elastic: attempt 2 of 4:")
