"""Quantization-aware training (method.qat, torchao): a tiny model trains with its linear layers
fake-quantized; final/ is a float model that transformers loads quantized with TorchAoConfig of the same
scheme, and that quantized model computes exactly what the fake-quantized training forward computes (in a
fresh process, plain libraries); 2-process DDP equals one process up to the rounding QAT trains through,
and a SIGKILL-and-resume DDP run equals the uninterrupted one exactly; QAT with adapters and a group size
that does not divide a layer are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_inprocess
from launching import (
    SINGLE_OVERRIDES,
    STEPS,
    TWO_RANKS,
    assert_identical_run,
    kill_and_resume,
    launch,
    rows,
    weights,
    write_recipe,
)
from training.config import parse_recipe
from training.core.errors import RecipeError

QAT = {"scheme": "int8-int4", "group_size": 32}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("qat")


@pytest.fixture(scope="module")
def recipe(work):
    return write_recipe(work / "qat.yaml", work / "unused", method={"type": "full", "qat": QAT})


@pytest.fixture(scope="module")
def single(work, recipe):
    out = work / "single"
    assert train_inprocess(recipe, f"output_dir={out}", *SINGLE_OVERRIDES) == 0
    return out


SCORE = """
import sys, torch
from transformers import AutoModelForCausalLM, TorchAoConfig
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
from torchao.quantization.granularity import PerGroup
from torchao.quantization.qat import QATConfig
scheme = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
def loss(model):
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()
plain = AutoModelForCausalLM.from_pretrained(sys.argv[1])
float_loss = loss(plain)
head = plain.get_output_embeddings()
quantize_(plain, QATConfig(scheme, step="prepare"), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m is not head)
trained_forward = loss(plain)
config = TorchAoConfig(scheme, modules_to_not_convert=["lm_head"])
quantized = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=config)
kind = type(quantized.model.layers[0].mlp.down_proj.weight).__name__
print(float_loss, trained_forward, loss(quantized), kind)
"""


def test_final_loads_quantized_and_computes_what_training_computed(single):
    train = rows(single, "loss")
    assert train[6]["loss"] < train[1]["loss"]
    card = (single / "final" / "README.md").read_text()
    assert "quantization-aware training (torchao): int8-int4, groups of 32" in card
    assert "TorchAoConfig(Int8DynamicActivationIntxWeightConfig(" in card
    proc = subprocess.run(
        [sys.executable, "-c", SCORE, str(single / "final")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    float_loss, trained_forward, quantized, kind = proc.stdout.split()
    assert kind == "IntxUnpackedToInt8Tensor"  # quantized on load by transformers + torchao
    assert float(quantized) == pytest.approx(float(trained_forward), abs=1e-6)
    assert float(quantized) != pytest.approx(float(float_loss), abs=1e-6)  # it is not the float model


@pytest.fixture(scope="module")
def ddp(work, recipe):
    out = work / "ddp"
    proc = launch("ddp.yaml", recipe, f"output_dir={out}", *TWO_RANKS)
    assert "QAT: 14 linear layers fake-quantized (int8-int4, groups of 32)" in proc.stderr
    return out


@pytest.mark.slow
def test_ddp_equals_one_process_up_to_the_rounding_it_trains_through(ddp, single):
    """Quantization rounds: where DDP's all-reduce sums in another order than one process (a 1e-7
    difference), a weight can land on the other side of a rounding boundary, so from step 4 on the runs
    differ by ~1e-4 (fp32 full training without QAT agrees to 1e-5: tests/integration/test_distributed.py).
    Same steps and learning rates; losses and final weights within that."""
    got, want = rows(ddp, "loss"), rows(single, "loss")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-3), step
        assert got[step]["lr"] == pytest.approx(want[step]["lr"], rel=1e-9)
    a, b = weights(ddp), weights(single)
    assert a.keys() == b.keys()
    before = load_file(single / "checkpoints" / "step-3" / "model.safetensors")  # step 3: still equal
    apart = sum((a[k] - b[k]).pow(2).sum() for k in a).sqrt()
    moved = sum((b[k] - before[k]).pow(2).sum() for k in before).sqrt()
    assert apart < 0.05 * moved  # the runs part by under 5% of how far steps 4-6 moved the weights


@pytest.mark.slow
def test_kill_and_resume_is_exact(work, recipe, ddp):
    """SIGKILL in step 5 and resume from step 3: the same run as the uninterrupted DDP one (nothing of QAT
    lives outside the weights and the optimizer: its quantizers compute their scales in each forward)."""
    out = work / "killed"
    kill_and_resume("ddp.yaml", recipe, out, *TWO_RANKS)
    assert_identical_run(out, ddp)  # measured: equal losses and torch.equal weights


def test_qat_with_adapters_or_an_odd_group_size_is_refused(work, tmp_path, capsys):
    base = {"output_dir": "/tmp/x", "model": {"name_or_path": "m"}, "data": {"train": "d.jsonl"}}
    with pytest.raises(RecipeError, match="method.qat with method.type=lora: QAT fake-quantizes the weights"):
        parse_recipe({**base, "method": {"type": "lora", "qat": QAT}})
    bad = write_recipe(tmp_path / "bad.yaml", tmp_path / "run", method={"qat": {"group_size": 48}})
    with pytest.raises(SystemExit) as e:
        train_inprocess(bad)
    assert e.value.code == 2
    assert "method.qat.group_size: 48 does not divide" in capsys.readouterr().err


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(fp8_gpu(), reason="this machine has an FP8 GPU: the refusal does not apply")
def test_float8_training_is_refused_without_an_fp8_gpu(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "fp8.yaml", tmp_path / "run", method={"qat": {"scheme": "float8"}})
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "method.qat.scheme float8: FP8 training needs a CUDA GPU with FP8 tensor cores" in err


def test_float8_conversion_makes_every_linear_but_the_head_a_float8_linear(tiny_model_dir):
    """What FP8 training runs on a GPU, checked for its modules here (torchao emulates FP8 on a CPU)."""
    from transformers import AutoModelForCausalLM

    from training.model.qat import convert_float8

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - 1  # the head stays
    assert convert_float8(model) == linears
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("q_proj", "down_proj"))}
    assert kinds == {"Float8Linear"} and type(model.get_output_embeddings()).__name__ == "Linear"
    ids = torch.randint(0, 500, (2, 16))
    assert torch.isfinite(model(ids, labels=ids).loss)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="FP8 training needs a CUDA GPU with FP8 tensor cores (sm_89+)")
def test_float8_training_on_an_fp8_gpu_learns(tmp_path):
    recipe = write_recipe(
        tmp_path / "fp8.yaml",
        tmp_path / "run",
        precision="bf16",
        method={"qat": {"scheme": "float8"}},
        train={"max_steps": 12},
    )
    assert train_inprocess(recipe) == 0
    train = rows(tmp_path / "run", "loss")
    assert train[12]["loss"] < train[1]["loss"]
    assert "FP8 training (torchao float8" in (tmp_path / "run" / "final" / "README.md").read_text()
