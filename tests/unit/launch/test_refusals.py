"""One list of what cannot run where (training.launch.refusals.refusal), tested from both sides.

Each refused (recipe, accelerate config, machine) combination is refused by the trainer's launch check
with the table's message AND shown by the planner, for that config, as not fitting for the same reason;
each accepted combination passes both. The trainer side gets the environment that `accelerate launch
--config_file FILE` gives the training processes, computed by accelerate's own launcher code (no
process starts; only WORLD_SIZE and LOCAL_WORLD_SIZE, which torchrun adds, are set by hand); the machine (CUDA or not) is torch.cuda.is_available() for the trainer and
--num-gpus 1 / 0 for the planner. No model is loaded: the planner sizes a tiny config on the meta device.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

import pytest
import torch
import yaml
from transformers import GPT2Config, LlamaConfig

from conftest import ROOT, TINY_ARCH, deep_update
from launching import LAUNCHER_ENV, launch_environment
from training.config import parse_recipe, resolve_precision
from training.core.errors import RecipeError, UserError
from training.core.machine import auto_precision
from training.launch.backend import Backend, launched_backend, read_backend
from training.launch.checks import check_tensor_parallel
from training.launch.refusals import RULES, precision_note
from training.parallel.accelerator import check_launch
from training.planning.memory import estimate

CONFIGS = ROOT / "accelerate_configs"

ZERO3_JSON = json.loads((CONFIGS / "ds_zero3.json").read_text())
NO_GATHER_JSON = {**ZERO3_JSON, "zero_optimization": {**ZERO3_JSON["zero_optimization"]}}
NO_GATHER_JSON["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
# accelerate's example DeepSpeed template (ZeRO-2 with its own optimizer, scheduler and fp16 sections)
TEMPLATE_JSON = {
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
FP16_JSON = {k: v for k, v in TEMPLATE_JSON.items() if k not in ("optimizer", "scheduler")}
SCHEDULER_JSON = {k: v for k, v in TEMPLATE_JSON.items() if k != "optimizer"} | {"fp16": {"enabled": "auto"}}
JSONS = {"no_gather.json": NO_GATHER_JSON, "template.json": TEMPLATE_JSON, "fp16.json": FP16_JSON}
JSONS["scheduler.json"] = SCHEDULER_JSON
INLINE_ZERO3 = {"zero_stage": 3, "offload_optimizer_device": "none", "offload_param_device": "none"}


def mesh(dp_replicate=1, dp_shard=1, tp=1, **pipeline) -> dict:
    return {
        "parallelism_config": {
            **{f"parallelism_config_pp_{k}": v for k, v in pipeline.items()},  # size, schedule, microbatches
            "parallelism_config_dp_replicate_size": dp_replicate,
            "parallelism_config_dp_shard_size": dp_shard,
            "parallelism_config_tp_size": tp,
            "parallelism_config_cp_size": 1,
        }
    }


FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}}
ZERO2 = {
    "distributed_type": "DEEPSPEED",
    "deepspeed_config": {"deepspeed_config_file": "accelerate_configs/ds_zero2.json"},
}
SP2, CP2 = {"parallelism_config_sp_size": 2}, {"parallelism_config_cp_size": 2}
SEQUENCE_CONFIGS = {  # sequence / context parallelism (training/parallel/sequence_parallel.py)
    "sp_ddp.yaml": {"distributed_type": "MULTI_GPU", "parallelism_config": SP2},
    "sp_on_3.yaml": {**ZERO2, "num_processes": 3, "parallelism_config": SP2},
    "sp_and_cp.yaml": {**ZERO2, "parallelism_config": {**SP2, **CP2}},
    "cp_zero2.yaml": {**ZERO2, "parallelism_config": CP2},
    "cp_tp.yaml": {
        **FSDP2,
        "num_processes": 4,
        "parallelism_config": {**CP2, "parallelism_config_tp_size": 2},
    },
}
OTHER_CONFIGS = {  # accelerate configs that are not in the repository ({folder}: where the test writes them)
    "cpu.yaml": {"distributed_type": "NO", "use_cpu": True, "num_processes": 1},
    "tp_on_4.yaml": {"distributed_type": "MULTI_GPU", "num_processes": 4, **mesh(tp=2)},
    "fsdp_tp_on_8.yaml": {**FSDP2, "num_processes": 8, **mesh(dp_shard=2, tp=2)},
    "fsdp_tp_only.yaml": {**FSDP2, **mesh(tp=2)},
    "ddp_x_tp.yaml": {"distributed_type": "MULTI_GPU", "num_processes": 4, **mesh(dp_replicate=2, tp=2)},
    "zero2_tp.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "accelerate_configs/ds_zero2.json"},
        **mesh(tp=2),
    },
    "ds_template.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "{folder}/template.json"},
    },
    "ds_scheduler.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "{folder}/scheduler.json"},
    },
    "ds_fp16.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "{folder}/fp16.json"},
    },
    "zero3_no_gather.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "{folder}/no_gather.json"},
    },
    "zero3_inline.yaml": {"distributed_type": "DEEPSPEED", "deepspeed_config": INLINE_ZERO3},
    **SEQUENCE_CONFIGS,
    "pp_m4.yaml": {"distributed_type": "MULTI_GPU", "num_processes": 2, **mesh(size=2, microbatches=4)},
    "pp_on_3.yaml": {"distributed_type": "MULTI_GPU", "num_processes": 3, **mesh(size=2)},
    "fsdp_pp.yaml": {**FSDP2, **mesh(size=2)},
    "pp_tp.yaml": {"distributed_type": "MULTI_GPU", "num_processes": 4, **mesh(tp=2, size=2)},
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
OFFLOAD_ACTIVATIONS = {"model": {"gradient_checkpointing": True, "activation_offloading": True}}
SHARDED_QLORA = (
    "method.type=qlora under FSDP/DeepSpeed ZeRO-3 needs bits=4 and method.quantization.quant_storage"
)
OFFLOAD_OPTIMIZER = "cannot be used with DeepSpeed optimizer offload"
GATHER = "ZeRO-3 without stage3_gather_16bit_weights_on_model_save"
LORA = {"method": {"type": "lora"}}
RL = {"rl": {"rewards": [{"function": "length_penalty"}]}}
FULL_KL = deep_update(RL, {"rl": {"beta": 0.04}})  # rl.reference: auto = frozen_copy (full fine-tuning)
LORA_KL = deep_update(FULL_KL, LORA)  # rl.reference: auto = adapter_disabled
VLLM = deep_update(RL, {"rl": {"generator": "vllm"}})
EPISODES = deep_update(RL, {"rl": {"tools": ["python"]}})  # agent episodes: whole rows, turn by turn
VLLM_CPU = "rl.generator=vllm needs CUDA GPUs"
ASYNC = deep_update(LORA, deep_update(RL, {"rl": {"async": 1}}))
ASYNC_SHARDED = "rl.async=1 cannot be used under"
SERVER = deep_update(RL, {"rl": {"generator": "server", "server_url": "http://127.0.0.1:8000/v1"}})
VERIFIERS = {
    "rl": {"environment": "verifiers:data/environments/echo_verifiers.py"}
}  # its rubric: the rewards
VERIFIERS_SHARDED = "rl.environment=verifiers:data/environments/echo_verifiers.py cannot be used under"
FROZEN_COPY = "rl.beta=0.04 with rl.reference=frozen_copy (method.type=full) cannot be used under"
MUON = {"train": {"optimizer": "muon"}}
VISION = {"model": {"vision": {"image_size": 32, "patch_size": 8}}}
IMAGE_TEXT = "an image-text model (image features scattered into whole rows)"
WHOLE = "train.optimizer=muon needs each weight matrix whole on every rank"

# (recipe overrides, accelerate config, machine has CUDA, a phrase of the message both sides give)
PIPELINE = "pipeline stages run full training (method.type=full) under distributed_type MULTI_GPU"
REFUSED = [
    (
        {"train": {"batch_size": 1}},
        "pp.yaml",
        False,
        "the 1F1B schedule needs at least as many micro-batches",
    ),
    ({"train": {"batch_size": 6}}, "pp_m4.yaml", True, "train.batch_size=6 rows cannot be cut into"),
    ({}, "pp_on_3.yaml", False, "3 processes cannot be split into parallelism_config_pp_size=2"),
    ({}, "fsdp_pp.yaml", True, f"parallelism_config_pp_size=2 with FSDP is not supported; {PIPELINE}"),
    ({}, "pp_tp.yaml", True, f"with parallelism_config_tp_size=2 is not supported; {PIPELINE}"),
    (LORA, "pp.yaml", True, "method.type=lora cannot be used with pipeline stages"),
    ({}, "tp_on_4.yaml", False, "its mesh tp=2 (parallelism_config_dp_replicate_size x"),
    ({}, "tp_on_4.yaml", True, "needs 2 processes but the launch has 4 (num_processes 4 on 1 machine(s))"),
    ({}, "fsdp_tp_on_8.yaml", False, "its mesh dp_shard=2 x tp=2 (parallelism_config_"),
    (
        {},
        "fsdp_tp_only.yaml",
        False,
        "leaves FSDP nothing to shard over (parallelism_config_dp_shard_size is 1)",
    ),
    ({}, "ddp_x_tp.yaml", True, "parallelism_config_dp_replicate_size=2, parallelism_config_dp_shard_size=1"),
    ({}, "zero2_tp.yaml", True, "parallelism_config_tp_size=2 under DeepSpeed is not supported"),
    ({}, "ds_template.yaml", True, "template.json: remove its 'optimizer' and 'scheduler' blocks"),
    ({}, "ds_scheduler.yaml", False, "scheduler.json: remove its 'scheduler' block; the recipe decides"),
    ({"precision": "fp16"}, "ds_template.yaml", True, "remove its 'optimizer' and 'scheduler' blocks"),
    ({}, "ds_fp16.yaml", True, "fp16.json: fp16.enabled is true but the recipe's precision=no"),
    ({"precision": "bf16"}, "ds_fp16.yaml", True, 'set fp16.enabled to "auto" in the JSON'),
    (QLORA_SHARDABLE, "tp.yaml", True, "method.type=qlora cannot be used with tensor parallelism"),
    (QLORA, "fsdp_tp.yaml", False, "method.type=qlora cannot be used with tensor parallelism"),
    (LORA, "tp.yaml", True, "method.type=lora cannot be used with tensor parallelism yet"),
    (LORA, "fsdp_tp.yaml", False, "method.type=lora cannot be used with tensor parallelism yet"),
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
    (OFFLOAD_ACTIVATIONS, "ddp.yaml", False, "there is nowhere to move them"),
    (OFFLOAD_ACTIVATIONS, "cpu.yaml", True, "there is nowhere to move them"),  # use_cpu on a GPU machine
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
    (
        deep_update(QLORA, {"model": {"dtype": "float16"}}),
        "cpu.yaml",
        False,
        "method.quantization.compute_dtype=auto computes in float16 here",
    ),
    (LORA, "ep.yaml", True, "method.type=lora cannot be used with expert parallelism"),
    (
        {},
        "cp.yaml",
        False,
        "needs CUDA GPUs: torch's ring attention only implements the GPU attention kernels",
    ),
    (
        {},
        "sp_ddp.yaml",
        True,
        "is DeepSpeed Ulysses sequence parallelism and needs distributed_type: DEEPSPEED",
    ),
    ({}, "sp_on_3.yaml", True, "parallelism_config_sp_size=2 does not divide the 3 processes"),
    ({}, "sp_and_cp.yaml", True, "both split the sequence; keep one of them"),
    ({}, "cp_zero2.yaml", True, "(torch context parallelism) needs distributed_type: FSDP"),
    (
        {},
        "cp_tp.yaml",
        True,
        "parallelism_config_cp_size=2 with parallelism_config_tp_size=2 is not supported",
    ),
    ({"data": {"max_length": 31}}, "sp_ulysses.yaml", False, "data.max_length=31 is not a multiple of 2"),
    ({"data": {"max_length": 30}}, "cp.yaml", True, "data.max_length=30 is not a multiple of 4"),
    ({"data": {"packing": True}}, "sp_ulysses.yaml", False, "data.packing=true cannot be used with sequence"),
    (
        {"model": {"attn_implementation": "eager"}},
        "sp_ulysses.yaml",
        True,
        "attn_implementation=eager cannot",
    ),
    (QLORA, "sp_ulysses.yaml", False, "method.type=qlora cannot be used with sequence parallelism"),
    (
        {"preference": {"objective": "dpo"}},
        "tp.yaml",
        True,
        "preference.objective=dpo is not proven with parallelism_config_tp_size=2",
    ),
    (
        {"preference": {"objective": "dpo"}},
        "pp.yaml",
        False,
        "preference.objective=dpo is not proven with parallelism_config_pp_size=2",
    ),
    (VISION, "tp.yaml", True, f"{IMAGE_TEXT} is not proven with parallelism_config_tp_size=2"),
    (VISION, "pp.yaml", False, f"{IMAGE_TEXT} is not proven with parallelism_config_pp_size=2"),
    (VISION, "sp_ulysses.yaml", True, f"{IMAGE_TEXT} is not proven with parallelism_config_sp_size=2"),
    (FULL_KL, "fsdp.yaml", True, f"{FROZEN_COPY} FSDP (the accelerate config)"),
    (ASYNC, "fsdp.yaml", False, f"{ASYNC_SHARDED} FSDP (the accelerate config)"),
    (ASYNC, "zero3.yaml", True, f"{ASYNC_SHARDED} DeepSpeed ZeRO-3"),
    (SERVER, "fsdp.yaml", False, "rl.generator=server cannot be used under FSDP (the accelerate config) yet"),
    (
        VERIFIERS,
        "fsdp.yaml",
        False,
        f"{VERIFIERS_SHARDED} FSDP (the accelerate config) yet: the environment's",
    ),
    (VERIFIERS, "zero3.yaml", True, f"{VERIFIERS_SHARDED} DeepSpeed ZeRO-3"),
    (EPISODES, "tp.yaml", True, "rl episodes (rl.tools / rl.environment: whole rows generated turn by turn)"),
    (EPISODES, "pp.yaml", False, "rl episodes (rl.tools / rl.environment"),
    (FULL_KL, "fsdp_offload.yaml", False, f"{FROZEN_COPY} FSDP"),
    (FULL_KL, "zero3.yaml", True, f"{FROZEN_COPY} DeepSpeed ZeRO-3"),
    (
        FULL_KL,
        "zero3_inline_saving.yaml",
        True,
        "Use method.type=lora or qlora (rl.reference=adapter_disabled",
    ),
    (
        MUON,
        "fsdp.yaml",
        True,
        f"{WHOLE} (its Newton-Schulz step orthogonalises the whole matrix), but distributed",
    ),
    (MUON, "fsdp_offload.yaml", False, "distributed_type FSDP shards every weight matrix"),
    (VLLM, "single.yaml", False, f"{VLLM_CPU} (vLLM's engine runs on the GPU beside training)"),
    (
        deep_update(VLLM, LORA),
        "ddp.yaml",
        False,
        "on CPU use rl.generator=transformers (the same keyed sampling",
    ),
    (
        MUON,
        "zero2.yaml",
        True,
        f"{WHOLE} (its Newton-Schulz step orthogonalises the whole matrix), but DeepSpeed",
    ),
    (MUON, "zero3_offload.yaml", False, "DeepSpeed ZeRO flattens and partitions the parameters"),
    (MUON, "tp.yaml", True, "but parallelism_config_tp_size=2 splits the weight matrices"),
    (MUON, "ep.yaml", True, "but parallelism_config_ep_size=2 shards the experts"),
    (MUON, "pp.yaml", False, "but pipeline stages (parallelism_config_pp_size=2) checkpoint the optimizer"),
    (deep_update(MUON, LORA), "ddp.yaml", True, "train.optimizer=muon cannot be used with method.type=lora"),
    (
        deep_update(MUON, QLORA),
        "single.yaml",
        True,
        "train.optimizer=muon cannot be used with method.type=qlora",
    ),
]
REPO_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml"))
ACCEPTED = [
    *(({}, name, True) for name in REPO_CONFIGS),
    *(
        ({}, name, False)
        for name in ("fsdp.yaml", "fsdp_offload.yaml", "tp.yaml", "fsdp_tp.yaml", "hsdp.yaml")
    ),
    ({"checkpoint": {"every_steps": 5}}, "fsdp_tp.yaml", False),  # FSDP x TP checkpoints are FSDP's
    (
        {"checkpoint": {"every_steps": 5}},
        "tp.yaml",
        False,
    ),  # TP alone: DCP shards (training/parallel/checkpoint.py)
    ({"checkpoint": {"every_steps": 5}}, "tp.yaml", True),
    *(
        (VISION, name, cuda)
        for name in ("ddp.yaml", "fsdp.yaml", "zero3_offload.yaml")
        for cuda in (True, False)
    ),
    (QLORA_SHARDABLE, "hsdp.yaml", True),  # no tensor parallelism: sharded QLoRA as under fsdp.yaml
    (VERIFIERS, "ddp.yaml", False),
    (VERIFIERS, "zero2.yaml", True),
    ({"precision": "fp16"}, "ds_fp16.yaml", True),
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
    (OFFLOAD_ACTIVATIONS, "single.yaml", True),
    (OFFLOAD_ACTIVATIONS, "fsdp.yaml", True),
    (FLASH, "single.yaml", True),
    ({}, "zero3_inline_saving.yaml", True),
    ({}, "cpu.yaml", False),
    ({}, "sp_ulysses.yaml", False),  # DeepSpeed Ulysses runs on CPU processes over gloo
    (LORA, "sp_ulysses.yaml", False),
    ({"data": {"max_length": 64}}, "cp.yaml", True),
    ({}, "pp.yaml", False),  # pipeline stages run on CPU processes
    ({"train": {"batch_size": 2}}, "pp_dp.yaml", False),
    ({"precision": "bf16"}, "cpu.yaml", False),
    (QLORA, "cpu.yaml", False),
    (SKIP, "cpu.yaml", False),
    (FULL_KL, "single.yaml", True),  # the frozen copy: a whole module on each rank, as the policy is
    (FULL_KL, "ddp.yaml", True),
    (ASYNC, "ddp.yaml", False),  # a whole copy of the policy on each rank draws beside training
    (ASYNC, "zero2.yaml", True),
    (SERVER, "ddp.yaml", False),  # each process pushes the same whole weights and asks for its own rows
    (FULL_KL, "zero2.yaml", True),
    (FULL_KL, "cpu.yaml", False),
    (LORA_KL, "fsdp.yaml", True),  # the base under the adapter: no copy, sharded as the model is
    (LORA_KL, "zero3_offload.yaml", True),
    (RL, "fsdp.yaml", True),  # beta 0: no reference
    (EPISODES, "fsdp.yaml", True),  # every rank runs as many generate calls (idle ones)
    (EPISODES, "zero3_offload.yaml", False),
    (VLLM, "single.yaml", True),  # a vLLM engine beside each rank's policy, its weights pushed in (TRL's)
    (deep_update(VLLM, LORA), "ddp.yaml", True),
    (VLLM, "zero3.yaml", True),
    (deep_update(VLLM, LORA), "fsdp.yaml", True),
    (MUON, "single.yaml", True),  # Muon where every rank holds whole matrices: one process, DDP
    (MUON, "ddp.yaml", True),
    (MUON, "multi_node.yaml", True),
    (MUON, "cpu.yaml", False),
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
            for json_name, content in JSONS.items():
                (folder / json_name).write_text(json.dumps(content))
        else:  # its deepspeed_config_file (accelerate_configs/ds_*.json) is found from the repository root
            (folder / name).write_text((CONFIGS / name).read_text())
        return folder / name

    return _file


def trainer_check(recipe, config, cuda: bool, monkeypatch) -> UserError | None:
    """What training.train's launch check says in the processes `accelerate launch` would start."""
    for key in list(os.environ):
        if key.startswith(LAUNCHER_ENV):
            monkeypatch.delenv(key)
    env = launch_environment(config)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # our own keys (parallelism_config_ep_size, pipeline) are read from the launcher's --config_file
    monkeypatch.setenv("LLM_FORGE_ACCELERATE_CONFIG", str(config))
    # the backend the processes rebuild is the one the planner reads from the file
    launched, planned = launched_backend(), read_backend(config)
    skip = {"name", "file"}
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
    """The planner's plan for this one config (without the gradient-checkpointing variant), on as many
    machines and GPUs as the file asks for (none without CUDA)."""
    tiny = LlamaConfig(**TINY_ARCH, vocab_size=128)
    b = read_backend(config)
    gpus = b.num_processes // b.num_machines if cuda else 0
    plans = estimate(
        recipe, gpus, 80, 1024, configs_dir=config.parent, config=tiny, num_machines=b.num_machines
    )
    (plan,) = [p for p in plans if p.gradient_checkpointing == recipe.model.gradient_checkpointing]
    return plan


