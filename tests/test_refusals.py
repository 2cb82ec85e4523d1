"""One list of what cannot run where (training.backends.refusal), tested from both sides.

Each refused (recipe, accelerate config, machine) combination is refused by the trainer's launch check
with the table's message AND shown by the planner, for that config, as not fitting for the same reason;
each accepted combination passes both. The trainer side gets the environment that `accelerate launch
--config_file FILE` gives the training processes, computed by accelerate's own launcher code (no
process starts; only WORLD_SIZE and LOCAL_WORLD_SIZE, which torchrun adds, are set by hand); the machine (CUDA or not) is torch.cuda.is_available() for the trainer and
--num-gpus 1 / 0 for the planner. No model is loaded: the planner sizes a tiny config on the meta device.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import (
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)
from transformers import LlamaConfig

from conftest import ROOT, TINY_ARCH, deep_update
from training.backends import RULES, launched_backend, read_backend
from training.config import parse_recipe
from training.distributed import check_launch
from training.errors import UserError
from training.plan import estimate

CONFIGS = ROOT / "accelerate_configs"
LAUNCHER_ENV = ("ACCELERATE_", "FSDP_", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_")

ZERO3_JSON = json.loads((CONFIGS / "ds_zero3.json").read_text())
NO_GATHER_JSON = {**ZERO3_JSON, "zero_optimization": {**ZERO3_JSON["zero_optimization"]}}
NO_GATHER_JSON["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
INLINE_ZERO3 = {"zero_stage": 3, "offload_optimizer_device": "none", "offload_param_device": "none"}
OTHER_CONFIGS = {  # accelerate configs that are not in the repository ({folder}: where the test writes them)
    "cpu.yaml": {"distributed_type": "NO", "use_cpu": True, "num_processes": 1},
    "zero3_no_gather.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "{folder}/no_gather.json"},
    },
    "zero3_inline.yaml": {"distributed_type": "DEEPSPEED", "deepspeed_config": INLINE_ZERO3},
    "zero3_inline_saving.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {**INLINE_ZERO3, "zero3_save_16bit_model": True},
    },
}

QLORA = {"method": {"type": "qlora"}}  # packed 4-bit weights stored as uint8
QLORA_8BIT = {"method": {"type": "qlora", "quantization": {"bits": 8}}}
QLORA_SHARDABLE = {
    "model": {"dtype": "bfloat16"},
    "method": {"type": "qlora", "quantization": {"quant_storage": "bfloat16"}},
}
SKIP = {"train": {"on_nonfinite": "skip"}}
FLASH = {"precision": "bf16", "model": {"attn_implementation": "flash_attention_2"}}
SHARDED_QLORA = (
    "method.type=qlora under FSDP/DeepSpeed ZeRO-3 needs bits=4 and method.quantization.quant_storage"
)
OFFLOAD_OPTIMIZER = "cannot be used with DeepSpeed optimizer offload"
GATHER = "ZeRO-3 without stage3_gather_16bit_weights_on_model_save"

# (recipe overrides, accelerate config, machine has CUDA, a phrase of the message both sides give)
REFUSED = [
    ({}, "fsdp.yaml", False, "the accelerate config asks for FSDP, which needs CUDA GPUs"),
    ({}, "fsdp_offload.yaml", False, "the accelerate config asks for FSDP, which needs CUDA GPUs"),
    (SKIP, "zero2.yaml", True, "train.on_nonfinite=skip is not available under DeepSpeed"),
    (SKIP, "zero3_offload.yaml", False, "train.on_nonfinite=skip is not available under DeepSpeed"),
    (
        {"train": {"optimizer": "adamw_8bit"}},
        "zero2_offload.yaml",
        True,
        f"train.optimizer=adamw_8bit {OFFLOAD_OPTIMIZER}",
    ),
    ({"train": {"optimizer": "paged_adamw_32bit"}}, "zero3_offload.yaml", False, OFFLOAD_OPTIMIZER),
    ({}, "zero3_no_gather.yaml", True, GATHER),
    ({}, "zero3_inline.yaml", True, GATHER),
    ({"precision": "fp16"}, "cpu.yaml", False, "precision=fp16 needs a GPU"),
    ({"precision": "fp16"}, "cpu.yaml", True, "precision=fp16 needs a GPU"),  # use_cpu on a GPU machine
    ({"model": {"liger_kernels": True}}, "cpu.yaml", False, "model.liger_kernels=true needs a CUDA GPU"),
    (FLASH, "cpu.yaml", False, "model.attn_implementation=flash_attention_2 needs CUDA"),
    (QLORA, "zero3.yaml", True, SHARDED_QLORA),
    (QLORA, "zero3_offload.yaml", True, SHARDED_QLORA),
    (QLORA, "fsdp.yaml", True, SHARDED_QLORA),
    (QLORA_8BIT, "fsdp_offload.yaml", True, SHARDED_QLORA),
    (
        deep_update(QLORA, {"method": {"quantization": {"compute_dtype": "float16"}}}),
        "cpu.yaml",
        False,
        "method.quantization.compute_dtype=float16 is for GPUs",
    ),
]
REPO_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml"))
ACCEPTED = [
    *(({}, name, True) for name in REPO_CONFIGS),
    (QLORA_SHARDABLE, "zero3.yaml", True),
    (QLORA_SHARDABLE, "zero3_offload.yaml", True),
    (QLORA_SHARDABLE, "fsdp.yaml", True),
    (QLORA, "single.yaml", True),
    (QLORA, "ddp.yaml", True),
    (QLORA, "zero2_offload.yaml", True),
    (SKIP, "ddp.yaml", True),
    ({"train": {"optimizer": "adamw_8bit"}}, "zero2.yaml", True),
    ({"precision": "fp16"}, "single.yaml", True),
    ({"model": {"liger_kernels": True}}, "ddp.yaml", True),
    (FLASH, "single.yaml", True),
    ({}, "zero3_inline_saving.yaml", True),
    ({}, "cpu.yaml", False),
    ({"precision": "bf16"}, "cpu.yaml", False),
    (QLORA, "cpu.yaml", False),
    (SKIP, "cpu.yaml", False),
]


def case_id(overrides: dict, config: str, cuda: bool) -> str:
    return f"{config}-{'cuda' if cuda else 'cpu'}-{json.dumps(overrides, separators=(',', ':'))}"


@pytest.fixture
def config_file(tmp_path):
    """config_file(name) -> the accelerate config, alone in a folder (the planner plans every file in one)."""

    def _file(name: str, folder_name: str = "configs"):
        folder = tmp_path / folder_name
        folder.mkdir()
        if name in OTHER_CONFIGS:
            raw = {"num_machines": 1, "num_processes": 2, "use_cpu": False, **OTHER_CONFIGS[name]}
            (folder / name).write_text(yaml.safe_dump(raw).replace("{folder}", str(folder)))
            (folder / "no_gather.json").write_text(json.dumps(NO_GATHER_JSON))
        else:  # its deepspeed_config_file (accelerate_configs/ds_*.json) is found from the repository root
            (folder / name).write_text((CONFIGS / name).read_text())
        return folder / name

    return _file


def launch_environment(config) -> dict:
    """The launcher variables `accelerate launch --config_file CONFIG -m training.train r.yaml` sets."""
    args = launch_command_parser().parse_args(
        ["--config_file", str(config), "-m", "training.train", "r.yaml"]
    )
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    if args.use_deepspeed or args.multi_gpu or args.use_fsdp:  # what torchrun adds for each process it starts
        env |= {"WORLD_SIZE": str(args.num_processes), "LOCAL_WORLD_SIZE": str(args.nproc_per_node)}
    return {k: v for k, v in env.items() if k.startswith(LAUNCHER_ENV)}


def trainer_check(recipe, config, cuda: bool, monkeypatch) -> UserError | None:
    """What training.train's launch check says in the processes `accelerate launch` would start."""
    for key in list(os.environ):
        if key.startswith(LAUNCHER_ENV):
            monkeypatch.delenv(key)
    env = launch_environment(config)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # the backend the processes rebuild is the one the planner reads from the file
    launched, planned = launched_backend(), read_backend(config)
    skip = {
        "name",
        "file",
        "num_processes",
        "num_machines",
    }  # the file counts processes in all, torchrun per machine
    assert {k: v for k, v in dataclasses.asdict(launched).items() if k not in skip} == {
        k: v for k, v in dataclasses.asdict(planned).items() if k not in skip
    }
    with (
        monkeypatch.context() as machine
    ):  # only around the check: libraries imported later must see the truth
        machine.setattr(torch.cuda, "is_available", lambda: cuda)
        try:
            check_launch(recipe)
        except UserError as e:
            return e
    return None


