"""FLOPs per token and per batch (real lengths), the GPU peak table, the CPU's measured matmul ceiling, MFU,
and the speed options (metrics row, Liger refusal, compile)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time

import pytest
import torch
from transformers import LlamaConfig

from conftest import train_inprocess
from training.core.batch import IGNORE
from training.data.loader import Collator, PackedCollator
from training.data.packing import pack_dataset
from training.model import matmul_ceiling
from training.model import speed as flops
from training.model.speed import SpeedReport

HAND = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)


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
        flops.training_flops_per_token(cfg, 32, frozen_base=True, adapter_params=1000)
        == 4 * 88320 + 3 * 16384 + 6000
    )
    # split by what each part scales with: body per real token, head per logits position, attention per L^2
    unit = flops.training_flops(cfg)
    assert (unit.token, unit.head, unit.attention) == (6 * 81920, 6 * 6400, 3 * 2 * 2 * 2 * 64)


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


def test_mfu_is_a_ratio_to_the_peak_of_all_devices():
    assert flops.peak_flops(torch.device("cpu"), "bf16") is None  # the table is for GPUs; a CPU is measured
    assert flops.mfu(1e12, None) is None  # an unlisted GPU
    assert flops.mfu(1e12, 1e13, num_devices=2) == pytest.approx(0.05)


def report(head_labelled_only: bool) -> flops.SpeedReport:
    unit = flops.training_flops(LlamaConfig(**HAND))
    return flops.SpeedReport(
        "sdpa", False, False, unit.per_token(32), 1e11, 1, None, None, unit, head_labelled_only
    )


def example(n: int, start: int) -> dict:
    ids = list(range(start, start + n))
    return {"input_ids": ids, "labels": ids}


def test_a_packed_batch_counts_each_document_at_its_own_length():
    import datasets

    ds = datasets.Dataset.from_list([example(5, 1), example(3, 10), example(8, 20)])
    rows = pack_dataset(ds, max_length=20).to_list()
    assert len(rows) == 1  # documents of 5, 3 and 8 tokens in one row
    unit = flops.training_flops(LlamaConfig(**HAND))
    # 16 real tokens; attention over 5^2 + 3^2 + 8^2; 13 labelled positions (each document's first has none)
    chunked = unit.token * 16 + unit.head * 13 + unit.attention * (25 + 9 + 64)
    whole_logits = unit.token * 16 + unit.head * 16 + unit.attention * (25 + 9 + 64)
    padded = PackedCollator(pad_token_id=0)(rows * 2)  # two rows for sdpa, padded as to a longer row:
    fill = {"input_ids": 0, "labels": IGNORE, "position_ids": 0}
    padded = {k: torch.nn.functional.pad(v, (0, 4), value=fill[k]) for k, v in padded.items() if k in fill}
    flat = PackedCollator(pad_token_id=0, padding_free=True)(rows * 2)  # one row, varlen (cu_seq_lens)
    assert "cu_seq_lens_q" in flat and "attention_mask" not in padded  # the two shapes packed rows take
    for batch in (padded, flat):
        assert int(report(True).batch_flops(batch)) == 2 * chunked
        assert int(report(False).batch_flops(batch)) == 2 * whole_logits
    assert int(report(True).window_flops([padded, flat], torch.device("cpu"))) == 4 * chunked


def test_a_padded_batch_counts_real_lengths_not_the_padded_one():
    batch = Collator(pad_token_id=0)([example(5, 1), example(3, 10)])
    batch["labels"][0, :2] = IGNORE  # a prompt: its positions carry no loss
    assert batch["input_ids"].shape == (2, 5)
    unit = flops.training_flops(LlamaConfig(**HAND))
    labelled = (4 - 1) + 2  # next-token targets: each row's later labelled tokens
    expected = unit.token * 8 + unit.head * labelled + unit.attention * (25 + 9)
    assert int(report(True).batch_flops(batch)) == expected
    assert expected < 2 * 5 * unit.per_token(5)  # what counting the padded shape would say


def test_the_cpu_ceiling_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.delenv(matmul_ceiling.ENV, raising=False)
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul_ceiling, "busy", lambda: "")  # an idle machine, whatever runs beside the test
    monkeypatch.setattr(
        matmul_ceiling, "vector_bound", lambda *a: None
    )  # tiny shapes read far under the bound
    measured = []
    real = matmul_ceiling.measure
    monkeypatch.setattr(matmul_ceiling, "measure", lambda *a: measured.append(a) or real(*a))
    first = matmul_ceiling.matmul_ceiling([(16, 32)], 64, torch.float32, budget_s=0.03)
    assert math.isfinite(first.flops) and first.flops > 0 and len(measured) == 1
    assert "measured torch.mm ceiling" in first.description and "threads" in first.description
    again = matmul_ceiling.matmul_ceiling([(16, 32)], 64, torch.float32, budget_s=0.03)
    assert again.flops == first.flops and len(measured) == 1  # read from the cache
    (tmp_path / matmul_ceiling.CACHE_FILE).write_text("{not json")  # a corrupt file: measured, rewritten
    matmul_ceiling.matmul_ceiling([(16, 32)], 64, torch.float32, budget_s=0.03)
    assert len(measured) == 2 and json.loads((tmp_path / matmul_ceiling.CACHE_FILE).read_text())
    monkeypatch.setattr(matmul_ceiling, "busy", lambda: "load average 5.0 on 2 cores")
    busy = matmul_ceiling.matmul_ceiling([(16, 8)], 64, torch.float32, budget_s=0.03)  # a new shape
    assert len(measured) == 3 and "not cached" in busy.description  # a busy machine's figure is not kept
    matmul_ceiling.matmul_ceiling([(16, 8)], 64, torch.float32, budget_s=0.03)
    assert len(measured) == 4
    monkeypatch.setenv(matmul_ceiling.ENV, "2.5e11")  # fixed: nothing measured
    assert matmul_ceiling.matmul_ceiling([(16, 32)], 64, torch.float32).flops == 2.5e11
    assert len(measured) == 4


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_probe_on_a_busy_machine_never_makes_mfu_pass_100_percent(monkeypatch, tmp_path):
    """The machine kept busy by the test (a spinning process per core) while the ceiling is probed at
    SmolLM2's MLP shape: whatever the probe reads, cached or not, a step at 90% of what the vector units
    allow reports an MFU of at most 100% (or none), and a ceiling it proved too low is forgotten."""
    monkeypatch.delenv(matmul_ceiling.ENV, raising=False)
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    bound = matmul_ceiling.vector_bound(torch.float32)
    if bound is None:
        pytest.skip("this CPU's clock or vector units are not known (no /proc/cpuinfo clock)")
    fork = multiprocessing.get_context("fork")
    spinners = [fork.Process(target=spin, args=(20.0,)) for _ in range(os.cpu_count() or 1)]
    for s in spinners:
        s.start()
    try:
        time.sleep(0.5)
        ceiling = matmul_ceiling.matmul_ceiling([(576, 1536), (1536, 576)], 256, torch.float32, budget_s=0.2)
    finally:
        for s in spinners:
            s.kill()
    r = SpeedReport("sdpa", False, False, 1, ceiling.flops, 1, ceiling_key=ceiling.key, bound=bound)
    value = r.mfu(0.9 * bound)
    assert value is None or value <= 1, ceiling.description
    assert r.mfu(0.9 * bound) == value  # the same again: the figure does not drift back over
    path = tmp_path / matmul_ceiling.CACHE_FILE
    cached = json.loads(path.read_text()) if path.exists() else {}
    assert all(v["flops"] >= 0.9 * bound for v in cached.values())  # a figure the step outran is not kept


def test_mfu_falls_back_to_the_vector_bound_and_never_passes_it(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    path = tmp_path / matmul_ceiling.CACHE_FILE
    path.write_text(json.dumps({"k": {"flops": 1e9}, "other": {"flops": 2e11}}))
    r = SpeedReport("sdpa", False, False, 1, 1e9, 2, peak_source="cached", ceiling_key="k", bound=1e11)
    assert r.mfu(1e9) == pytest.approx(0.5)  # under the ceiling: as measured
    assert r.mfu(5e9) == pytest.approx(0.025)  # over it: against the bound, 5e9 / (2 x 1e11)
    assert r.peak_flops == 1e11 and "bound" in r.peak_source
    assert json.loads(path.read_text()) == {"other": {"flops": 2e11}}  # the disproved ceiling is forgotten
    assert r.mfu(4e11) is None and r.peak_flops is None  # past the bound too: MFU not reported
    assert r.mfu(1e9) is None


def test_a_disturbed_probe_is_not_used_a_quiet_one_is(monkeypatch, tmp_path):
    monkeypatch.delenv(matmul_ceiling.ENV, raising=False)
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul_ceiling, "busy", lambda: "")  # the load average shows nothing
    monkeypatch.setattr(matmul_ceiling, "vector_bound", lambda *a: 1e11)
    monkeypatch.setattr(matmul_ceiling, "measure", lambda *a: 6.8e7)  # 0.068 GFLOP/s: a disturbed probe
    c = matmul_ceiling.matmul_ceiling([(16, 32)], 64, torch.float32)
    assert c.flops == 1e11 and "not cached, not used" in c.description and "bound" in c.description
    assert not (tmp_path / matmul_ceiling.CACHE_FILE).exists()
    monkeypatch.setattr(matmul_ceiling, "measure", lambda *a: 5e10)  # a quiet probe at another shape: kept
    quiet = matmul_ceiling.matmul_ceiling([(16, 8)], 64, torch.float32)
    assert quiet.flops == 5e10 and "cached in" in quiet.description
    monkeypatch.setattr(matmul_ceiling, "measure", lambda *a: 6.8e7)
    again = matmul_ceiling.matmul_ceiling([(16, 32)], 64, torch.float32)  # disturbed again: the quiet figure
    assert again.flops == 5e10 and "a quiet measurement at" in again.description


def test_the_probe_shape_follows_the_run_and_shrinks_only_in_an_emulated_dtype(monkeypatch):
    shapes = [(576, 1536), (1536, 576)]  # SmolLM2-135M's MLP
    monkeypatch.setattr(matmul_ceiling, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert matmul_ceiling.probe_rows(300, shapes, torch.float32) == 300  # the run's tokens per micro-batch
    assert matmul_ceiling.probe_rows(8192, shapes, torch.float32) == 2**31 // (2 * 576 * 1536)  # 1213
    assert matmul_ceiling.probe_rows(8192, shapes, torch.bfloat16) == 2**26 // (2 * 576 * 1536)  # 37
    monkeypatch.setattr(matmul_ceiling, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert matmul_ceiling.probe_rows(8192, shapes, torch.bfloat16) == 1213


def test_metrics_row_has_mfu_and_speed_report_once(make_recipe, tmp_path):
    assert train_inprocess(make_recipe(train={"max_steps": 2, "batch_size": 2})) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert all(r["tokens_per_s"] > 0 for r in train_rows)
    first = train_rows[0]
    # CPU: MFU against the ceiling LLM_FORGE_CPU_PEAK_FLOPS fixes (tests/conftest.py) instead of a probe
    assert first["peak_flops"] == 1.7e11 and "LLM_FORGE_CPU_PEAK_FLOPS" in first["peak_source"]
    assert all(isinstance(r["mfu"], float) and 0 < r["mfu"] < 1 for r in train_rows)
    # the step's FLOPs per real token, from its batches: at least the body's, at most max_length's count
    for r in train_rows:
        per_token = r["mfu"] * 1.7e11 / r["tokens_per_s"]
        assert first["flops_per_token"] * 0.999 > per_token > first["flops_per_real_token"]
    assert first["attn_implementation"] == "sdpa" and first["torch_compile"] is False
    assert first["flops_per_token"] > 0
    assert first["loss_impl"].startswith(
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


@pytest.mark.parametrize(
    "compile_, device, warns", [(True, "cpu", True), (True, "cuda", False), (False, "cpu", False)]
)
def test_torch_compile_on_a_cpu_warns_with_what_it_measured(compile_, device, warns):
    warning = flops.cpu_compile_warning(compile_, device)
    assert (warning is not None) == warns
    if warns:
        assert "0.93-0.94x" in warning and "set it to false" in warning


@pytest.mark.parametrize(
    "device, threads, load, warns",
    [
        ("cpu", 2, "load average 4.7 on 2 cores", True),
        ("cpu", 1, "load average 4.7 on 2 cores", False),  # one thread: nothing to wait on
        ("cpu", 2, "", False),  # a quiet machine
        ("cuda", 8, "load average 4.7 on 2 cores", False),
    ],
)
def test_a_shared_cpu_with_several_threads_warns(device, threads, load, warns):
    warning = flops.cpu_sharing_warning(device, threads, load)
    assert (warning is not None) == warns
    if warns:
        assert (
            "load average 4.7 on 2 cores" in warning
            and "2 threads" in warning
            and "OMP_NUM_THREADS" in warning
        )


def test_the_sharing_warning_reads_the_machine_by_default(monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert "load average 64.0 on 2 cores" in flops.cpu_sharing_warning("cpu")
    monkeypatch.setattr("os.getloadavg", lambda: (0.5, 0.5, 0.5))
    assert flops.cpu_sharing_warning("cpu") is None


def test_the_loss_label_and_the_head_count_follow_the_objectives_logits():
    from types import SimpleNamespace

    from training.model.speed import head_on_labelled_only, loss_label
    from training.objectives.next_token import LossChoice

    chunked = LossChoice("chunked", "output head in chunks")
    sft = SimpleNamespace(preference=None, rl=None)
    assert loss_label(sft, chunked) == "chunked (output head in chunks)"
    assert head_on_labelled_only(sft, "chunked") and not head_on_labelled_only(sft, "full")
    for objective in (
        SimpleNamespace(preference=SimpleNamespace(objective="dpo"), rl=None),
        SimpleNamespace(preference=None, rl=object()),
    ):  # logits from the first scored token on (training.model.logits): the head counted there, whatever the loss
        assert loss_label(objective, chunked).startswith("the scored positions' logits")
        assert head_on_labelled_only(objective, "full")
    reward = SimpleNamespace(preference=SimpleNamespace(objective="reward"), rl=None)
    assert loss_label(reward, chunked).startswith("whole logits") and not head_on_labelled_only(
        reward, "chunked"
    )
    assert loss_label(sft, None) is None