def recipe_with(overrides: dict, tmp_path):
    raw = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": "tiny"},
        "data": {"train": ["unused.jsonl"]},
    }
    # as the trainer takes it: precision: auto resolved for this machine (conftest fixes it to no)
    return resolve_precision(parse_recipe(deep_update(raw, overrides)), *auto_precision())


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
    # without GPUs the planner plans a GPU file as the CPU processes training runs it as there
    assert plan.fits and plan.reason == ""


def test_every_rule_of_the_table_has_a_refused_case(config_file, tmp_path):
    fired = set()
    for i, (overrides, config, cuda, _) in enumerate(REFUSED):
        recipe, backend = recipe_with(overrides, tmp_path), read_backend(config_file(config, f"case{i}"))
        fired |= {rule for rule in RULES if rule(recipe, backend, cuda) is not None}
    assert fired == set(RULES)


# ----------------------------------------------------------------------------- the mesh, as read and as launched


@pytest.mark.parametrize(
    "name, sizes, mesh, dp",
    [
        ("tp.yaml", (1, 1, 2), "tp=2", 1),
        ("fsdp_tp.yaml", (1, 2, 2), "dp_shard=2 x tp=2", 2),
        ("hsdp.yaml", (2, 2, 1), "dp_replicate=2 x dp_shard=2", 4),
        ("ddp.yaml", (1, 1, 1), "", 2),
        ("single.yaml", (1, 1, 1), "", 1),
    ],
)
def test_mesh_read_from_the_file_equals_the_launched_one(name, sizes, mesh, dp, monkeypatch):
    for key in list(os.environ):
        if key.startswith(LAUNCHER_ENV):
            monkeypatch.delenv(key)
    for key, value in launch_environment(CONFIGS / name).items():
        monkeypatch.setenv(key, value)
    for b in (read_backend(CONFIGS / name), launched_backend()):
        assert (b.dp_replicate_size, b.dp_shard_size, b.tp_size) == sizes
        assert (b.mesh, b.dp_size) == (mesh, dp)
    assert read_backend(CONFIGS / name).kind == {
        "tp.yaml": "ddp",
        "ddp.yaml": "ddp",
        "single.yaml": "single",
    }.get(name, "fsdp")


