"""`precision: auto`: bf16 where the hardware computes it natively (a bf16 GPU, a CPU with AVX512-BF16/AMX),
fp32 elsewhere; resolved by whoever knows the machine (training.config.resolve_precision with
training.core.machine.auto_precision for this one), never by the schema. The CPU and GPU are mocked both
ways, so these tests pass on any machine."""

import pytest
import torch

import training.core.machine as precision
from conftest import ROOT
from training.config import parse_recipe, resolve_precision
from training.core.errors import RecipeError

RAW = {"output_dir": "/tmp/unused", "model": {"name_or_path": "some/model"}, "data": {"train": "d.jsonl"}}


@pytest.fixture
def machine(monkeypatch):
    """machine(cuda=None | 'bf16' | 'no-bf16', cpu_flags=...): what auto_precision sees."""
    monkeypatch.delenv("LLM_FORGE_PRECISION_AUTO", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)

    def _set(cuda=None, cpu_flags=()):
        monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(cpu_flags))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda is not None)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda == "bf16")
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")

    return _set


@pytest.mark.parametrize(
    "cuda, flags, expected, why",
    [
        (None, ("avx512f", "avx512_bf16"), "bf16", "natively"),
        (None, ("amx_bf16",), "bf16", "natively"),
        (None, ("avx512f", "avx2"), "no", "no native bf16"),
        (None, (), "no", "no native bf16"),
        ("bf16", (), "bf16", "Test GPU supports bf16"),
        ("no-bf16", ("avx512_bf16",), "no", "Test GPU has no bf16"),
    ],
)
def test_auto_resolves_by_the_hardware(machine, cuda, flags, expected, why):
    machine(cuda, flags)
    assert parse_recipe(RAW).precision == "auto"  # the schema probes nothing
    recipe = on_this_machine(parse_recipe(RAW))  # auto is the default
    assert recipe.precision == expected
    assert recipe._precision_auto.startswith(f"precision: auto -> {expected} (")
    assert why in recipe._precision_auto
    assert on_this_machine(parse_recipe({**RAW, "precision": "auto"})).precision == expected


def test_explicit_precision_is_kept_and_the_override_fixes_auto(machine, monkeypatch):
    machine(None, ("avx512_bf16",))
    for value in ("no", "bf16", "fp16"):
        recipe = on_this_machine(parse_recipe({**RAW, "precision": value}))
        assert recipe.precision == value and recipe._precision_auto is None
    monkeypatch.setenv("LLM_FORGE_PRECISION_AUTO", "no")  # what tests/conftest.py sets for the suite
    assert on_this_machine(parse_recipe(RAW)).precision == "no"


def test_resolving_auto_runs_the_recipe_rules_again(machine):
    machine(None, ())  # no native bf16: auto -> no, which flash attention in fp32 weights cannot use
    raw = {**RAW, "model": {"name_or_path": "some/model", "attn_implementation": "flash_attention_2"}}
    recipe = parse_recipe(raw)  # fine while auto could still mean bf16
    with pytest.raises(RecipeError, match="flash_attention_2 needs half precision"):
        on_this_machine(recipe)


def on_this_machine(recipe):
    return resolve_precision(recipe, *precision.auto_precision())


def test_cpu_flags_come_from_proc_cpuinfo(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\n")
    monkeypatch.setattr(precision, "Path", lambda _: info)
    precision.cpu_flags.cache_clear()
    try:
        assert "avx512_bf16" in precision.cpu_flags() and precision.cpu_has_native_bf16()
    finally:
        precision.cpu_flags.cache_clear()


@pytest.mark.parametrize(
    "setting, device, native, warns",
    [
        ("precision=bf16", "cpu", False, True),  # forced bf16 where the CPU emulates it
        ("method.quantization.compute_dtype=bfloat16", "cpu", False, True),  # QLoRA's matmuls named bf16
        ("precision=bf16", "cpu", True, False),  # AVX512-BF16 / AMX
        ("precision=bf16", "cuda", False, False),
        (None, "cpu", False, False),
    ],
)
def test_forcing_bf16_on_a_cpu_without_native_bf16_warns(setting, device, native, warns):
    warning = precision.emulated_bf16_warning(setting, device, native)
    assert (warning is not None) == warns
    if warns:
        key = setting.split("=")[0]
        assert warning.startswith(setting) and "no AVX512-BF16/AMX" in warning
        assert f"{key}: auto picks fp32" in warning


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (['precision="bf16"'], "precision=bf16"),
        (
            ['precision="no"', "method.quantization.compute_dtype=bfloat16"],
            "method.quantization.compute_dtype=bfloat16",
        ),
        (['precision="no"'], None),  # compute_dtype auto: float32
        (['precision="no"', "method.type=lora"], None),
    ],
)
def test_the_setting_that_forces_bf16_is_named(overrides, setting):
    from training.config import load_recipe
    from training.loop.setup import forced_bf16

    assert forced_bf16(load_recipe(ROOT / "training/recipes/qlora.yaml", overrides)) == setting
