"""The trainer's own clock (training.loop.fit.timing), which status.json and the app's remaining time read."""

from __future__ import annotations

import time

import pytest
from tqdm import tqdm

from training.loop.fit import timing


def test_the_remaining_time_is_known_from_the_first_step_even_before_the_bar_redraws():
    """tqdm's smoothed rate exists only once the bar has redrawn (at most every 0.1 s): a resumed run whose steps
    take less had none at its fourth step and status.json said nothing of the time left. Until then, the
    plain mean rate of this attempt's steps (a resume's first steps are not its)."""
    bar = tqdm(total=10, initial=4, mininterval=3600, disable=False)
    start = time.time() - 100.0  # the run's clock goes on from its checkpoint's rows
    assert timing(bar, start)["remaining_s"] is None  # no step of this attempt yet
    time.sleep(0.05)
    bar.update(2)
    assert bar.format_dict["rate"] is None  # the bar has not redrawn
    clock = timing(bar, start)
    per_step = bar.format_dict["elapsed"] / 2
    assert clock["remaining_s"] == pytest.approx(4 * per_step, rel=0.05) and clock["elapsed_s"] >= 100.0
    bar.close()
