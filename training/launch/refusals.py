"""The refusal table: each rule is a function (recipe, backend, cuda) -> UserError | None, tested from
both sides (tests/unit/launch/test_refusals.py); `refusal` returns the first that applies."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from training.config import Recipe, verifiers_target
from training.core.errors import RecipeError, UserError
from training.launch.backend import EP_KEY, Backend

# The trainer rebuilds the backend from the launcher's environment, which does not name the file:
# messages say "the accelerate config" so that the trainer and the planner (whose row names the file)
# give the same one.
Rule = Callable[[Recipe, Backend, bool], UserError | None]

WHERE = "the accelerate config"


PIPELINE_WORKS = (
    "pipeline stages run full training (method.type=full) under distributed_type MULTI_GPU with "
    "parallelism_config_pp_size and optionally parallelism_config_dp_replicate_size "
    "(accelerate_configs/pp.yaml, pp_dp.yaml)"
)


def _pipeline_combinations(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """What training/parallel/pipeline.py does not combine with pipeline stages, and the processes it needs."""
    if b.pp_size <= 1:
        return None
    if b.kind in ("fsdp", "deepspeed"):
        what = "FSDP" if b.kind == "fsdp" else "DeepSpeed"
        return UserError(
            f"{WHERE}: parallelism_config_pp_size={b.pp_size} with {what} is not supported; {PIPELINE_WORKS}"
        )
    others = {k: v for k, v in (("dp_shard", b.dp_shard_size), ("tp", b.tp_size), ("cp", b.cp_size)) if v > 1}
    if others:
        keys = ", ".join(f"parallelism_config_{k}_size={v}" for k, v in others.items())
        return UserError(
            f"{WHERE}: parallelism_config_pp_size={b.pp_size} with {keys} is not supported; {PIPELINE_WORKS}"
        )
    if recipe.method.type != "full":
        return RecipeError(
            f"method.type={recipe.method.type} cannot be used with pipeline stages (parallelism_config_pp_size="
            f"{b.pp_size} in {WHERE}) yet; {PIPELINE_WORKS}. For adapters use ddp.yaml or fsdp.yaml"
        )
    if b.num_processes % b.pp_size:
        return UserError(
            f"{WHERE}: {b.num_processes} processes cannot be split into parallelism_config_pp_size={b.pp_size} "
            f"pipeline stages (not divisible); launch with --num_processes a multiple of {b.pp_size}"
        )
    if b.pp_size * b.dp_replicate_size != b.num_processes:
        return UserError(
            f"{WHERE}: parallelism_config_pp_size={b.pp_size} x parallelism_config_dp_replicate_size="
            f"{b.dp_replicate_size} needs {b.pp_size * b.dp_replicate_size} processes but the launch has "
            f"{b.num_processes}; launch with --num_processes {b.pp_size * b.dp_replicate_size} or set "
            f"parallelism_config_dp_replicate_size to {b.num_processes // b.pp_size}"
        )
    rows, m = recipe.train.batch_size, b.pp_microbatches or recipe.train.batch_size
    if m < b.pp_size:
        return RecipeError(
            f"the {b.pp_schedule} schedule needs at least as many micro-batches as stages: {m} micro-batches "
            f"(parallelism_config_pp_microbatches, default train.batch_size={rows}) < parallelism_config_pp_size="
            f"{b.pp_size}; raise train.batch_size (or parallelism_config_pp_microbatches) to {b.pp_size} or more"
        )
    if rows % m:
        return RecipeError(
            f"train.batch_size={rows} rows cannot be cut into parallelism_config_pp_microbatches={m} equal "
            f"micro-batches; use a batch size that is a multiple of {m}"
        )
    return None


def _mesh_must_match_processes(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.mesh and b.mesh_size != b.num_processes:
        return UserError(
            f"{WHERE}: its mesh {b.mesh} (parallelism_config_dp_replicate_size x _dp_shard_size x _cp_size x "
            f"_tp_size) needs {b.mesh_size} processes but the launch has {b.num_processes} (num_processes "
            f"{b.num_processes} on {b.num_machines} machine(s)); launch with --num_processes {b.mesh_size}, or "
            f"change the parallelism_config_* sizes so that they multiply to num_processes"
        )
    return None


def _fsdp_mesh_needs_a_shard_dimension(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "fsdp" and b.mesh and b.dp_shard_size == 1 and b.cp_size == 1:
        return UserError(
            f"{WHERE}: distributed_type FSDP with the mesh {b.mesh} leaves FSDP nothing to shard over "
            f"(parallelism_config_dp_shard_size is 1); set parallelism_config_dp_shard_size > 1 (as in "
            f"accelerate_configs/fsdp_tp.yaml), or for tensor parallelism alone use distributed_type MULTI_GPU "
            f"(accelerate_configs/tp.yaml)"
        )
    return None


def _tp_needs_a_shard_dimension_beside_replicas(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if (b.tp_size > 1 or b.cp_size > 1) and b.dp_replicate_size > 1 and b.dp_shard_size == 1:
        return UserError(
            f"{WHERE}: accelerate cannot combine tensor/context parallelism with pure replication "
            f"(parallelism_config_dp_replicate_size={b.dp_replicate_size}, parallelism_config_dp_shard_size=1); "
            f"use parallelism_config_dp_shard_size instead of _dp_replicate_size (FSDP x TP, "
            f"accelerate_configs/fsdp_tp.yaml)"
        )
    return None


def _no_tensor_parallel_under_deepspeed(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "deepspeed" and b.tp_size > 1:
        return UserError(
            f"{WHERE}: parallelism_config_tp_size={b.tp_size} under DeepSpeed is not supported; for tensor "
            f"parallelism use accelerate_configs/tp.yaml (TP alone) or fsdp_tp.yaml (FSDP x TP), or remove "
            f"the parallelism_config block"
        )
    return None


def _deepspeed_json_must_leave_optimizer_to_recipe(
    recipe: Recipe, b: Backend, cuda: bool
) -> UserError | None:
    keys = [k for k in ("optimizer", "scheduler") if k in b.ds_config]
    if b.kind == "deepspeed" and keys:
        return UserError(
            f"DeepSpeed config {b.deepspeed_file}: remove its {' and '.join(repr(k) for k in keys)} "
            f"block{'s' if len(keys) > 1 else ''}; the recipe decides the optimizer and the schedule "
            f"(train.optimizer, train.lr, train.weight_decay, train.scheduler, train.warmup_ratio), and "
            f"accelerate refuses an optimizer given both in the DeepSpeed config and in the code. "
            f"accelerate_configs/ds_zero2.json is an example without them"
        )
    return None


def _deepspeed_json_precision_must_agree(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind != "deepspeed":
        return None
    for section in ("fp16", "bf16"):
        enabled = (b.ds_config.get(section) or {}).get("enabled", "auto")
        if str(enabled).lower() == "true" and recipe.precision != section:
            return RecipeError(
                f"DeepSpeed config {b.deepspeed_file}: {section}.enabled is true but the recipe's "
                f"precision={recipe.precision} (DeepSpeed would train in {section} regardless, or stop with an "
                f'error); set {section}.enabled to "auto" in the JSON so that the recipe\'s precision decides, '
                f"or set precision: {section} in the recipe"
            )
    return None


def _adapters_have_no_tensor_parallel_plan(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.method.type == "qlora" and b.tp_size > 1:
        return RecipeError(
            f"method.type=qlora cannot be used with tensor parallelism (parallelism_config_tp_size={b.tp_size} "
            f"in {WHERE}): bitsandbytes 4/8-bit layers have no tensor-parallel plan. Use a config without "
            f"tp (ddp.yaml, fsdp.yaml with quant_storage set, zero2.yaml)"
        )
    if recipe.method.type == "lora" and b.tp_size > 1:
        return RecipeError(
            f"method.type=lora cannot be used with tensor parallelism yet (parallelism_config_tp_size={b.tp_size} "
            f"in {WHERE}): the model's tensor-parallel plan names the base layers that peft wraps. Use "
            f"fsdp.yaml (LoRA under FSDP2 is tested) or ddp.yaml"
        )
    return None


def _expert_parallel_runs_over_ddp(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.ep_size == 1:
        return None
    if b.kind != "ddp" or b.mesh:
        return UserError(
            f"{EP_KEY}={b.ep_size} ({WHERE}): expert parallelism shards the experts over DDP ranks "
            f"(distributed_type MULTI_GPU, no other parallelism_config size); it is not combined with "
            f"{b.kind if b.kind != 'ddp' else b.mesh} here. Use accelerate_configs/ep.yaml"
        )
    if b.ep_size != b.num_processes:
        return UserError(
            f"{EP_KEY}={b.ep_size} ({WHERE}) must equal the number of processes ({b.num_processes}): every "
            f"rank holds num_experts / ep_size experts; launch with --num_processes {b.ep_size} or change it"
        )
    if recipe.method.type != "full":
        return RecipeError(
            f"method.type={recipe.method.type} cannot be used with expert parallelism ({EP_KEY}={b.ep_size} in "
            f"{WHERE}) yet: adapters would wrap sharded expert weights. Use ddp.yaml or fsdp.yaml for LoRA"
        )
    arch = recipe.model.from_scratch
    if arch is not None:
        if arch.num_experts is None and not any(
            k in arch.extra for k in ("num_experts", "num_local_experts")
        ):
            return RecipeError(
                f"{EP_KEY}={b.ep_size} ({WHERE}): model.from_scratch is a dense model (no num_experts); "
                f"set model.from_scratch.num_experts with a Mixture-of-Experts type, or use ddp.yaml"
            )
        if arch.num_experts is not None and arch.num_experts % b.ep_size:
            return RecipeError(
                f"model.from_scratch.num_experts={arch.num_experts} is not divisible by {EP_KEY}={b.ep_size} "
                f"({WHERE}): each rank holds whole experts; use a multiple of {b.ep_size} experts"
            )
    return None


def _deepspeed_cannot_skip_steps(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "deepspeed" and recipe.train.on_nonfinite == "skip":
        return RecipeError(
            "train.on_nonfinite=skip is not available under DeepSpeed (the engine steps inside backward); use stop"
        )
    return None


def _optimizer_offload_needs_adamw(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    optimizer = recipe.train.optimizer
    if b.kind == "deepspeed" and b.offload_optimizer and optimizer != "adamw":
        return RecipeError(
            f"train.optimizer={optimizer} cannot be used with DeepSpeed optimizer offload: DeepSpeed "
            f"replaces it with its CPU Adam (in plain Adam mode, not AdamW). Use train.optimizer=adamw (the "
            f"offloaded optimizer state lives in CPU RAM anyway), or a config without offload (zero2.yaml, zero3.yaml)"
        )
    return None


MUON_RUNS = (
    "run muon on one process or under DDP (accelerate_configs/single.yaml, ddp.yaml, multi_node.yaml), or keep "
    "this config with train.optimizer=adamw"
)


def _muon_needs_whole_matrices(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """torch's Muon orthogonalises each hidden weight matrix's update whole (Newton-Schulz): it runs where
    every rank holds whole matrices, on full training (training/model/optim.py, MuonWithAdamW)."""
    if recipe.train.optimizer != "muon":
        return None
    if recipe.method.type != "full":
        return RecipeError(
            f"train.optimizer=muon cannot be used with method.type={recipe.method.type}: Muon is made for the "
            f"whole weight matrices of full training, not for low-rank adapter factors (lora_A/lora_B), and is "
            f"not proven on them here; use train.optimizer=adamw for adapters, or method.type=full"
        )
    why = None
    if b.kind == "fsdp":
        why = "distributed_type FSDP shards every weight matrix over the ranks (DTensor shards)"
    elif b.kind == "deepspeed":
        why = "DeepSpeed ZeRO flattens and partitions the parameters into its own optimizer's buffers"
    elif b.tp_size > 1:
        why = f"parallelism_config_tp_size={b.tp_size} splits the weight matrices over the ranks"
    elif b.ep_size > 1:
        why = f"{EP_KEY}={b.ep_size} shards the experts over the ranks (DTensors)"
    elif b.pp_size > 1:
        why = (
            f"pipeline stages (parallelism_config_pp_size={b.pp_size}) checkpoint the optimizer through torch "
            f"distributed checkpoint, not proven with Muon here"
        )
    if why is None:
        return None
    return RecipeError(
        f"train.optimizer=muon needs each weight matrix whole on every rank (its Newton-Schulz step "
        f"orthogonalises the whole matrix), but {why} ({WHERE}); {MUON_RUNS}"
    )


def _zero3_must_gather_16bit(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "deepspeed" and b.zero_stage == 3 and not b.gathers_16bit:
        return RecipeError(
            "the DeepSpeed config uses ZeRO-3 without stage3_gather_16bit_weights_on_model_save: true, so final/ "
            "could not be exported at the end of training; set it in the DeepSpeed JSON (as in "
            "accelerate_configs/ds_zero3.json) or zero3_save_16bit_model: true in the accelerate config"
        )
    return None


def _fp16_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.precision == "fp16" and not cuda:
        return RecipeError(
            "precision=fp16 needs a GPU (CPU has no fp16 loss scaling); use precision=bf16 or no on CPU"
        )
    return None


def _liger_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.model.liger_kernels and not cuda:
        return RecipeError(
            "model.liger_kernels=true needs a CUDA GPU (Liger kernels are Triton GPU kernels); set it to false on CPU"
        )
    return None


def _activation_offloading_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.model.activation_offloading and not cuda:
        return RecipeError(
            "model.activation_offloading=true moves saved activations from a GPU's memory to the host's; on the "
            "CPU they are in host memory already, so there is nowhere to move them. Set it to false and bound "
            "them with model.gradient_checkpointing (and model.tiled_mlp for long sequences)"
        )
    return None


def _flash_attention_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.model.attn_implementation == "flash_attention_2" and not cuda:
        return RecipeError(
            "model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package; use sdpa (or auto)"
        )
    return None


def _sharded_qlora_needs_floating_storage(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    q = recipe.method.quantization
    if recipe.method.type == "qlora" and b.shards_parameters and (q.bits != 4 or q.quant_storage == "uint8"):
        return RecipeError(
            "method.type=qlora under FSDP/DeepSpeed ZeRO-3 needs bits=4 and method.quantization.quant_storage set to "
            f"model.dtype (e.g. quant_storage: bfloat16 with model.dtype: bfloat16), so that the packed 4-bit weights "
            f"can be sharded like the other parameters (got bits={q.bits}, quant_storage={q.quant_storage})"
        )
    return None


def _qlora_float16_compute_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.method.type != "qlora" or recipe.quantization_compute_dtype != "float16" or cuda:
        return None
    if recipe.method.quantization.compute_dtype == "float16":
        return RecipeError(
            "method.quantization.compute_dtype=float16 is for GPUs; on CPU use auto, bfloat16 or float32"
        )
    return RecipeError(
        "method.quantization.compute_dtype=auto computes in float16 here (model.dtype=float16 or precision=fp16), "
        "which is for GPUs; on CPU set it to bfloat16 or float32"
    )


ULYSSES_FILE = "accelerate_configs/sp_ulysses.yaml"


CP_FILE = "accelerate_configs/cp.yaml"


def sequence_split(b: Backend) -> tuple[str, int, int]:
    """(the accelerate config key, its degree, what the sequence length must be a multiple of): DeepSpeed
    Ulysses splits every sequence in sp_size pieces; torch context parallelism in 2 x cp_size chunks (its
    causal load balancing gives each rank one chunk from the start and one from the end). ("", 1, 1) when
    sequences are not split."""
    if b.sp_size > 1:
        return "parallelism_config_sp_size", b.sp_size, b.sp_size
    if b.cp_size > 1:
        return "parallelism_config_cp_size", b.cp_size, 2 * b.cp_size
    return "", 1, 1


def _sequence_parallel_backend(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.sp_size > 1 and b.cp_size > 1:
        return UserError(
            f"{WHERE}: parallelism_config_sp_size={b.sp_size} (DeepSpeed Ulysses) and parallelism_config_cp_size="
            f"{b.cp_size} (torch context parallelism) both split the sequence; keep one of them ({ULYSSES_FILE} or "
            f"{CP_FILE})"
        )
    if b.sp_size > 1 and b.kind != "deepspeed":
        return UserError(
            f"{WHERE}: parallelism_config_sp_size={b.sp_size} is DeepSpeed Ulysses sequence parallelism and needs "
            f"distributed_type: DEEPSPEED (as in {ULYSSES_FILE}); for torch ring-attention context parallelism "
            f"under FSDP use parallelism_config_cp_size ({CP_FILE})"
        )
    if b.sp_size > 1 and b.num_processes % b.sp_size:
        return UserError(
            f"{WHERE}: parallelism_config_sp_size={b.sp_size} does not divide the {b.num_processes} processes of the "
            f"launch: each group of sp_size processes shares its sequences, the groups are data-parallel; launch "
            f"with --num_processes a multiple of {b.sp_size}"
        )
    if b.cp_size > 1 and b.kind != "fsdp":
        return UserError(
            f"{WHERE}: parallelism_config_cp_size={b.cp_size} (torch context parallelism) needs distributed_type: "
            f"FSDP with fsdp_version: 2 (as in {CP_FILE}); for DeepSpeed use parallelism_config_sp_size "
            f"({ULYSSES_FILE})"
        )
    if b.cp_size > 1 and b.tp_size > 1:
        return UserError(
            f"{WHERE}: parallelism_config_cp_size={b.cp_size} with parallelism_config_tp_size={b.tp_size} is not "
            f"supported here yet; use context parallelism over FSDP alone ({CP_FILE})"
        )
    if b.cp_size > 1 and not cuda:
        return UserError(
            f"{WHERE}: parallelism_config_cp_size={b.cp_size} (torch context parallelism) needs CUDA GPUs: torch's "
            f"ring attention only implements the GPU attention kernels (flash, memory-efficient, cuDNN), not CPU "
            f"SDPA. On CPU use DeepSpeed Ulysses sequence parallelism ({ULYSSES_FILE}), which runs over gloo"
        )
    return None


def _sequence_split_needs_a_fitting_recipe(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    key, degree, multiple = sequence_split(b)
    if degree == 1:
        return None
    what = f"{key}={degree} in {WHERE}"
    if recipe.data.max_length % multiple:
        fits = recipe.data.max_length // multiple * multiple
        return RecipeError(
            f"data.max_length={recipe.data.max_length} is not a multiple of {multiple} ({what}): every sequence "
            f"(a text block, or a padded row) is split into {multiple} equal pieces; use data.max_length="
            f"{fits or multiple} or {fits + multiple}"
        )
    if recipe.data.packing:
        return RecipeError(
            f"data.packing=true cannot be used with sequence parallelism ({what}): the split attention runs "
            f"causally over the whole row without its mask, so packed examples would attend to each other; set "
            f"data.packing=false (rows are padded to a multiple of {multiple}) or use format: text"
        )
    if recipe.model.attn_implementation == "eager":
        return RecipeError(
            f"model.attn_implementation=eager cannot be used with sequence parallelism ({what}): it needs a "
            f"full attention mask; use sdpa or auto (flash_attention_2 on GPUs)"
        )
    if recipe.data.streaming or recipe.data.is_mixture:
        return RecipeError(
            f"data.{'streaming' if recipe.data.streaming else 'train'} (a streamed corpus or a mixture) cannot be "
            f"used with sequence parallelism ({what}) yet: the split collator is not wired into the stream; "
            f"pre-tokenize one source (data.streaming=false) or use ddp/zero configs"
        )
    if recipe.method.type == "qlora":
        return RecipeError(
            f"method.type=qlora cannot be used with sequence parallelism ({what}) yet: 4-bit layers are not "
            f"supported by DeepSpeed or FSDP context parallelism here; use method.type=lora or full"
        )
    return None


def _whole_rows_without_model_parallelism(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """Preference losses pair sequences row by row over whole rows, RL generates whole completions with the
    whole model, distillation compares whole rows with a whole teacher, and an image-text model scatters its
    image features into whole rows (no tensor-parallel plan covers its vision encoder): tested under DDP,
    FSDP and ZeRO only."""
    whole_rows = (recipe.preference, recipe.rl, recipe.distill, recipe.data.images)
    if all(x is None for x in whole_rows):
        return None
    if recipe.data.images is not None:
        what = "an image-text model (image features scattered into whole rows)"
    elif recipe.preference is not None:
        what = f"preference.objective={recipe.preference.objective}"
    elif recipe.rl is not None and recipe.rl.episodes:
        what = "rl episodes (rl.tools / rl.environment: whole rows generated turn by turn)"
    elif recipe.rl is not None:
        what = f"rl (loss_type={recipe.rl.loss_type})"
    else:
        what = "distill (a whole teacher beside each rank's student)"
    split = {
        "parallelism_config_tp_size": b.tp_size,
        "parallelism_config_pp_size": b.pp_size,
        "parallelism_config_sp_size": b.sp_size,
        "parallelism_config_cp_size": b.cp_size,
        EP_KEY: b.ep_size,
    }
    if used := [f"{k}={v}" for k, v in split.items() if v > 1]:
        return RecipeError(
            f"{what} is not proven with {', '.join(used)} ({WHERE}); use ddp, fsdp or a DeepSpeed ZeRO config"
        )
    return None


def _rl_frozen_copy_needs_whole_parameters(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """RL's KL reference for full fine-tuning is a whole frozen copy of the model on every rank: under a
    backend that shards the parameters it would undo the sharding."""
    r = recipe.rl
    if r is None or r.reference != "frozen_copy" or not b.shards_parameters:
        return None
    what = "FSDP" if b.kind == "fsdp" else "DeepSpeed ZeRO-3"
    return RecipeError(
        f"rl.beta={r.beta:g} with rl.reference=frozen_copy (method.type=full) cannot be used under {what} "
        f"({WHERE}): the KL reference would be a whole frozen copy of the model on every rank, undoing the "
        f"sharding of the parameters. Use method.type=lora or qlora (rl.reference=adapter_disabled: the base "
        f"under the adapter, no copy), or rl.beta=0 (no reference), or DDP (ddp.yaml)"
    )


def _rl_beside_training_needs_whole_parameters(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """rl.async draws on a whole copy of the policy in a background thread, rl.generator=server pushes the
    weights as each process holds them, and a verifiers environment's calls are served from each process's
    policy on its own: none has the whole weights where the backend shards them."""
    r = recipe.rl
    verifiers = r is not None and verifiers_target(r.environment) is not None
    if r is None or not b.shards_parameters or not (r.async_ or r.generator == "server" or verifiers):
        return None
    what = "FSDP" if b.kind == "fsdp" else "DeepSpeed ZeRO-3"
    if verifiers:
        return RecipeError(
            f"rl.environment={r.environment} cannot be used under {what} ({WHERE}) yet: the environment's "
            "model calls are served from each process's policy on its own, which sharded parameters "
            "(generated in step by every process) do not allow; use DDP (ddp.yaml) or ZeRO-1/2"
        )
    if r.async_:
        why, off = "the rollouts are drawn beside training on a whole copy of the policy", "rl.async: 0"
    else:
        why, off = (
            "the weights pushed to the server are read whole from each process",
            "rl.generator: transformers",
        )
    return RecipeError(
        f"{'rl.async=' + str(r.async_) if r.async_ else 'rl.generator=server'} cannot be used under {what} "
        f"({WHERE}) yet: {why}, which sharded parameters do not give; use DDP (ddp.yaml) or ZeRO-1/2, or {off}"
    )


def _vllm_generation_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """vLLM's engine runs on CUDA GPUs (its CPU build is a separate install this project does not use)."""
    if recipe.rl is not None and recipe.rl.generator == "vllm" and not cuda:
        return RecipeError(
            "rl.generator=vllm needs CUDA GPUs (vLLM's engine runs on the GPU beside training); on CPU use "
            "rl.generator=transformers (the same keyed sampling through transformers' generate)"
        )
    return None


