"""train.optimizer=muon across processes: 2-process DDP (each rank orthogonalises whole matrices from the
all-reduced gradients) matches one process with the same global batch, and resuming from the step-3
checkpoint (Muon's momentum buffers and AdamW's moments in the optimizer state) reproduces the run.

torch's Muon runs its Newton-Schulz iteration in bfloat16: the DDP gradients (summed over two ranks)
differ from one process's in the last fp32 bits, and now and then that flips one bf16 rounding of the
orthogonalised update, i.e. 2^-8 of one Muon step (0.2 * sqrt(128) * lr = 6.8e-3 at most here), and the
flips compound over the steps. So DDP is compared with one process at the losses' usual tolerance, and
the weights within a tenth of one Muon step, with few elements (< 5%) beyond the other backends'
fp32 tolerance. The resume (one process, from its own step-3 checkpoint) is compared exactly, as other
backends' are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import train_inprocess
from launching import (
    CKPT_AT,
    SINGLE_OVERRIDES,
    STEPS,
    TWO_RANKS,
    assert_identical_run,
    launch,
    rows,
    weights,
    with_checkpoint_of,
    write_recipe,
)

pytestmark = pytest.mark.slow

ONE_STEP = 0.2 * 128**0.5 * 3e-3  # match_rms_adamw: 0.2 sqrt(max(rows, cols)) train.lr (write_recipe's)


def test_muon_ddp_matches_one_process_and_resumes_exactly(tmp_path: Path):
    recipe = write_recipe(tmp_path / "recipe.yaml", tmp_path / "unused", train={"optimizer": "muon"})
    single = tmp_path / "single"
    assert train_inprocess(recipe, f"output_dir={single}", *SINGLE_OVERRIDES) == 0
    ddp = tmp_path / "ddp"
    proc = launch("ddp.yaml", recipe, f"output_dir={ddp}", *TWO_RANKS)
    assert "2 process(es), MULTI_CPU" in proc.stderr

    for key in ("loss", "eval_loss"):
        got, want = rows(ddp, key), rows(single, key)
        assert sorted(got) == sorted(want) and got
        for s in want:
            assert got[s][key] == pytest.approx(want[s][key], rel=1e-5, abs=1e-5), f"{key} at step {s}"
            if key == "loss":
                assert got[s]["lr"] == pytest.approx(want[s]["lr"], rel=1e-9), f"lr at step {s}"
    assert len(rows(single, "loss")) == STEPS
    a, b = weights(ddp), weights(single)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ONE_STEP / 10, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        beyond_fp32 = ~torch.isclose(a[k], b[k], atol=5e-5, rtol=1e-4)  # the other backends' tolerance
        assert beyond_fp32.float().mean() < 0.05, f"{k}: {int(beyond_fp32.sum())} elements apart"

    # the resume, in one process (in-process: no second launch), from its own step-3 checkpoint
    resumed = with_checkpoint_of(single, CKPT_AT, tmp_path / "resumed")
    assert train_inprocess(recipe, f"output_dir={resumed}", *SINGLE_OVERRIDES) == 0
    assert_identical_run(resumed, single, steps=range(CKPT_AT + 1, STEPS + 1))  # measured: bit for bit
