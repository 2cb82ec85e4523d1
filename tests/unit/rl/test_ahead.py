"""rl.async's background copy (training/rl/ahead.py): the rollouts of step s are drawn by a copy holding exactly
the live weights after max(0, s - 1 - K) updates, and the generating log-probabilities kept with them are that
copy's, while the live policy trains on (its updates never reach a draw in flight); the copy shares the frozen
weights and owns its trainable ones; a failed draw stops the step that waits for it."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from training.rl.ahead import AheadRollouts, PolicyCopy, version_of
from training.rl.metrics import Sums


class Policy(torch.nn.Module):
    """A policy whose trainable weight is its version (the number of updates it had), beside a frozen one."""

    def __init__(self):
        super().__init__()
        self.trained = torch.nn.Parameter(torch.zeros(3))
        self.frozen = torch.nn.Parameter(torch.full((3,), 7.0), requires_grad=False)

    def version(self) -> float:
        return float(self.trained[0].detach())


class Drawn:
    """What the fake stage draws: the version of the weights that drew it."""

    def __init__(self, version: float):
        self.version = version

    def tensors(self, pad: int):
        ids = torch.zeros(1, 4, dtype=torch.long)
        return ids, torch.ones_like(ids), torch.ones(1, 3)


class Stage:
    """The RolloutStage interface AheadRollouts uses: the draw of step t waits until the test releases it (after
    the live policy's update of an earlier step), and its log-probabilities are the drawing weights' version."""

    tokenizer = type("Tok", (), {"pad_token_id": 0})()

    def __init__(self, fail_at: int | None = None):
        self.sums, self.fail_at, self.threads = Sums(), fail_at, set()
        self.released = collections.defaultdict(threading.Event)

    def on_its_own(self):
        return self

    def draw_window(self, model, window, step):
        assert self.released[step].wait(10), f"step {step} was never released"
        self.threads.add(threading.current_thread().name)
        if step == self.fail_at:
            raise ValueError(f"the reward failed in step {step}")
        return [Drawn(model.version()) for _ in window]

    def sampling_logps(self, model, ids, attention, mask):
        return torch.full(mask.shape, model.version())

    def check_every_rank(self, error):
        if error is not None:
            raise error


def window_of(step: int) -> list[dict]:
    return [{"row": torch.tensor([10 * step, 10 * step + 1])}]


def ahead_of(stage, k: int, steps: int, live):
    """AheadRollouts over the loop's windows (`at[0]`: the step the loop is at; upcoming: the windows after it)."""
    at = [1]
    ahead = AheadRollouts(stage, k, live, lambda n: [window_of(at[0] + i) for i in range(1, n + 1)], steps)
    return ahead, at


@pytest.mark.parametrize("k", [1, 2])
def test_each_step_is_drawn_by_a_copy_of_the_weights_its_staleness_says(k):
    """Step s's draw, handed over K steps before it, runs after the live updates of the steps between (it is
    released only then): it still draws with, and scores by, the weights of max(0, s - 1 - K) updates."""
    steps, live, stage = 7, Policy(), Stage()
    ahead, at = ahead_of(stage, k, steps, live)
    for step in range(1, steps + 1):
        at[0] = step
        stage.released[step].set()
        a = ahead.take(live, window_of(step), step)
        assert a.step == step and a.rows == [window_of(step)[0]["row"].tolist()]
        assert a.version == version_of(step, k) == max(0, step - 1 - k)
        assert step - 1 - a.version == min(k, step - 1)  # the staleness the step logs
        assert [d.version for d in a.made] == [float(a.version)]  # drawn by the weights of that version
        assert a.behaviour[0].eq(float(a.version)).all()  # and its log-probabilities are that copy's
        with torch.no_grad():  # the step's update, while the later draws handed over wait
            live.trained += 1
    assert stage.threads == {"rl-rollouts"}  # every draw ran in the background thread


def test_the_copy_shares_the_frozen_weights_and_owns_the_trainable_ones():
    live = Policy()
    copy = PolicyCopy(live)
    assert copy.module.frozen is live.frozen and copy.module.trained is not live.trained
    assert not copy.module.training and copy.trainable == ["trained"]
    snap = PolicyCopy.snapshot(live)
    with torch.no_grad():
        live.trained += 5
    assert snap["trained"].eq(0).all()  # a snapshot is a copy, not a view of the live weights
    copy.load(PolicyCopy.snapshot(live))
    assert copy.module.version() == 5.0
    with torch.no_grad():
        live.trained += 1
    assert copy.module.version() == 5.0 and live.version() == 6.0


def test_a_failed_draw_stops_the_step_that_waits_for_it():
    live, stage = Policy(), Stage(fail_at=2)
    ahead, at = ahead_of(stage, 1, 4, live)
    for step in (1, 2):
        stage.released[step].set()
    assert ahead.take(live, window_of(1), 1).version == 0
    at[0] = 2
    with pytest.raises(ValueError, match="the reward failed in step 2"):
        ahead.take(live, window_of(2), 2)