@pytest.mark.parametrize(
    "block, phrase",
    [
        (
            {"tp_size": 2},
            "parallelism_config key tp_size would be ignored by accelerate; spell it parallelism_config_tp_size",
        ),
        ({"parallelism_config_tp_size": 0}, "parallelism_config_tp_size must be a whole number >= 1"),
        (
            {"parallelism_config_dp_shard_size": "two"},
            "parallelism_config_dp_shard_size must be a whole number",
        ),
    ],
)
def test_misspelt_mesh_keys_are_named(block, phrase, tmp_path):
    file = tmp_path / "mesh.yaml"
    file.write_text(
        yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": 2, "parallelism_config": block})
    )
    with pytest.raises(UserError) as e:
        read_backend(file)
    assert phrase in str(e.value) and str(file) in str(e.value)


# ----------------------------------------------------------------------------- checks that need the model's config


def tp_backend(tp: int) -> Backend:
    return Backend("tp", "accelerate_configs/tp.yaml", "ddp", num_processes=tp, tp_size=tp)


def test_tensor_parallel_needs_heads_divisible_by_tp_size():
    config = LlamaConfig(**{**TINY_ARCH, "num_key_value_heads": 2}, vocab_size=128)  # 4 heads, 2 KV heads
    check_tensor_parallel(config, tp_backend(1))
    check_tensor_parallel(config, tp_backend(2))
    with pytest.raises(RecipeError) as e:
        check_tensor_parallel(config, tp_backend(4))
    assert "parallelism_config_tp_size=4" in str(e.value) and "2 key/value heads" in str(e.value)
    assert "model.from_scratch.num_key_value_heads" in str(e.value) and "among [2]" in str(e.value)
    with pytest.raises(RecipeError) as e:
        check_tensor_parallel(config, tp_backend(3))
    assert "parallelism_config_tp_size=3" in str(e.value) and "4 attention heads" in str(e.value)
    assert "model.from_scratch.num_attention_heads" in str(e.value)


