"""rl.async: the rollouts of step s drawn in the background from the policy of max(0, s - 2) updates (K = 1) while
step s - 1 trains. One process logs the staleness (0, then 1) and the importance ratios (exactly 1 where the
generating weights are the live ones), trains step 1 exactly as the synchronous run does and later steps
differently (older weights drew them); a resume from the step-3 checkpoint (which keeps step 4's rollouts,
drawn before it from weights a resumed run no longer has) equals the uninterrupted run, and so does 2-process
DDP killed in step 5 and resumed. A reward failing in the background: test_rl.py. FSDP and ZeRO-3 are refused (tests/unit/launch/test_refusals.py); agent
episodes drawn ahead are in test_agent_rl.py (its SFT model)."""

from __future__ import annotations

import json

import pytest
from test_rl import REWARD, assert_rl_run, write_recipe

from conftest import train_inprocess
from launching import CKPT_AT, STEPS, TWO_RANKS, kill_and_resume, rows, with_checkpoint_of

ASYNC = "rl.async=1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The synchronous run and the rl.async=1 run of one recipe (full fine-tuning, one process)."""
    w = tmp_path_factory.mktemp("rl_async")
    (w / "rewards.py").write_text(REWARD)
    recipe = write_recipe(w / "full.yaml", w / "unused", w / "rewards.py")
    out = {"recipe": recipe, "sync": w / "sync", "async": w / "async"}
    assert train_inprocess(recipe, f"output_dir={out['sync']}") == 0
    assert train_inprocess(recipe, f"output_dir={out['async']}", ASYNC) == 0
    return out


def samples(run) -> dict[int, list]:
    out = {}
    for s in map(json.loads, (run / "samples.jsonl").read_text().splitlines()):
        out.setdefault(s["step"], []).append((s["row"], s["completion"], s["reward"]))
    return out


def test_staleness_and_importance_ratios_are_logged_and_bounded(runs):
    """Step 1 trains on the initial policy's rollouts (staleness 0: the copy holds the live weights, ratio
    exactly 1, nothing truncated); every later step on rollouts one update old, with ratios that moved."""
    got = rows(runs["async"], "reward")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s]["staleness"] for s in sorted(got)] == [0.0] + [1.0] * (STEPS - 1)
    assert got[1]["importance_ratio/mean"] == 1.0 and got[1]["importance_ratio/truncated_fraction"] == 0.0
    for s in range(2, STEPS + 1):
        assert got[s]["importance_ratio/mean"] != 1.0, s
        assert 0.0 <= got[s]["importance_ratio/truncated_fraction"] <= 1.0
        assert got[s]["rollout_wait_s"] >= 0.0 and got[s]["generation_s"] > 0
    assert "staleness" not in rows(runs["sync"], "reward")[1]  # the synchronous run logs none


def test_the_first_step_is_the_synchronous_one_and_later_steps_are_drawn_from_older_weights(runs):
    """Step 1: the same prompts, completions, rewards and loss as the synchronous run. Later steps: the same
    prompts (the windows read ahead are the loop's), another loss (drawn from older weights and weighted)."""
    sync, asyn = samples(runs["sync"]), samples(runs["async"])
    got, want = rows(runs["async"], "reward"), rows(runs["sync"], "reward")
    assert asyn[1] == sync[1] and got[1]["loss"] == want[1]["loss"]
    for s in range(2, STEPS + 1):
        assert [r for r, *_ in asyn[s]] == [r for r, *_ in sync[s]]
        assert got[s]["loss"] != pytest.approx(want[s]["loss"], rel=1e-6, abs=1e-9), s


def test_a_resumed_async_run_equals_the_uninterrupted_one(runs, tmp_path):
    """The step-3 checkpoint keeps step 4's rollouts, drawn ahead from the weights of step 2: steps 4-6 and
    the final weights equal the uninterrupted run."""
    out = with_checkpoint_of(runs["async"], CKPT_AT, tmp_path / "resumed")
    assert train_inprocess(runs["recipe"], f"output_dir={out}", ASYNC) == 0
    assert_rl_run(out, runs["async"], steps=range(CKPT_AT + 1, STEPS + 1))
    assert [s for s in samples(out)] == list(range(CKPT_AT + 1, STEPS + 1))
    assert all(samples(out)[s] == samples(runs["async"])[s] for s in samples(out))


@pytest.mark.slow
def test_ddp_async_two_processes_equal_one_process_through_kill_and_resume(runs, tmp_path):
    """2 ranks x batch 1 x 2 accumulation with rl.async=1, killed in step 5 and resumed from the step-3
    checkpoint (each rank's rollouts drawn ahead kept): equal to one process."""
    out = tmp_path / "ddp-async"
    proc = kill_and_resume("ddp.yaml", runs["recipe"], out, *TWO_RANKS, ASYNC)
    assert "are drawn from the weights of step" not in proc.stderr  # step 4's came from the checkpoint
    assert_rl_run(out, runs["async"])