def planner_plan(recipe, config, cuda: bool):
    """The planner's plan for this one config (without the gradient-checkpointing variant)."""
    tiny = LlamaConfig(**TINY_ARCH, vocab_size=128)
    plans = estimate(recipe, 1 if cuda else 0, 80, 1024, configs_dir=config.parent, config=tiny)
    (plan,) = [p for p in plans if p.gradient_checkpointing == recipe.model.gradient_checkpointing]
    return plan


def recipe_with(overrides: dict, tmp_path):
    raw = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": "tiny"},
        "data": {"train": ["unused.jsonl"]},
    }
    return parse_recipe(deep_update(raw, overrides))


@pytest.mark.parametrize("overrides, config, cuda, phrase", REFUSED, ids=[case_id(*c[:3]) for c in REFUSED])
def test_refused_by_the_trainer_and_shown_by_the_planner(
    overrides, config, cuda, phrase, config_file, tmp_path, monkeypatch
):
    recipe, file = recipe_with(overrides, tmp_path), config_file(config)
    error = trainer_check(recipe, file, cuda, monkeypatch)
    assert error is not None and phrase in str(error)
    plan = planner_plan(recipe, file, cuda)
    assert not plan.fits and not plan.recommended
    assert plan.reason == str(error)


@pytest.mark.parametrize("overrides, config, cuda", ACCEPTED, ids=[case_id(*c) for c in ACCEPTED])
def test_accepted_by_the_trainer_and_the_planner(overrides, config, cuda, config_file, tmp_path, monkeypatch):
    recipe, file = recipe_with(overrides, tmp_path), config_file(config)
    assert trainer_check(recipe, file, cuda, monkeypatch) is None
    plan = planner_plan(recipe, file, cuda)
    assert plan.fits and plan.reason == ""


def test_every_rule_of_the_table_has_a_refused_case(config_file, tmp_path):
    fired = set()
    for i, (overrides, config, cuda, _) in enumerate(REFUSED):
        recipe, backend = recipe_with(overrides, tmp_path), read_backend(config_file(config, f"case{i}"))
        fired |= {rule for rule in RULES if rule(recipe, backend, cuda) is not None}
    assert fired == set(RULES)
