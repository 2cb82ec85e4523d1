"""The training core end to end on tiny models: pinned losses, learning, accumulation, masks, exports."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TOKENIZER, run_cli, train_inprocess
from training.config import ModelSection
from training.core.batch import IGNORE
from training.data.tokenize import tokenize_chat
from training.data.tokenizer import load_tokenizer
from training.run.metrics import read_metrics


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


# Regression pin: a tiny seeded from-scratch run. If this changes, something in data order, init,
# loss normalisation, optimizer or schedule changed: check that it was meant to before updating.
# Re-pinned 2026-11-22 when from-scratch models started being initialised by transformers' own
# module-by-module init alone (constructors no longer draw from the seed first), the replayable stream
# that lets FSDP initialise only each rank's shard and still start from one process's weights.
# Re-pinned 2026-12-02 when the tiny models' tokenizer became SmolLM2's cut to the 3,749 tokens data/ uses
# (tests/small_vocab.py): the same tokens, a smaller head (step 1 starts near ln 3749 = 8.23, not ln 49152).
PINNED = [8.242, 8.2191, 8.03084, 7.79926, 7.55984]  # step 1 has lr 0 (warmup starts at 0)


def test_pinned_loss_values_for_a_tiny_seeded_run(make_recipe, tmp_path):
    recipe = make_recipe(
        train={
            "max_steps": 5,
            "batch_size": 2,
            "grad_accum": 2,
            "lr": 3e-3,
            "warmup_steps": 2,
            "scheduler": "cosine",
        }
    )
    assert train_inprocess(recipe) == 0
    got = losses(tmp_path / "run")
    assert got == pytest.approx(PINNED, abs=2e-4), [round(x, 5) for x in got]


def test_accumulation_equals_a_bigger_batch(make_recipe, tmp_path):
    a = make_recipe(
        "a.yaml", output_dir=str(tmp_path / "a"), train={"batch_size": 2, "grad_accum": 2, "max_steps": 4}
    )
    b = make_recipe(
        "b.yaml", output_dir=str(tmp_path / "b"), train={"batch_size": 4, "grad_accum": 1, "max_steps": 4}
    )
    assert train_inprocess(a) == 0 and train_inprocess(b) == 0
    assert losses(tmp_path / "a") == pytest.approx(losses(tmp_path / "b"), rel=1e-5)
    wa, wb = (
        load_file(tmp_path / "a/final/model.safetensors"),
        load_file(tmp_path / "b/final/model.safetensors"),
    )
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_pretraining_from_scratch_learns(make_recipe, tmp_path):
    """The held-out loss halves within 30 steps: 8.24 (about ln 3749, the vocabulary's size: a model that knows
    nothing), 3.81 at step 15 and 3.70 at step 30 (2026-12-02). The 60 steps this test once ran added nothing to
    the claim but time."""
    recipe = make_recipe(
        data={"max_examples": 600, "eval_fraction": 0.1, "max_length": 64},
        train={"max_steps": 30, "batch_size": 8, "lr": 1e-2, "warmup_steps": 5},
        eval={"at_start": True, "every_steps": 15},
    )
    assert train_inprocess(recipe) == 0
    evals = [r["eval_loss"] for r in read_metrics(tmp_path / "run/metrics.jsonl") if "eval_loss" in r]
    assert len(evals) == 3
    assert evals[0] > 8 and evals[-1] < 0.5 * evals[0], evals


def test_chat_labels_cover_only_assistant_turns(tokenizer):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ]
    enc = tokenize_chat(msgs, tokenizer, max_length=512)
    labelled = [t for t, lab in zip(enc["input_ids"], enc["labels"]) if lab != IGNORE]
    assert tokenizer.decode(labelled) == "Hello!<|im_end|>\nSee you.<|im_end|>\n"
    assert tokenizer.decode(enc["input_ids"]).startswith("<|im_start|>system\nBe brief.")


def test_instruction_format_trains_on_output_only(tokenizer):
    from training.data.formats import instruction_to_messages

    msgs = instruction_to_messages({"instruction": "Add", "input": "2 3", "output": "5"}, system_prompt=None)
    enc = tokenize_chat(msgs, tokenizer, max_length=512)
    labelled = [t for t, lab in zip(enc["input_ids"], enc["labels"]) if lab != IGNORE]
    assert tokenizer.decode(labelled) == "5<|im_end|>\n"
    assert "Add\n\n2 3" in tokenizer.decode(enc["input_ids"])


LOAD_AND_GENERATE = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    final = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(final)
    if sys.argv[2] == "adapter":
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained(final)
    else:
        model = AutoModelForCausalLM.from_pretrained(final)
    ids = tok.apply_chat_template([{"role": "user", "content": "Sort: b a"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 5, out.shape
    print("OK", type(model).__name__)
    """
)


def test_lora_final_loads_in_a_fresh_process_with_plain_peft(make_recipe, tmp_path, tiny_model_dir):
    recipe = make_recipe(
        model={"name_or_path": str(tiny_model_dir)},
        method={"type": "lora", "lora": {"r": 4, "alpha": 8}},
        data={"train": str(ROOT / "data/alpaca_tiny.jsonl"), "format": "instruction", "max_length": 64},
        train={"max_steps": 3, "lr": 1e-2},
        checkpoint={"every_steps": 2},
    )
    assert train_inprocess(recipe) == 0
    final = tmp_path / "run/final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    script = tmp_path / "load.py"
    script.write_text(LOAD_AND_GENERATE)
    proc = subprocess.run(
        [sys.executable, str(script), str(final), "adapter"], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK PeftModelForCausalLM" in proc.stdout

    # the chat CLI resolves run dir -> final (base + adapter) and a checkpoint -> rebuilt model
    for source in (tmp_path / "run", tmp_path / "run/checkpoints/step-2"):
        out = run_cli("training.chat", source, "--prompt", "hello", "--max-new-tokens", "4")
        assert out.returncode == 0, out.stderr[-3000:]


def test_full_final_is_a_plain_transformers_model(make_recipe, tmp_path):
    assert train_inprocess(make_recipe(train={"max_steps": 2})) == 0
    script = tmp_path / "load.py"
    script.write_text(LOAD_AND_GENERATE)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run/final"), "full"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK LlamaForCausalLM" in proc.stdout
    cfg = json.loads((tmp_path / "run/final/config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["use_cache"] is True
    assert math.isfinite(losses(tmp_path / "run")[-1])
    out = run_cli(
        "training.chat", tmp_path / "run", "--raw", "--prompt", "Once upon a time", "--max-new-tokens", "3"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("Once upon a time") and len(out.stdout) > len("Once upon a time\n")
