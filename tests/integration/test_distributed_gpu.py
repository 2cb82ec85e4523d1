"""FSDP2 and the mesh files on CUDA (skipped without it): bf16 full fine-tuning with a gathered full
state dict in final/, exact resume from a sharded checkpoint, the same start as a plain single-GPU run,
LoRA under FSDP with CPU offload exporting a plain peft adapter, and tp / fsdp_tp / hsdp training in
bf16. Uses up to 2 GPUs (4 for the 2-D meshes, skipped with fewer)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_ARCH, TOKENIZER
from launching import launch, rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs CUDA GPUs"),
]

GPUS = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
STEPS, CKPT_AT = 6, 3


@pytest.fixture
def recipe(make_recipe, tiny_model_dir):
    return make_recipe(
        model={"name_or_path": str(tiny_model_dir)},
        precision="bf16",
        train={"batch_size": 2, "max_steps": STEPS, "lr": 1e-3, "warmup_steps": 1},
        checkpoint={"every_steps": CKPT_AT, "keep_last": 5},
    )


def test_fsdp_bf16_exports_full_state_dict_and_resumes_exactly(recipe, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    n = ("--num_processes", str(GPUS))
    out = tmp_path / "fsdp"
    proc = launch("fsdp.yaml", recipe, f"output_dir={out}", launcher_args=n)
    assert f"{GPUS} process(es), FSDP" in proc.stderr
    losses = rows(out, "loss")
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS]["loss"] < losses[1]["loss"]

    # final/ is a complete, unsharded model that plain transformers loads, and it trained.
    before, after = (
        load_file(tiny_model_dir / "model.safetensors"),
        load_file(out / "final" / "model.safetensors"),
    )
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[k].float(), before[k].float()) for k in after)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters()
    )

    # The same first step as a plain one-GPU run of the same recipe (global batch 2 x GPUS).
    ref = tmp_path / "single"
    launch(
        "single.yaml",
        recipe,
        f"output_dir={ref}",
        f"train.batch_size={2 * GPUS}",
        "checkpoint.every_steps=null",
    )
    assert losses[1]["loss"] == pytest.approx(rows(ref, "loss")[1]["loss"], rel=1e-2)

    # Resume from the sharded step-3 checkpoint in a fresh run directory: steps 4..6 as before.
    resumed = tmp_path / "fsdp-resumed"
    shutil.copytree(out / "checkpoints" / f"step-{CKPT_AT}", resumed / "checkpoints" / f"step-{CKPT_AT}")
    launch("fsdp.yaml", recipe, f"output_dir={resumed}", launcher_args=n)
    again = rows(resumed, "loss")
    assert sorted(again) == list(range(CKPT_AT + 1, STEPS + 1))
    for s in again:
        assert again[s]["loss"] == pytest.approx(losses[s]["loss"], rel=2e-3), f"step {s}"
    a, b = load_file(resumed / "final" / "model.safetensors"), after
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=2e-3, rtol=2e-3)


def test_fsdp_offload_lora_exports_a_peft_adapter(recipe, tmp_path):
    from peft import PeftConfig

    out = tmp_path / "fsdp-lora"
    launch(
        "fsdp_offload.yaml",
        recipe,
        f"output_dir={out}",
        "method.type=lora",
        "checkpoint.every_steps=null",
        launcher_args=("--num_processes", str(GPUS)),
    )
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert PeftConfig.from_pretrained(out / "final").peft_type.value == "LORA"
    assert not (out / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("config, needed", [("tp.yaml", 2), ("fsdp_tp.yaml", 4), ("hsdp.yaml", 4)])
def test_mesh_configs_train_in_bf16_on_gpus(config, needed, recipe, tmp_path):
    """The mesh files on GPUs (NCCL), bf16: they train and export a plain final/ (CPU equality is in
    test_distributed.py)."""
    from transformers import AutoModelForCausalLM

    if torch.cuda.device_count() < needed:
        pytest.skip(f"{config} needs {needed} GPUs")
    out = tmp_path / config
    proc = launch(config, recipe, f"output_dir={out}")
    assert "mesh " in proc.stderr
    losses = rows(out, "loss")
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS]["loss"] < losses[1]["loss"]
    AutoModelForCausalLM.from_pretrained(out / "final")


@pytest.mark.parametrize("config", ["cp.yaml", "sp_ulysses.yaml"])
def test_sequence_parallel_on_two_gpus_equals_one_gpu(config, make_recipe, tmp_path):
    """Torch ring-attention context parallelism (refused on CPU) and DeepSpeed Ulysses on 2 GPUs: every
    sequence split over the pair, fp32, the same losses and final weights as one GPU seeing the whole
    sequences (CPU equality of Ulysses is in test_sequence_parallel.py)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"{config} splits sequences over 2 GPUs")
    recipe = make_recipe(
        model={"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH), "attn_implementation": "sdpa"},
        data={"max_length": 64},
        train={"batch_size": 2, "grad_accum": 2, "max_steps": 4, "lr": 1e-3, "warmup_steps": 1},
    )
    one, split = tmp_path / "one", tmp_path / config
    launch("single.yaml", recipe, f"output_dir={one}")
    proc = launch(config, recipe, f"output_dir={split}", launcher_args=("--num_processes", "2"))
    assert "mesh cp=2" in proc.stderr if config == "cp.yaml" else "DeepSpeed Ulysses sp=2" in proc.stderr
    got, want = rows(split, "loss"), rows(one, "loss")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for s in got:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-4), f"loss at step {s}"
        assert got[s]["tokens"] == want[s]["tokens"]
    a, b = load_file(split / "final" / "model.safetensors"), load_file(one / "final" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3, msg=lambda m, k=k: f"{k}: {m}")
