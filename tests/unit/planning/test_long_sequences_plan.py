"""The planner and the long-sequence switches: the tiled MLP takes the MLP intermediates out of every layer
but one tile, activation offloading moves the layers' saved tensors to the host (GPU plans; refused on CPU),
and `--max-length auto` answers the inverse question with each switch."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from training.config import parse_recipe
from training.plan import main
from training.planning.activations import activation_bytes, offloaded_bytes
from training.planning.inventory import inventory
from training.planning.longest import STEP, longest_lengths, search
from training.planning.memory import GiB, estimate

# a Llama-3-8B-like layer (width 4096, MLP 14336) with a small vocabulary, 4 layers: quick to count
CONFIG = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=8192,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-8b-layers")
    LlamaConfig(**CONFIG).save_pretrained(out)  # a config alone: the planner builds on the meta device
    return out


def recipe(model_dir, length=16384, **model):
    return parse_recipe(
        {
            "output_dir": "unused",
            "precision": "bf16",
            "model": {"name_or_path": str(model_dir), "dtype": "bfloat16", **model},
            "method": {"type": "lora", "lora": {"r": 16, "dropout": 0.0}},
            "data": {"train": ["unused.jsonl"], "max_length": length},
            "train": {"batch_size": 1},
        }
    )


def configs(tmp_path, *names):
    specs = {"single": {"distributed_type": "NO"}, "cpu": {"distributed_type": "NO", "use_cpu": True}}
    for n in names:
        (tmp_path / f"{n}.yaml").write_text(json.dumps({"num_machines": 1, "num_processes": 1, **specs[n]}))
    return tmp_path


def test_tiled_mlp_leaves_one_tiles_intermediates_in_the_plan(model_dir):
    plain = recipe(model_dir, gradient_checkpointing=True)
    tiled = recipe(model_dir, gradient_checkpointing=True, tiled_mlp=True)
    inv = inventory(plain)
    a, _ = activation_bytes(plain, inv, "half", True, "sdpa", chunked_loss=True)
    b, _ = activation_bytes(tiled, inv, "half", True, "sdpa", chunked_loss=True)
    tokens, f, h = 16384, 14336, 4096
    # untiled, the recomputed layer holds the whole sequence's intermediates (8 bytes per feature in bf16)
    # and their gradients (9); tiled, 4 tiles of 4096 tokens (ceil(16384 / hidden)) hold them in turn (the
    # layer's norms are tiled with them, so nothing of theirs grows with the sequence either)
    per_token = 8 * f + 9 * f + 2 * h
    assert a - b == pytest.approx(tokens * per_token - tokens / 4 * per_token, rel=1e-6)
    two = recipe(model_dir, gradient_checkpointing=True, tiled_mlp=2)  # a tile count: 2 tiles of 8192
    c, _ = activation_bytes(two, inv, "half", True, "sdpa", chunked_loss=True)
    assert a - c == pytest.approx(tokens / 2 * per_token, rel=1e-6)
    short = recipe(model_dir, length=4096, gradient_checkpointing=True, tiled_mlp=True)
    assert (
        activation_bytes(short, inv, "half", True, "sdpa", chunked_loss=True)[0]
        == activation_bytes(
            recipe(model_dir, length=4096, gradient_checkpointing=True),
            inv,
            "half",
            True,
            "sdpa",
            chunked_loss=True,
        )[0]
    )  # one tile (4096 tokens of width 4096): nothing changes


def test_offloading_moves_the_checkpointed_inputs_to_the_host_and_is_refused_on_cpu(model_dir, tmp_path):
    folder = configs(tmp_path, "single", "cpu")
    plain = {
        p.backend: p
        for p in estimate(recipe(model_dir, gradient_checkpointing=True), 1, 80, configs_dir=folder)
    }
    moved = {
        p.backend: p
        for p in estimate(
            recipe(model_dir, gradient_checkpointing=True, activation_offloading=True),
            1,
            80,
            configs_dir=folder,
        )
    }
    inputs = 16384 * 2 * 4096 * (4 - 2)  # every layer's bf16 input but the two in flight
    assert (plain["single"].activations_gib - moved["single"].activations_gib) * GiB == pytest.approx(inputs)
    assert (moved["single"].host_gib - plain["single"].host_gib) * GiB == pytest.approx(inputs)
    r = recipe(model_dir, gradient_checkpointing=True, activation_offloading=True)
    assert offloaded_bytes(r, inventory(r), "half", True, "sdpa") == inputs
    assert not moved["cpu"].fits and "there is nowhere to move them" in moved["cpu"].reason


def test_the_longest_max_length_grows_with_each_switch(model_dir, tmp_path):
    rows = {
        r.switches: r
        for r in longest_lengths(recipe(model_dir), 1, 40, configs_dir=configs(tmp_path, "single"))
    }
    none, ckpt = rows["none"].max_length, rows["gradient_checkpointing"].max_length
    tiled = rows["gradient_checkpointing + tiled_mlp"].max_length
    both = rows["gradient_checkpointing + tiled_mlp + activation_offloading"].max_length
    assert 0 < none < ckpt < tiled < both and all(r.max_length % STEP == 0 for r in rows.values())
    for name, switches in (
        ("gradient_checkpointing", {}),
        ("gradient_checkpointing + tiled_mlp", {"tiled_mlp": True}),
    ):
        at = estimate(
            recipe(model_dir, rows[name].max_length, gradient_checkpointing=True, **switches),
            1,
            40,
            configs_dir=tmp_path,
        )[0]
        past = estimate(
            recipe(model_dir, rows[name].max_length + STEP, gradient_checkpointing=True, **switches),
            1,
            40,
            configs_dir=tmp_path,
        )[0]
        assert at.fits and not past.fits  # the longest that fits, to the step
        assert rows[name].file.endswith("single.yaml") and rows[name].peak_gib == pytest.approx(
            at.peak_gib, abs=0.01
        )


def test_search_finds_the_largest_step_multiple_that_fits():
    assert search(lambda n: n <= 1000) == 768
    assert search(lambda n: n <= 100) == 0
    assert search(lambda n: True) == 1 << 21


def test_the_cli_prints_the_longest_lengths_and_the_models_context(model_dir, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        json.dumps(
            {
                "output_dir": "unused",
                "precision": "bf16",
                "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
                "method": {"type": "lora"},
                "data": {"train": ["unused.jsonl"]},
            }
        )
    )
    folder = configs(tmp_path, "single")
    assert main([str(path), "--max-length", "auto", "--gpu-memory", "40GiB", "--configs", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Longest data.max_length that fits 1 GPU(s) of 40 GiB" in out
    assert "| gradient_checkpointing + tiled_mlp | " in out and "| 1.0x |" in out
    assert "trained for 8,192 positions (max_position_embeddings): past that, set model.rope_scaling" in out
    assert main([str(path), "--max-length", "auto", "--json", "--configs", str(folder)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["switches"] for r in rows][:2] == ["none", "gradient_checkpointing"]
    with pytest.raises(SystemExit) as exit:
        main([str(path), "--max-length", "4096"])  # only auto: a length is data.max_length=4096
    assert exit.value.code == 2 and "--max-length: invalid choice: '4096'" in capsys.readouterr().err


def test_ulysses_on_fewer_gpus_than_its_sp_size_is_not_a_plan(tmp_path, model_dir):
    """sp_ulysses.yaml (sp_size 2) planned for one GPU was once the recommended plan, its activations halved."""
    (tmp_path / "sp.yaml").write_text(
        json.dumps(
            {
                "distributed_type": "DEEPSPEED",
                "num_machines": 1,
                "num_processes": 2,
                "deepspeed_config": {"zero_stage": 2},
                "parallelism_config": {
                    "parallelism_config_sp_backend": "deepspeed",
                    "parallelism_config_sp_size": 2,
                },
            }
        )
    )
    (plan,) = estimate(recipe(model_dir, gradient_checkpointing=True), 1, 80, configs_dir=tmp_path)
    assert not plan.fits and "does not divide the 1 processes of the launch" in plan.reason
    (two,) = estimate(recipe(model_dir, gradient_checkpointing=True), 2, 80, configs_dir=tmp_path)
    assert not two.reason.startswith("the accelerate config")
