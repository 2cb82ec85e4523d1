"""training.export: merged models equal base+adapter, reload with plain transformers in a fresh process
and generate; a QLoRA adapter merges into the unquantised base; bad inputs exit 2 with a reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, TINY_ARCH, TOKENIZER, run_cli, train_inprocess
from training.export import main as export_main
from training.export import merge

PROMPT_IDS = torch.tensor([[1, 504, 3458, 282, 253, 1345, 30, 2, 198, 17, 16, 17, 20]])


def train_run(root, tiny_model_dir, method: dict | None, name: str, tokenizer: str = TOKENIZER):
    """A 4-step run: `method` on the tiny model, or (None) a full one from scratch over `tokenizer`."""
    recipe = {
        "output_dir": str(root / name),
        "seed": 0,
        "model": {"name_or_path": str(tiny_model_dir)}
        if method
        else {"tokenizer": tokenizer, "from_scratch": dict(TINY_ARCH)},
        "data": {
            "train": str(ROOT / "data/tiny_stories.txt"),
            "format": "text",
            "max_length": 32,
            "max_examples": 100,
        },
        "method": method or {"type": "full"},
        "train": {"lr": 2e-2, "batch_size": 4, "max_steps": 4, "warmup_steps": 0},
        "eval": {"at_start": False},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert train_inprocess(path) == 0
    return root / name


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    return train_run(
        tmp_path_factory.mktemp("export"),
        tiny_model_dir,
        {"type": "lora", "lora": {"r": 8, "dropout": 0.0}},
        "lora",
    )


def adapter_logits(base_dir, adapter_dir, ids=PROMPT_IDS) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), str(adapter_dir)
    )
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def model_logits(model_dir, ids=PROMPT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir).eval()(input_ids=ids).logits


def test_merge_cli_writes_plain_model_with_base_plus_adapter_logits(lora_run, tiny_model_dir):
    result = run_cli("training.export", lora_run, "--merge")
    assert result.returncode == 0, result.stderr
    assert "max |logit difference| merged vs base+adapter" in result.stdout
    merged = lora_run / "merged"
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())

    expected = adapter_logits(tiny_model_dir, lora_run / "final")
    got = model_logits(merged)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(
        got, model_logits(tiny_model_dir), atol=1e-3
    )  # the adapter did change the model


def test_adapter_and_merged_exports_reload_and_generate_in_a_fresh_process(lora_run):
    merged = lora_run / "merged"
    if not merged.is_dir():
        assert export_main([str(lora_run), "--merge"]) == 0
    script = f"""
import json, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer
ids = torch.tensor({PROMPT_IDS.tolist()})
out = {{}}
for name, load in [("adapter", lambda: AutoPeftModelForCausalLM.from_pretrained({str(lora_run / "final")!r})),
                   ("merged", lambda: AutoModelForCausalLM.from_pretrained({str(merged)!r}))]:
    model = load().eval()
    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    out[name] = gen[0, ids.shape[1]:].tolist()
tok = AutoTokenizer.from_pretrained({str(merged)!r})
out["text"] = tok.decode(out["merged"])
print("RESULT " + json.dumps(out))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.split("RESULT ", 1)[1])
    assert len(out["adapter"]) == 8 and out["adapter"] == out["merged"]
    assert isinstance(out["text"], str) and out["text"]


def test_qlora_adapter_merges_into_the_unquantised_base(tmp_path, tiny_model_dir):
    run = train_run(tmp_path, tiny_model_dir, {"type": "qlora", "lora": {"r": 8, "dropout": 0.0}}, "qlora")
    assert export_main([str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = tmp_path / "merged"
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # merged = the fp32 (unquantised) base + the adapter trained against the 4-bit base
    torch.testing.assert_close(
        model_logits(merged), adapter_logits(tiny_model_dir, run / "final"), atol=1e-5, rtol=1e-5
    )


def test_dora_and_modules_to_save_adapters_merge_exactly(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        use_dora=True,
        use_rslora=True,
        modules_to_save=["embed_tokens", "lm_head"],
        ensure_weight_tying=True,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    with torch.no_grad():  # stand-in for training: make every adapter tensor non-trivial
        for _name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter)
    diff = merge(adapter, tmp_path / "merged", torch.float32, str(tiny_model_dir))
    assert diff < 1e-4
    torch.testing.assert_close(
        model_logits(tmp_path / "merged"), adapter_logits(tiny_model_dir, adapter), atol=1e-4, rtol=1e-4
    )


def test_export_refuses_bad_inputs_with_exit_code_2(tmp_path, tiny_model_dir, lora_run, capsys):
    full = train_run(tmp_path, tiny_model_dir, None, "full")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("mine")
    cases = [
        (
            [str(full), "--merge"],
            "holds a full model (method.type=full), not an adapter: there is nothing to merge",
        ),
        ([str(tmp_path / "missing"), "--merge"], "no such run or adapter directory"),
        ([str(lora_run)], "already is the adapter export; pass --merge"),
        (
            [str(lora_run), "--merge", "--out", str(tmp_path / "notes")],
            "exists and does not hold an earlier export",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            export_main(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    assert (tmp_path / "notes" / "x.txt").read_text() == "mine"
    # without --merge, --out copies the adapter as it is
    assert export_main([str(lora_run), "--out", str(tmp_path / "copy")]) == 0
    assert (tmp_path / "copy" / "adapter_config.json").is_file()
