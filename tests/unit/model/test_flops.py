"""FLOPs per token, the GPU peak table, MFU, and the speed options (metrics row, Liger refusal, compile)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from conftest import train_inprocess
from training.model import speed as flops


def test_flops_per_token_equals_hand_computed_value():
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100
    )
    # per layer: q,k,v,o 4*64*64 = 16384 + MLP 3*64*128 = 24576 -> 40960; x2 layers + LM head 64*100 = 88320 weights
    assert flops.matmul_params(cfg) == 88320
    # attention at seq 32: 2 layers * 2 matmuls * 2 FLOPs * 32 * 64 = 16384; forward = 2*88320 + 16384
    assert flops.forward_flops_per_token(cfg, 32) == 193024
    assert flops.training_flops_per_token(cfg, 32) == 3 * 193024
    # LoRA: frozen weights cost forward + input gradient (4 FLOPs each), adapters 6, attention 3x
    assert (
        flops.training_flops_per_token(cfg, 32, trainable_matmul_params=0, extra_trainable_params=1000)
        == 4 * 88320 + 3 * 16384 + 6000
    )


def test_grouped_query_attention_counts_smaller_kv_projections():
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=10,
    )
    # q,o 64*64 each; k,v 64*16 each (one kv head of dim 16); MLP 3*64*128; head 64*10
    assert flops.matmul_params(cfg) == 2 * 4096 + 2 * 1024 + 24576 + 640


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("Tesla T4", "T4"),
        ("Some Future GPU", None),
    ],
)
def test_gpu_names_map_to_the_peak_table(name, key):
    assert flops.gpu_key(name) == key


def test_mfu_is_none_on_cpu_and_a_ratio_with_a_peak():
    assert flops.peak_flops(torch.device("cpu"), "bf16") is None
    assert flops.mfu(1000.0, 1e9, None) is None
    assert flops.mfu(1000.0, 1e9, 1e13, num_devices=2) == pytest.approx(0.05)


def test_metrics_row_has_mfu_and_speed_report_once(make_recipe, tmp_path):
    assert train_inprocess(make_recipe(train={"max_steps": 2, "batch_size": 2})) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert all("mfu" in r and r["mfu"] is None for r in train_rows)  # CPU: no peak, no MFU
    assert all(r["tokens_per_s"] > 0 for r in train_rows)
    assert train_rows[0]["attn_implementation"] == "sdpa" and train_rows[0]["torch_compile"] is False
    assert train_rows[0]["flops_per_token"] > 0
    assert train_rows[0]["loss_impl"].startswith(
        "chunked (output head in chunks"
    )  # training.objectives.next_token's choice
    assert "attn_implementation" not in train_rows[1]


def test_liger_kernels_refused_on_cpu_with_exit_2(make_recipe, capsys):
    with pytest.raises(SystemExit) as e:
        train_inprocess(make_recipe(model={"liger_kernels": True}))
    assert e.value.code == 2
    assert "model.liger_kernels" in capsys.readouterr().err


def test_torch_compile_compiles_the_forward_in_place(make_recipe):
    from training.config import load_recipe
    from training.data.tokenizer import load_tokenizer
    from training.model.build import build_model

    recipe = load_recipe(make_recipe(train={"torch_compile": True}))
    model = build_model(recipe, load_tokenizer(recipe.model), torch.device("cpu"))
    assert model._compiled_call_impl is not None  # compiled lazily on the first call
    assert not any(k.startswith("_orig_mod") for k in model.state_dict())  # checkpoints/exports unchanged
