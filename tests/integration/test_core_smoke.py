import json

from conftest import train_inprocess


def test_tiny_pretraining_run_writes_run_directory(make_recipe, tmp_path):
    recipe = make_recipe(eval={"at_start": True}, data={"eval_fraction": 0.1}, checkpoint={"every_steps": 3})
    assert train_inprocess(recipe) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    for key in ("lr", "grad_norm", "tokens_per_s", "elapsed_s", "peak_mem_gb"):
        assert key in train_rows[0]
    assert (run / "final" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step-6" / "COMPLETE").is_file()
    assert (run / "loss.png").stat().st_size > 1000
