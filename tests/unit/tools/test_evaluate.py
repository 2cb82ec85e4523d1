"""python -m training.evaluate: lm-evaluation-harness on the bundled dates task scores exactly as
benchmarks/finetune_task.py does (same prompts, greedy answers, exact match), for a full model and for an
adapter in a run directory; results land in the run dir; bad input exits 2 naming it."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import SMOLLM2_TOKENIZER, run_cli, train_inprocess
from training import evaluate as cli
from training.core.errors import RecipeError
from training.evals import harness as ev
from training.run.rundir import RunDir

TASK = "dates_exact_match"
N = 6


@pytest.fixture(scope="module")
def manager():
    return ev.task_manager()  # indexing lm-eval's tasks takes seconds: once for the module


@pytest.fixture(autouse=True)
def shared_manager(monkeypatch, manager):
    monkeypatch.setattr(ev, "task_manager", lambda: manager)


def benchmark_answers(model, tokenizer) -> tuple[float, list[str]]:
    from benchmarks.finetune_task import exact_match, held_out

    score, samples = exact_match(model, tokenizer, held_out(N), batch_size=N, show=N)
    return score, [s["answer"] for s in samples]


def check_same(by_task: dict, score: float, answers: list[str]) -> None:
    got = by_task[TASK]
    assert got["n"] == N
    # exactly the benchmark's: same batch of N, same prompts, greedy; measured 6 of 6 identical answers
    # for the full model and the adapter, with AVX512 and with ATEN_CPU_CAPABILITY=avx2 kernels (the
    # answers themselves differ between the two kinds of CPU, the two scorers on one CPU never do)
    assert [s["answer"] for s in got["samples"]] == answers
    assert got["metrics"]["exact_match,none"] == score


@pytest.fixture(scope="module")
def smollm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.run.sources import pretrained_source

    src = pretrained_source(SMOLLM2_TOKENIZER)
    return (
        src,
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32),
        AutoTokenizer.from_pretrained(src),
    )


def test_full_model_matches_benchmark_scoring(smollm, tmp_path):
    src, model, tok = smollm
    out = tmp_path / "res.json"
    by_task = ev.evaluate(SMOLLM2_TOKENIZER, [TASK], limit=N, batch_size=N, out=out)
    check_same(by_task, *benchmark_answers(model, tok))
    assert json.loads(out.read_text())["tasks"][TASK]["metrics"] == by_task[TASK]["metrics"]


def test_adapter_run_matches_benchmark_scoring(smollm, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    src, model, tok = smollm
    _, base_answers = benchmark_answers(model, tok)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config.write_text(yaml.safe_dump({"output_dir": str(run.root)}))
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # a small update: answers change somewhat, not into noise
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    peft_model.save_pretrained(run.final)
    tok.save_pretrained(run.final)
    peft_model.unload()  # restore the shared base for the other tests

    by_task = ev.evaluate(run.root, [TASK], limit=N, batch_size=N)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    check_same(by_task, *benchmark_answers(PeftModel.from_pretrained(base, str(run.final)), tok))
    assert [s["answer"] for s in by_task[TASK]["samples"]] != base_answers  # the adapter was applied
    saved = json.loads(run.eval_results.read_text())["tasks"][TASK]
    assert saved["model"] == str(run.root) and saved["n"] == N and len(saved["samples"]) == N


def test_recipe_harness_tasks_run_after_training(make_recipe):
    recipe = make_recipe(eval={"at_start": False, "harness_tasks": TASK})
    assert train_inprocess(recipe) == 0
    run = RunDir(yaml.safe_load(recipe.read_text())["output_dir"])
    saved = json.loads(run.eval_results.read_text())["tasks"][TASK]
    assert saved["n"] == 200 and "exact_match,none" in saved["metrics"]


def test_unknown_task_refused_before_loading(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([str(tiny_model_dir), "--tasks", f"{TASK},no_such_task"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no_such_task" in err and TASK in err  # names the bad one and the bundled ones


def test_unknown_recipe_task_refused_before_training(make_recipe):
    from training.config import load_recipe

    with pytest.raises(RecipeError, match="eval.harness_tasks: .*no_such_task"):
        ev.check_harness_tasks(load_recipe(make_recipe(eval={"harness_tasks": ["no_such_task"]})))


def test_missing_run_exits_2(tmp_path):
    missing = tmp_path / "nope"
    proc = run_cli("training.evaluate", missing, "--tasks", TASK)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr
