"""The accelerate config files, read by accelerate's own launcher code (no processes started): each
asks for the backend its name says, the DeepSpeed JSONs leave batch/accumulation/clipping/precision
to the recipe, FSDP builds an FSDP2 plugin that fully shards one unit per transformer layer. Plus
the launches refused before training (exit 2, with what to use instead), the backend rebuilt from
the launcher's environment (training/launch/backend.py) and the helpers in training/parallel/."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, patch_environment
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from conftest import ROOT, TINY_ARCH, train_inprocess
from launching import launch
from training.config import load_recipe
from training.core.batch import IGNORE
from training.launch.backend import launched_backend
from training.parallel.accelerator import fill_deepspeed_config, model_init_context
from training.parallel.mesh import Mesh
from training.parallel.state_dict import mask_repeated_rows, share_tied_tensors

CONFIGS = ROOT / "accelerate_configs"
EXPECTED = {  # file -> (accelerate distributed_type, ZeRO stage, optimizer offload, parameter offload)
    "single.yaml": ("NO", None, None, None),
    "ddp.yaml": ("MULTI_GPU", None, None, None),
    "multi_node.yaml": ("MULTI_GPU", None, None, None),
    "fsdp.yaml": ("FSDP", None, None, None),
    "fsdp_offload.yaml": ("FSDP", None, None, None),
    "zero1.yaml": ("DEEPSPEED", 1, "none", "none"),
    "zero2.yaml": ("DEEPSPEED", 2, "none", "none"),
    "zero2_offload.yaml": ("DEEPSPEED", 2, "cpu", "none"),
    "zero3.yaml": ("DEEPSPEED", 3, "none", "none"),
    "zero3_offload.yaml": ("DEEPSPEED", 3, "cpu", "cpu"),
    "tp.yaml": ("MULTI_GPU", None, None, None),
    "fsdp_tp.yaml": ("FSDP", None, None, None),
    "hsdp.yaml": ("FSDP", None, None, None),
    "pp.yaml": ("MULTI_GPU", None, None, None),
    "pp_dp.yaml": ("MULTI_GPU", None, None, None),
    "cp.yaml": ("FSDP", None, None, None),
    "sp_ulysses.yaml": ("DEEPSPEED", 2, "none", "none"),
    "ep.yaml": ("MULTI_GPU", None, None, None),
}
MESHES = {  # file -> (dp_replicate, dp_shard, tp) of its parallelism_config, = its num_processes multiplied
    "tp.yaml": (1, 1, 2),
    "fsdp_tp.yaml": (1, 2, 2),
    "hsdp.yaml": (2, 2, 1),
}
ACCELERATE_ENV = (
    "ACCELERATE_",
    "FSDP_",
    "PARALLELISM_CONFIG_",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "RANK",
    "MASTER_",
)


@pytest.fixture(autouse=True)
def clean_launch_env(monkeypatch):
    """No launcher variables leak in from the outside or between tests."""
    for key in list(os.environ):
        if key.startswith(ACCELERATE_ENV):
            monkeypatch.delenv(key)


def launcher(config: str, *flags: str):
    """What `accelerate launch --config_file accelerate_configs/<config> [flags] -m training.train r.yaml`
    decides: the parsed arguments and the environment the training processes would get."""
    args = launch_command_parser().parse_args(
        ["--config_file", str(CONFIGS / config), *flags, "-m", "training.train", "r.yaml"]
    )
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        env = dict(os.environ)
    return args, {k: v for k, v in env.items() if k.startswith(ACCELERATE_ENV)}


def test_every_backend_named_in_the_issue_has_a_config_file():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)
    assert sorted(p.name for p in CONFIGS.glob("*.json")) == sorted(
        f"ds_{n.removesuffix('.yaml')}.json"
        for n, e in EXPECTED.items()
        if e[0] == "DEEPSPEED" and n != "sp_ulysses.yaml"  # Ulysses reuses ds_zero2.json
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_and_asks_for_its_backend(name):
    cfg = load_config_from_file(str(CONFIGS / name))
    kind, stage, offload_opt, offload_param = EXPECTED[name]
    assert cfg.distributed_type.value == kind
    assert cfg.mixed_precision in (None, "no"), (
        "precision belongs to the recipe, not to the accelerate config"
    )
    if kind != "DEEPSPEED":
        return
    # The JSON it names leaves everything the recipe decides to the recipe ("auto").
    ds_file = ROOT / cfg.deepspeed_config["deepspeed_config_file"]
    ds = json.loads(ds_file.read_text())
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        assert ds[key] == "auto", f"{ds_file.name}: {key}"
    assert ds["bf16"]["enabled"] == ds["fp16"]["enabled"] == "auto"
    assert "optimizer" not in ds and "scheduler" not in ds  # the recipe's optimizer and schedule are used
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("offload_optimizer", {}).get("device", "none") == offload_opt
    assert zero.get("offload_param", {}).get("device", "none") == offload_param
    if stage == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # final/ can be exported
        assert cfg.deepspeed_config["zero3_init_flag"] is True


def test_ddp_and_single_launch_plain_torchrun_processes():
    args, env = launcher("ddp.yaml")
    assert args.multi_gpu and not args.use_deepspeed and not args.use_fsdp
    assert args.nproc_per_node == "2" and "ACCELERATE_USE_FSDP" not in env
    args, _ = launcher("ddp.yaml", "--num_processes", "8")
    assert args.nproc_per_node == "8"
    args, _ = launcher("single.yaml")
    assert not (args.multi_gpu or args.use_deepspeed or args.use_fsdp) and args.num_processes == 1


def test_multi_node_template_rendezvous_on_machine_0():
    args, _ = launcher("multi_node.yaml", "--machine_rank", "1", "--main_process_ip", "192.168.1.7")
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    assert args.rdzv_endpoint == "192.168.1.7:29500" and args.rdzv_backend == "static"


@pytest.mark.parametrize("name", sorted(MESHES))
def test_mesh_config_builds_accelerates_parallelism_config_on_its_processes(name):
    from accelerate.parallelism_config import ParallelismConfig

    args, env = launcher(name)
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    with patch_environment(**env):
        pc = ParallelismConfig()
        backend = launched_backend()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (*MESHES[name], 1)
    assert pc.total_size == args.num_processes == backend.mesh_size  # accelerate refuses any other count
    assert (backend.dp_replicate_size, backend.dp_shard_size, backend.tp_size) == MESHES[name]
    assert backend.dp_size == pc.data_parallel_size


@pytest.mark.parametrize("name,offload", [("fsdp.yaml", False), ("fsdp_offload.yaml", True)])
def test_fsdp_config_builds_a_fully_sharded_fsdp2_plugin_wrapping_each_decoder_layer(name, offload):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType
    from transformers import AutoModelForCausalLM, LlamaConfig

    args, env = launcher(name)
    assert args.use_fsdp and env["ACCELERATE_USE_FSDP"] == "true"
    with patch_environment(**env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # full shard
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == offload
    assert plugin.activation_checkpointing is False  # the recipe's model.gradient_checkpointing decides
    assert (
        plugin.cpu_ram_efficient_loading is True
    )  # rank 0 reads pretrained weights; new models init per shard
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_ARCH, vocab_size=128))
    wrap = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert all(wrap(layer) for layer in model.model.layers)
    assert (
        not wrap(model.model.embed_tokens) and not wrap(model.lm_head) and not wrap(model.model.layers[0].mlp)
    )


@pytest.mark.parametrize("name", [n for n, e in EXPECTED.items() if e[0] == "DEEPSPEED"])
def test_deepspeed_config_builds_its_plugin_and_the_recipe_fills_the_auto_values(name, make_recipe):
    kind, stage, offload_opt, offload_param = EXPECTED[name]
    args, env = launcher(name)
    assert args.use_deepspeed and env["ACCELERATE_USE_DEEPSPEED"] == "true"
    with patch_environment(**env):
        plugin = DeepSpeedPlugin()
    assert (plugin.zero_stage, plugin.offload_optimizer_device, plugin.offload_param_device) == (
        stage,
        offload_opt,
        offload_param,
    )
    assert plugin.zero3_init_flag == (stage == 3)
    recipe = load_recipe(make_recipe(train={"batch_size": 3, "grad_accum": 5, "max_grad_norm": 0.5}))
    fill_deepspeed_config(plugin.deepspeed_config, recipe)
    ds = plugin.deepspeed_config
    assert (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["gradient_clipping"],
    ) == (3, 5, 0.5)
    assert "train_batch_size" not in ds  # derived from the three above and the world size


def test_deepspeed_json_is_found_from_any_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    use_deepspeed(monkeypatch, "accelerate_configs/ds_zero2.json")
    assert launched_backend().deepspeed_file == CONFIGS / "ds_zero2.json"


# ----------------------------------------------------------------------------- refused before training


def refused(capsys, recipe, *overrides) -> str:
    with pytest.raises(SystemExit) as exc:
        train_inprocess(recipe, *overrides)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_mesh_launched_on_other_process_count_fails_fast_with_the_message(make_recipe, tmp_path):
    """The real command a user would type (tp.yaml on one process): refused in seconds, before any model
    or data is loaded, with the key and the fix."""
    proc = launch(  # forked from the worker's fork server, the launcher and its rank (tests/forked.py)
        "tp.yaml", make_recipe(), launcher_args=("--num_processes", "1"), timeout=300, check=False
    )
    assert proc.returncode != 0
    assert "error: the accelerate config: its mesh tp=2 (parallelism_config_" in proc.stderr
    assert "needs 2 processes but the launch has 1" in proc.stderr and "--num_processes 2" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_deepspeed_json_with_its_own_optimizer_is_refused_naming_file_and_key(
    make_recipe, monkeypatch, capsys, tmp_path
):
    ds = json.loads((CONFIGS / "ds_zero2.json").read_text())
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto"}}
    (tmp_path / "own.json").write_text(json.dumps(ds))
    use_deepspeed(monkeypatch, tmp_path / "own.json")
    err = refused(capsys, make_recipe())
    assert f"DeepSpeed config {tmp_path / 'own.json'}: remove its 'optimizer' block" in err
    assert "train.optimizer" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def use_deepspeed(monkeypatch, json_file: Path | str) -> None:
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(json_file))


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_32bit"])
def test_optimizer_that_deepspeed_offload_would_silently_replace_is_refused(
    make_recipe, monkeypatch, capsys, optimizer
):
    use_deepspeed(monkeypatch, "accelerate_configs/ds_zero2_offload.json")
    err = refused(capsys, make_recipe(), f"train.optimizer={optimizer}")
    assert f"train.optimizer={optimizer}" in err and "use train.optimizer=adamw" in err.lower()


def test_zero3_config_that_could_not_export_final_is_refused(make_recipe, monkeypatch, capsys, tmp_path):
    ds = json.loads((CONFIGS / "ds_zero3.json").read_text())
    ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    (tmp_path / "z3.json").write_text(json.dumps(ds))
    use_deepspeed(monkeypatch, tmp_path / "z3.json")
    err = refused(capsys, make_recipe())
    assert "stage3_gather_16bit_weights_on_model_save" in err and "ds_zero3.json" in err


def test_missing_deepspeed_json_is_named(make_recipe, monkeypatch, capsys):
    use_deepspeed(monkeypatch, "accelerate_configs/ds_zero9.json")
    err = refused(capsys, make_recipe())
    assert "deepspeed_config_file accelerate_configs/ds_zero9.json does not exist" in err


def test_skipping_nonfinite_steps_is_refused_under_deepspeed(make_recipe, monkeypatch, capsys):
    use_deepspeed(monkeypatch, "accelerate_configs/ds_zero2.json")
    err = refused(capsys, make_recipe(), "train.on_nonfinite=skip")
    assert "train.on_nonfinite=skip" in err and "use stop" in err


# ----------------------------------------------------------------------------- helpers


def fake_accelerator(rank: int, world: int, remainder: int, end: bool = True):
    state = SimpleNamespace(end_of_dataloader=end, remainder=remainder)
    return SimpleNamespace(
        num_processes=world, process_index=rank, gradient_state=state, parallelism_config=None
    )


def masked_rows(batch: dict, acc) -> dict:
    """mask_repeated_rows with the data-parallel mesh of `acc`'s plain data parallelism."""
    mesh = Mesh(acc.num_processes, acc.process_index, dp_rank=acc.process_index, dp_size=acc.num_processes)
    return mask_repeated_rows(batch, acc, mesh)


def test_samples_repeated_to_even_out_the_last_batch_are_masked():
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long)}
    # 2 ranks x batch 2, 3 real samples in the last global batch: rank 0 holds 2 real, rank 1 holds 1 real + 1 repeat.
    assert masked_rows(batch, fake_accelerator(0, 2, 3)) is batch
    masked = masked_rows(batch, fake_accelerator(1, 2, 3))
    assert masked["labels"][0].tolist() == [1, 1, 1, 1] and masked["labels"][1].tolist() == [IGNORE] * 4
    assert batch["labels"][1].tolist() == [1, 1, 1, 1]  # the loader's batch itself is untouched
    assert (masked_rows(batch, fake_accelerator(1, 2, 1))["labels"] == IGNORE).all()
    for acc in (fake_accelerator(1, 2, 3, end=False), fake_accelerator(1, 2, 0), fake_accelerator(0, 1, 1)):
        assert masked_rows(batch, acc) is batch


def test_gathered_copies_of_tied_weights_are_saved_once(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**TINY_ARCH, vocab_size=128, tie_word_embeddings=True)
    )
    gathered = {k: v.clone() for k, v in model.state_dict().items()}  # what DeepSpeed's gather returns
    state = share_tied_tensors(gathered, model)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    model.save_pretrained(tmp_path, state_dict=state)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert share_tied_tensors(None, model) is None


def test_from_scratch_models_are_built_outside_zero3_init(make_recipe, tiny_model_dir):
    from transformers.integrations import (
        HfDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})  # noqa: F841
    try:
        assert is_deepspeed_zero3_enabled()
        with model_init_context(load_recipe(make_recipe())):
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
        pretrained = load_recipe(make_recipe(model={"name_or_path": str(tiny_model_dir)}))
        with model_init_context(pretrained):
            assert is_deepspeed_zero3_enabled()  # big pretrained models still load partitioned
    finally:
        unset_hf_deepspeed_config()