def test_tensor_parallel_needs_a_model_with_a_plan():
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    check_tensor_parallel(config, tp_backend(1))  # no tensor parallelism: nothing to check
    with pytest.raises(RecipeError) as e:
        check_tensor_parallel(config, tp_backend(2))
    message = str(e.value)
    assert "parallelism_config_tp_size=2" in message and "'gpt2' has no tensor-parallel plan" in message
    assert "model.name_or_path" in message and "the accelerate config" in message


def test_planner_marks_a_model_without_a_plan_as_not_fitting_under_tp(tmp_path):
    recipe = recipe_with({}, tmp_path)
    gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    plans = {p.backend: p for p in estimate(recipe, 4, 80, configs_dir=CONFIGS, config=gpt2)}
    for name in ("tp", "fsdp_tp"):
        assert not plans[name].fits and "'gpt2' has no tensor-parallel plan" in plans[name].reason
    assert plans["hsdp"].fits and plans["fsdp"].fits


# ----------------------------------------------------------------------------- the launcher's precision


def launcher_env(tmp_path, **config) -> dict:
    file = tmp_path / "launcher.yaml"
    file.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": 2, **config}))
    return launch_environment(file)


def test_launcher_mixed_precision_that_the_recipe_overrides_is_said(tmp_path):
    env = launcher_env(tmp_path, mixed_precision="bf16")
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    note = precision_note(recipe_with({}, tmp_path), env)
    assert note == (
        "the launcher's mixed_precision=bf16 (accelerate config file or --mixed_precision) is overridden by the "
        "recipe's precision=no; set precision: bf16 in the recipe to train in bf16"
    )
    assert "precision=fp16" in precision_note(recipe_with({"precision": "fp16"}, tmp_path), env)
    assert precision_note(recipe_with({"precision": "bf16"}, tmp_path), env) is None  # they agree