RULES: tuple[Rule, ...] = (
    _pipeline_combinations,
    _mesh_must_match_processes,
    _fsdp_mesh_needs_a_shard_dimension,
    _tp_needs_a_shard_dimension_beside_replicas,
    _no_tensor_parallel_under_deepspeed,
    _deepspeed_json_must_leave_optimizer_to_recipe,
    _deepspeed_json_precision_must_agree,
    _adapters_have_no_tensor_parallel_plan,
    _expert_parallel_runs_over_ddp,
    _deepspeed_cannot_skip_steps,
    _muon_needs_whole_matrices,  # before the offload rule, which would suggest zero2.yaml
    _optimizer_offload_needs_adamw,
    _zero3_must_gather_16bit,
    _fp16_needs_cuda,
    _liger_needs_cuda,
    _activation_offloading_needs_cuda,
    _flash_attention_needs_cuda,
    _sharded_qlora_needs_floating_storage,
    _qlora_float16_compute_needs_cuda,
    _sequence_parallel_backend,
    _sequence_split_needs_a_fitting_recipe,
    _whole_rows_without_model_parallelism,
    _rl_frozen_copy_needs_whole_parameters,
    _rl_beside_training_needs_whole_parameters,
    _vllm_generation_needs_cuda,
)


def refusal(recipe: Recipe, backend: Backend, cuda: bool) -> UserError | None:
    """Why `recipe` cannot run under `backend` on processes with (`cuda`) or without CUDA GPUs: the
    error the trainer raises (its message names the recipe or config key and what to use instead),
    or None. The first rule that applies wins.

    Checks that depend on what is installed here (the flash-attn and liger-kernel packages) stay with
    the code that uses them: the planner may be planning for another machine.
    """
    for rule in RULES:
        if (error := rule(recipe, backend, cuda)) is not None:
            return error
    return None


def precision_note(recipe: Recipe, env: Mapping[str, str] | None = None) -> str | None:
    """One line for the start-up log when the launcher asked for another mixed precision than the
    recipe's (an accelerate config `mixed_precision:` or `accelerate launch --mixed_precision`, which
    arrive as ACCELERATE_MIXED_PRECISION): the recipe's `precision` is what training uses. None when they
    agree or the launcher said nothing ("no" is also what accelerate exports when nothing is set)."""
    env = os.environ if env is None else env
    launcher = str(env.get("ACCELERATE_MIXED_PRECISION", "no")).strip().lower()
    if launcher in ("", "no") or launcher == recipe.precision:
        return None
    return (
        f"the launcher's mixed_precision={launcher} (accelerate config file or --mixed_precision) is overridden "
        f"by the recipe's precision={recipe.precision}; set precision: {launcher} in the recipe to train in "
        f"{launcher}"
    )