def test_no_precision_note_when_the_launcher_says_nothing(tmp_path, monkeypatch):
    env = launch_environment(CONFIGS / "ddp.yaml")  # the repository's files leave precision to the recipe
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert precision_note(recipe_with({"precision": "bf16"}, tmp_path), env) is None
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # the process's own environment by default
    assert "mixed_precision=fp16" in precision_note(recipe_with({"precision": "bf16"}, tmp_path))


@pytest.mark.parametrize(
    ("model_type", "source", "line", "names"),
    [
        (
            "llama4",
            lambda t: t.Llama4ForConditionalGeneration.forward,
            "image_outputs=outputs.image_outputs",
            "AttributeError",
        ),
        (
            "shieldgemma2",
            lambda t: (
                importlib.import_module(
                    "transformers.conversion_mapping"
                )._build_checkpoint_conversion_mapping
            ),
            '"shieldgemma2": [PrefixChange(prefix_to_add="model", model_prefix="model")]',
            "gemma3",
        ),
    ],
)
def test_a_type_transformers_breaks_is_refused_only_while_the_bug_is_in_its_source(
    model_type, source, line, names, monkeypatch
):
    import inspect

    import transformers

    from training.config import architectures
    from training.config.architectures import type_refusal

    said = type_refusal(model_type)
    if line in inspect.getsource(source(transformers)):  # transformers 5.24
        assert said.startswith(f"{model_type!r} is not trainable with the installed transformers: ")
        assert names in said
    else:
        assert said is None
    fixed = [(t, c, "a line no release has", why) for t, c, _, why in architectures.UPSTREAM_BUGS]
    monkeypatch.setattr(architectures, "UPSTREAM_BUGS", tuple(fixed))
    assert type_refusal(model_type) is None
