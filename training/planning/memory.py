"""The memory model of the planner (python -m training.plan): what each backend needs for a recipe.

The model is built from its config alone on the meta device (accelerate's init_empty_weights; no
weights, no network), LoRA adapters are added to it the same way, and the parameter, gradient and
optimizer-state bytes are counted from those tensors. Activations come from a per-token formula for
Llama-style decoder layers, calibrated on CPU against the tensors autograd really saves (see
benchmarks/planner_accuracy.py). Per device:

    peak = parameters + optimizer states + buffers + max(activations [+ gradients when accumulating],
                                                        gradients + optimizer-step temporaries)

Machines: the plan is for the machines the user names (`--num-machines`, default 1) with `--num-gpus`
GPUs each; multi-GPU backends use all of them, `single` uses one. A file's own num_machines is replaced
by the user's, and a multi-node file (num_machines > 1) is not a candidate on one machine.

Host memory: judged only against `--cpu-memory` when it is given. Without it no limit is assumed (the
machine the planner runs on is usually not the one that trains); the host column still shows what each
training machine needs.

Meshes (`parallelism_config` in the file: tp.yaml, fsdp_tp.yaml, hsdp.yaml): accelerate runs a mesh on
exactly the processes its sizes multiply to, so such a file is planned on its own num_processes (the
launch command passes that number), does not fit when the machines named have fewer GPUs, and is refused
when its num_processes differs from the mesh. Per device, approximately:
  - tensor parallelism divides the tensors the model's transformers TP plan shards (attention and MLP
    linears, embedding and LM head for Llama-style plans) by tp_size, with their gradients and optimizer
    state; norms and LoRA adapters stay whole (replicated). Activations: the parts inside the split layers
    (MLP intermediate, key/value, attention per head) are divided by tp_size; the layer inputs, the norms
    and the logits the loss needs are kept whole on every TP rank (no sequence parallelism).
  - FSDP over a mesh shards over dp_shard (x cp) only: under HSDP (dp_replicate x dp_shard) each replica
    holds a whole copy of the states, sharded dp_shard ways.
  - context parallelism (cp, cp.yaml) and DeepSpeed Ulysses sequence parallelism (sp_size, sp_ulysses.yaml;
    not a mesh: it runs on all GPUs, in groups of sp_size that are data-parallel) split every sequence, so
    the per-token activations (and the logits) are divided by cp_size / sp_size; parameters and optimizer
    states are sharded as the backend shards them (ZeRO over all processes, FSDP over dp_shard x cp).
    When a sequence does not fit one GPU under any configuration, the planner names the smallest
    sequence-parallel degree that makes it fit (`sequence_parallel_advice`).
  - pipeline stages (pp.yaml, pp_dp.yaml: parallelism_config_pp_size) hold their share of the decoder
    layers (the first also the embedding, the last the final norm and LM head) with its gradients and
    optimizer state; the planner counts the largest stage. Activations: a micro-batch's activations for
    the stage's layers, times the micro-batches in flight on stage 0 (GPipe: all m; 1F1B: min(m, stages)),
    plus one micro-batch's logits on the last stage. The bubble (p - 1) / (m + p - 1) scales the speed.

Preference tuning: a pair is two sequences (chosen and rejected) in one batch, so the activations double
(KTO trains on one). The reference adds no parameters: LoRA/QLoRA use the base under the disabled adapter,
full fine-tuning reads log-probabilities computed before training; its no-grad forward is smaller than
the policy's training forward and is freed before it.

Online RL: a micro-batch of B prompts trains on B x num_generations sequences of up to max_length +
max_new_tokens tokens; the vocabulary head, the log-softmax, its exp for the entropy and their gradients run on
the completions' max_new_tokens positions only (no chunked loss; logits from the first scored token on,
training/model/logits.py); the rollouts' KV cache (the step's groups drawn together, no grad) is freed before that
forward, so only the larger of the two counts. The KL reference is the base under the LoRA adapter (no
parameters), or for full fine-tuning a frozen copy of the model: its parameters once more on every device, as
the policy's are kept (the backends that shard parameters refuse it); its no-grad forward is freed before the
policy's.
With rl.generator=vllm each GPU also gives rl.vllm_gpu_memory_utilization of its memory to the colocated vLLM
engine (its copy of the weights and its KV cache), counted among the buffers.
A LoRA policy generating under mixed precision draws from a copy of its base with the adapter merged
(training/generation/merged.py): the base's parameters once more on every process (`merged_copy`).
Under ZeRO-3/FSDP2 the policy generates on its weights gathered whole (rl.gather_for_generation, on-policy
distillation): while it does, a device holds the whole model beside its shard and the rollouts' KV cache, instead
of the step's activations; the larger of the two counts (`gathered_for_generation`).
With rl.async = K a copy of the policy draws the next steps' rollouts beside training: its trainable weights
(the adapter, or the whole model for full fine-tuning; the frozen ones are shared) and K snapshots of them in
flight, and its rollouts' KV cache at the same time as the training step's activations.
With rl.num_iterations > 1 the window's rollouts keep the sampling policy's log-probabilities between steps:
one fp32 number per token of every micro-batch of the window. A reward model (rl.rewards' reward_model)
is held whole by every process, in its checkpoint's dtype, under every backend (it is not prepared, so
nothing shards it): its parameters are counted on every device, without gradients or optimizer state; its
no-grad scoring forward comes and goes before the policy's.

Distillation: a teacher computed on the fly is held in the student's dtype, sharded like the student where
the backend shards parameters (FSDP2, ZeRO-3: its parameters over the same group) and whole on every
process elsewhere; no gradients or optimizer state; its no-grad forward keeps only the labelled positions'
last hidden states; with distill.top_k it is not held while training at all.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from training.config import Recipe, resolve_precision
from training.core.errors import UserError
from training.core.machine import forced_precision
from training.core.paths import CONFIGS_DIR, ROOT
from training.launch.backend import Backend, read_backends
from training.launch.checks import (
    bubble_fraction,
    check_pipeline,
    check_sequence_parallel,
    check_tensor_parallel,
    stage_layers,
)
from training.launch.refusals import refusal
from training.model.vision import (
    resolve_image_text,
)
from training.planning.activations import (
    activation_bytes,
    loss_is_chunked,
    offloaded_bytes,
    precision_mode,
    rollout_kv_bytes,
)
from training.planning.inventory import (
    ModelInventory,
    inventory,
    tp_inventory,
)

GiB = 2**30
CUDA_CONTEXT_GIB = (
    0.75  # CUDA context + allocator slack, outside max_memory_allocated; added when judging fit
)


@dataclass
class BackendPlan:
    backend: str
    file: str
    devices: int
    method: str
    gradient_checkpointing: bool
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    buffers_gib: float
    peak_gib: float  # per device
    host_gib: float  # per machine: offloaded states, or the CPU copy made while loading if larger
    device_limit_gib: float
    host_limit_gib: float | None  # None: no host memory limit given, host memory not judged
    fits: bool
    speed: float  # relative throughput estimate (one GPU, no checkpointing = 1.0)
    reason: str = ""  # why it does not fit or is not supported
    recommended: bool = False
    command: str = ""
    mesh: str = ""  # e.g. "dp_shard=2 x tp=2"; "sp=4" for DeepSpeed Ulysses (not a mesh)
    machines: int = 1
    launch_flags: str = (
        ""  # accelerate launch flags overriding the file, e.g. " --parallelism_config_sp_size 4"
    )
    pipeline: str = ""  # pipeline stages: parameters per stage, micro-batches in flight, bubble

    def as_dict(self) -> dict:
        return asdict(self)


# Relative per-device throughput of each scheme (rough, from published ZeRO/FSDP scaling figures).
_EFFICIENCY = {"single": 1.0, "ddp": 0.95, "optim": 0.93, "grads_optim": 0.9, "hybrid": 0.87, "full": 0.85}


def planner_refusal(recipe: Recipe, b: Backend, num_gpus: int, num_machines: int = 1, config=None) -> str:
    """Why this backend (as its file says) is not a candidate on `num_machines` machines of `num_gpus`
    GPUs: the trainer's refusal (training.launch.refusals.refusal, then check_tensor_parallel with the model's
    config) on the machine planned for (CUDA unless the backend runs on CPU or there are no GPUs), no GPU
    at all, a multi-node file on one machine, or a mesh needing more GPUs than the machines have."""
    # the backend as launched on these machines: its process count is the GPUs', not the file's (Ulysses'
    # sp_size must divide it)
    launched = planned_backend(b, num_gpus, num_machines) if not b.cpu and num_gpus >= 1 else b
    if (error := refusal(recipe, launched, cuda=not b.cpu and num_gpus >= 1)) is not None:
        return str(error)
    if config is not None:
        try:
            check_tensor_parallel(config, b)
            check_sequence_parallel(config, b)
            check_pipeline(config, b)
        except UserError as e:
            return str(e)
    if not b.cpu and num_gpus < 1:
        return "needs a GPU (--num-gpus 0)"
    if not b.cpu and b.num_machines > 1 and num_machines == 1:
        return (
            f"a multi-node config (num_machines: {b.num_machines} in the file) and the plan is for one machine; "
            f"give --num-machines {b.num_machines} to plan for it"
        )
    world = plan_world(b, num_gpus, num_machines)
    if not b.cpu and b.mesh and world > num_gpus * num_machines:
        return (
            f"its mesh {b.mesh} runs on exactly {world} processes (num_processes in the file) and "
            f"--num-gpus {num_gpus} x --num-machines {num_machines} gives {num_gpus * num_machines} GPUs; "
            f"change the parallelism_config_* sizes and num_processes to fit the GPUs"
        )
    return ""


def plan_world(b: Backend, num_gpus: int, num_machines: int) -> int:
    """Processes the backend runs on: a CPU file's own count, one for `single`, exactly the file's
    num_processes for a mesh (accelerate runs a mesh on the processes it multiplies to), else every GPU
    of the machines planned for."""
    if b.kind == "single":
        return 1
    if b.cpu:
        return max(1, b.num_processes)
    if b.mesh:
        return max(1, b.num_processes)
    return max(1, num_gpus) * num_machines


def planned_backend(b: Backend, num_gpus: int, num_machines: int) -> Backend:
    """The file's backend on the machines planned for: the user's number of machines replaces the file's
    (one for CPU and single-process files), and num_processes is what the launch command passes."""
    machines = 1 if b.cpu or b.kind == "single" else num_machines
    world = plan_world(b, num_gpus, num_machines)
    return dataclasses.replace(b, num_machines=max(1, min(machines, world)), num_processes=world)


@dataclass
class ModelStates:
    """Bytes of parameters, gradients and optimizer state on one device, and of offloaded states in the
    host memory of one machine."""

    params: int
    grads: int
    optim: int
    host: int = 0


def merged_copy(recipe: Recipe, b: Backend) -> bool:
    """Whether a LoRA policy generates through a copy of its base with the adapter merged
    (training/generation/merged.py): under mixed precision, a plain adapter on whole models,
    drawing on the main thread (online RL's transformers engine, not rl.async nor continuous batching;
    on-policy distillation)."""
    lora = recipe.method.lora
    plain = recipe.method.type == "lora" and not lora.use_dora and not lora.modules_to_save
    rl = recipe.rl
    generates = (
        rl is not None and rl.generator == "transformers" and rl.batching == "static" and not rl.async_
    )
    generates = generates or (recipe.distill is not None and recipe.distill.lmbda > 0)
    return recipe.precision != "no" and plain and generates and not b.shards_parameters


def gathered_for_generation(recipe: Recipe, inv: ModelInventory, b: Backend, world: int, mode: str) -> int:
    """Under ZeRO-3/FSDP2, what one device holds while the policy generates on its weights gathered whole
    (rl.gather_for_generation, on-policy distillation; training/parallel/frozen.py): the whole model in the dtype
    it is gathered in, less the share the device keeps and the gathering buffers already counted, plus the
    rollouts' KV cache. 0 where nothing is gathered."""
    rl, distill = recipe.rl, recipe.distill
    gathers = rl is not None and rl.generator == "transformers" and rl.gather_for_generation
    if not (b.shards_parameters and (gathers or (distill is not None and distill.lmbda > 0))):
        return 0
    whole = inv.param_bytes if mode == "fp32" else 2 * inv.param_numel
    kept = 0 if b.offload_params else whole / shard_group(b, world)
    counted = gather_buffer_bytes(inv, b, world, 4 if mode == "fp32" else 2)
    kv = rollout_kv_bytes(recipe, inv, mode) if rl is not None else 0
    return int(max(whole - kept - counted, 0) + kv)


def replica_states(recipe: Recipe, inv: ModelInventory, b: Backend) -> ModelStates:
    """One whole replica's states, in the dtypes the backend keeps them in (DeepSpeed with bf16/fp16
    casts the module to half precision and keeps fp32 master weights in the optimizer)."""
    ds = b.kind == "deepspeed"
    half_states = ds and recipe.precision in ("bf16", "fp16")
    params = inv.param_bytes
    if half_states and recipe.method.type != "qlora":
        params = inv.param_numel * 2  # DeepSpeed casts the module to bf16/fp16
    if recipe.rl is not None and recipe.rl.reference == "frozen_copy":
        params *= 2  # + RL's KL reference: a frozen copy of the (prepared) model, no gradients or state
    if recipe.rl is not None and recipe.rl.async_:  # the generating copy's trainable weights + K snapshots
        params += (1 + recipe.rl.async_) * inv.trainable_bytes
    if merged_copy(recipe, b):  # the base with the adapter merged, that generation runs
        params += inv.param_bytes - inv.trainable_bytes
    grads = inv.trainable_numel * 2 if half_states else inv.trainable_bytes
    step_tensors = 4 * inv.trainable_tensors
    if half_states:
        optim = inv.trainable_numel * 12  # fp32 master weights + two fp32 Adam moments
    elif recipe.train.optimizer in ("adamw_8bit", "paged_adamw_8bit") and not ds:
        big = inv.trainable_8bit_numel
        small = inv.trainable_numel - big
        optim = 2 * big + 2 * 4 * math.ceil(big / 256) + 8 * small + step_tensors
    elif recipe.train.optimizer == "muon":
        # Muon: one momentum buffer per hidden matrix; AdamW: two moments (+ a step) for the rest
        adamw_tensors = 4 * (inv.trainable_tensors - inv.muon_tensors)
        optim = inv.muon_bytes + 2 * (inv.trainable_bytes - inv.muon_bytes) + adamw_tensors
    else:
        optim = 2 * inv.trainable_bytes + step_tensors  # torch AdamW: exp_avg + exp_avg_sq in the param dtype
    return ModelStates(params, grads, optim)


def teacher_share(total: int, b: Backend, world: int) -> float:
    """A teacher's parameters on one device: sharded over the student's group where the backend shards
    parameters (FSDP2 without a multi-dimensional mesh, ZeRO-3: training.parallel.frozen), else whole."""
    if world > 1 and b.shards_parameters and not (b.kind == "fsdp" and b.mesh):
        return total / shard_group(b, world)
    return total


def shard_group(b: Backend, world: int) -> int:
    """Processes one state is sharded over: dp_shard (x cp) of a mesh under FSDP (HSDP: each replica
    shards over dp_shard only), one machine's under hybrid sharding, else every data-parallel rank
    (all processes / tp)."""
    if b.kind == "fsdp" and b.mesh:
        return b.dp_shard_size * b.cp_size
    if b.shard == "hybrid":
        return world // b.num_machines
    return max(1, world // (b.tp_size * b.cp_size))


def device_states(replica: ModelStates, inv: ModelInventory, b: Backend, world: int) -> ModelStates:
    """The replica's states per device after sharding over the data-parallel group, with what the
    backend offloads moved to host memory (counted for all processes of one machine)."""
    local = world // b.num_machines
    shard = shard_group(b, world)
    params, grads, optim, host = replica.params, replica.grads, replica.optim, 0
    if b.shard in ("optim", "grads_optim", "full", "hybrid"):
        optim //= shard
    if b.shard in ("grads_optim", "full", "hybrid"):
        grads //= shard
    if b.shard in ("full", "hybrid"):
        params //= shard
    if b.offload_optimizer:
        host += (
            optim * local + (inv.trainable_numel * 4 // shard) * local
        )  # states + fp32 gradient partitions
        optim = 0
        if b.kind == "deepspeed":  # ZeRO-Offload moves the reduced gradient partitions to the CPU too
            grads = 0
    if b.offload_params:
        host += params * local
        params = 0
        if b.kind == "fsdp":
            host += grads * local
            grads = 0
    return ModelStates(params, grads, optim, host)


def gathers_layers(b: Backend, world: int) -> bool:
    """Whether a training step gathers the parameters layer by layer (sharded over processes, or offloaded)."""
    return b.shard in ("full", "hybrid") and shard_group(b, world) > 1 or b.offload_params


def gather_buffer_bytes(inv: ModelInventory, b: Backend, world: int, compute_bytes: int) -> int:
    """The layers a sharded backend gathers for a training step: ZeRO-3's live parameters, FSDP's current and
    prefetched units; 0 where the parameters are whole on the device."""
    if not gathers_layers(b, world):
        return 0
    if b.kind == "deepspeed":
        live = b.ds.get("stage3_max_live_parameters")
        live = int(live) if isinstance(live, (int, float)) else int(1e9)
        return min(live, inv.param_numel) * compute_bytes
    return 2 * inv.largest_layer_numel * compute_bytes


def buffer_bytes(
    recipe: Recipe, inv: ModelInventory, b: Backend, world: int, grads: int, mode: str, checkpointing: bool
) -> int:
    """Gathered layers, communication buckets, autocast weight copies and module buffers, per device."""
    ds = b.kind == "deepspeed"
    compute_bytes = 4 if mode == "fp32" else 2
    buffers = inv.buffer_bytes + gather_buffer_bytes(inv, b, world, compute_bytes)
    if b.kind == "ddp" and world // (b.tp_size * b.cp_size) > 1:
        buffers += grads  # DDP's gradient buckets (gradient_as_bucket_view is off)
    if ds and b.zero_stage in (1, 2) and world > 1:
        h2 = inv.config.hidden_size**2
        sizes = (b.ds.get("reduce_bucket_size", h2), b.ds.get("allgather_bucket_size", 5e8))
        buckets = [v if isinstance(v, (int, float)) else h2 for v in sizes]
        factor = 4.5 if b.ds.get("overlap_comm") else 1.0
        buffers += int(factor * 2 * sum(min(x, inv.trainable_numel) for x in buckets))
    if mode == "autocast" and recipe.method.type != "qlora":  # bf16 copies of fp32 weights, kept for backward
        # under checkpointing: one recomputed layer's in backward, but autocast's cache holds the trainable
        # weights' copies through the whole forward (measured: 202 MiB for SmolLM2-135M, full, bf16, one
        # process). Not where FSDP gathers the weights layer by layer: accelerate gathers them in bf16
        # there (MixedPrecisionPolicy param_dtype), leaving autocast nothing to cast, so one layer's is
        # already a margin (unmeasured)
        cached = inv.largest_layer_numel
        if not gathers_layers(b, world):
            cached = max(cached, inv.autocast_cached_numel)
        buffers += (cached if checkpointing else inv.param_numel) * 2
    return buffers


def peak_bytes(
    recipe: Recipe, b: Backend, inv: ModelInventory, states: ModelStates, buffers: int, activations: int
) -> int:
    """Per device: states + buffers + the larger of the backward pass and the optimizer step.

    The optimizer step's temporaries: none for CUDA's fused AdamW and DeepSpeed's; on CPU torch's AdamW
    updates one tensor at a time (its foreach kernels are for CUDA-like devices only) and holds two
    temporaries of that tensor's size (the second moment's square root, then its division by the bias
    correction), so twice the largest trainable tensor; other optimizers on CPU: a gradient-sized
    allowance."""
    step_temp = 0
    if b.kind != "deepspeed" and b.cpu:
        step_temp = states.grads
        if recipe.train.optimizer == "adamw":
            step_temp = min(step_temp, 2 * inv.largest_trainable_bytes)
    during_backward = activations + (states.grads if recipe.train.grad_accum > 1 else 0)
    return states.params + states.optim + buffers + max(during_backward, states.grads + step_temp)


def host_bytes(inv: ModelInventory, b: Backend, world: int, states: ModelStates, peak: int) -> int:
    """Host memory of one machine: the offloaded states or, if larger, the copy made while loading
    (which comes before the offloaded states exist); CPU backends keep everything there."""
    local = world // b.num_machines
    load_copy = inv.param_bytes * local
    if b.kind == "deepspeed" and b.zero3_init:
        load_copy //= max(shard_group(b, world), 1)
    host = max(states.host, load_copy)
    if b.cpu:  # everything lives in host memory, once per process
        host += peak * local
    return host


def cpu_heap_retention(b: Backend, activations: int) -> int:
    """What a CPU process's allocator keeps beyond its live tensors: about one more step's activations.
    glibc's malloc returns a freed chunk to the system only when it is mmapped (above its dynamic mmap
    threshold, which rises to the largest chunk freed) or at the top of the heap; a step's freed activations
    mostly stay in the heap, and the next step, whose batch has another shape, cannot reuse all of them.
    Measured (docs/planner.md): peak RSS of 10 steps of SmolLM2-135M + LoRA in bf16, batches of 8 grouped
    by length, 13.5 GiB with glibc's defaults and 8.6 GiB with MALLOC_MMAP_THRESHOLD_=65536 (every large
    tensor mmapped, freed at once, at half the speed); the planner's live peak was 7.8 GiB."""
    return activations if b.cpu else 0


def fit_reasons(b: Backend, peak: int, host: int, gpu_gib: float, cpu_gib: float | None) -> list[str]:
    """What does not fit: device memory (with the CUDA context) and host memory (when a limit is given)."""
    reasons = []
    device_need = peak / GiB + CUDA_CONTEXT_GIB
    if not b.cpu and device_need > gpu_gib:
        reasons.append(f"needs {device_need:.1f} GiB per GPU > {gpu_gib:g} GiB")
    if cpu_gib is not None and host / GiB > cpu_gib:
        reasons.append(f"needs {host / GiB:.1f} GiB host memory > {cpu_gib:g} GiB")
    return reasons


def vllm_bytes(recipe: Recipe, b: Backend, gpu_gib: float) -> int:
    """rl.generator=vllm: the share of each GPU that the colocated vLLM engine takes for its copy of the
    weights and its KV cache (rl.vllm_gpu_memory_utilization of the device), counted among the buffers."""
    if recipe.rl is None or recipe.rl.generator != "vllm" or b.cpu:
        return 0
    return int(recipe.rl.vllm_gpu_memory_utilization * gpu_gib * GiB)


def relative_speed(b: Backend, world: int, checkpointing: bool) -> float:
    """Throughput relative to one GPU without checkpointing, from the scheme's efficiency and its costs."""
    if b.cpu:
        eff = 0.02
    elif world == 1 and b.kind != "deepspeed":
        eff = _EFFICIENCY["single"]
    elif b.kind == "fsdp" and b.dp_replicate_size > 1:
        eff = _EFFICIENCY["hybrid"]
    else:
        eff = _EFFICIENCY["ddp" if b.kind == "ddp" or b.shard == "none" else b.shard]
    speed = eff * (1 if b.cpu else world)
    speed *= 0.85 if b.tp_size > 1 else 1.0  # TP's all-reduces inside every layer
    speed *= 0.9 if b.sp_size > 1 or b.cp_size > 1 else 1.0  # all-to-all / ring exchanges in every attention
    speed *= 0.5 if b.offload_optimizer else 1.0
    speed *= 0.6 if b.offload_params else 1.0
    speed *= 0.8 if b.num_machines > 1 else 1.0
    speed *= 0.75 if checkpointing else 1.0
    return round(speed, 3)


def plan_backend(
    recipe: Recipe,
    inv: ModelInventory,
    file_backend: Backend,
    num_gpus: int,
    gpu_gib: float,
    cpu_gib: float | None,
    checkpointing: bool,
    num_machines: int = 1,
) -> BackendPlan:
    """Memory per device and per machine, fit and relative speed of the recipe under one backend (as its
    file says), on `num_machines` machines of `num_gpus` GPUs. Without GPUs (num_gpus 0) every file runs as
    its CPU processes, as training runs it on a CPU-only machine: the file's process count, everything in
    host memory (judged against cpu_gib when given)."""
    if num_gpus < 1:
        file_backend = dataclasses.replace(file_backend, cpu=True)
    b = planned_backend(file_backend, num_gpus, num_machines)
    m = backend_memory(recipe, inv, b, gpu_gib, checkpointing)
    refused = planner_refusal(recipe, file_backend, num_gpus, num_machines, inv.config)
    reasons = [refused] if refused else fit_reasons(b, m.peak, m.host, gpu_gib, cpu_gib)
    return BackendPlan(
        mesh=b.mesh or (f"sp={b.sp_size}" if b.sp_size > 1 else ""),
        machines=b.num_machines,
        backend=b.name,
        file=b.file,
        devices=b.num_processes,
        method=recipe.method.type,
        gradient_checkpointing=checkpointing,
        params_gib=m.states.params / GiB,
        grads_gib=m.states.grads / GiB,
        optimizer_gib=m.states.optim / GiB,
        activations_gib=m.activations / GiB,
        buffers_gib=m.buffers / GiB,
        peak_gib=m.peak / GiB,
        host_gib=m.host / GiB,
        device_limit_gib=gpu_gib,
        host_limit_gib=cpu_gib,
        fits=not reasons,
        speed=round(relative_speed(b, b.num_processes, checkpointing) * (1 - m.bubble), 3),
        reason="; ".join(reasons),
        pipeline=m.pipeline,
    )


@dataclass
class BackendMemory:
    """What one planned backend needs: states, buffers, activations and peak per device, host memory per
    machine; under pipeline stages the share of time they wait (bubble) and a line describing them."""

    states: ModelStates
    buffers: int
    activations: int
    peak: int
    host: int
    bubble: float = 0.0
    pipeline: str = ""


def backend_memory(
    recipe: Recipe, inv: ModelInventory, b: Backend, gpu_gib: float, checkpointing: bool
) -> BackendMemory:
    """The bytes of the recipe's model under the planned backend `b` (planned_backend)."""
    world = b.num_processes
    rank_inv = tp_inventory(inv, b.tp_size)  # what one tensor-parallel rank holds
    mode = precision_mode(recipe, b)
    states = device_states(replica_states(recipe, rank_inv, b), rank_inv, b, world)
    states.params += inv.reward_model_bytes + teacher_share(inv.teacher_bytes, b, world)
    buffers = buffer_bytes(recipe, rank_inv, b, world, states.grads, mode, checkpointing)
    buffers += vllm_bytes(recipe, b, gpu_gib)
    attn = "eager" if recipe.model.attn_implementation == "eager" else "sdpa"
    chunked = loss_is_chunked(recipe, b, inv.config)
    split = b.cp_size * b.sp_size  # sequence/context parallelism: each rank holds 1/split of every sequence
    saved, loss_peak = activation_bytes(recipe, inv, mode, checkpointing, attn, b.tp_size, split, chunked)
    # generation holds the gathered weights and the rollouts' cache where training holds its activations
    activations = max(saved + loss_peak, gathered_for_generation(recipe, rank_inv, b, world, mode))
    pipeline, bubble = "", 0.0  # bubble: the share of time pipeline stages wait
    if b.pp_size > 1:
        bubble = bubble_fraction(b.pp_size, b.pp_microbatches or recipe.train.batch_size)
        states, activations, pipeline = pipeline_stage(recipe, inv, b, states, saved, loss_peak)
        buffers += states.grads if b.dp_replicate_size > 1 else 0  # the flattened gradient all-reduce
    peak = peak_bytes(recipe, b, rank_inv, states, buffers, activations)
    host = host_bytes(inv, b, world, states, peak + cpu_heap_retention(b, activations))
    # model.activation_offloading: each process's saved activations in pinned host memory
    host += offloaded_bytes(recipe, inv, mode, checkpointing, attn, b.tp_size, split) * (
        world // b.num_machines
    )
    return BackendMemory(states, buffers, activations, peak, host, bubble, pipeline)


def pipeline_stage(
    recipe: Recipe, inv: ModelInventory, b: Backend, states: ModelStates, saved: int, loss_peak: int
) -> tuple[ModelStates, int, str]:
    """Per device under pipeline stages: the largest stage's share of the replica's states, and the
    activations of the micro-batches it holds at once; with a one-line description."""

    c, p = inv.config, b.pp_size
    layers = c.num_hidden_layers
    ends = c.vocab_size * c.hidden_size  # embedding (first stage) and LM head (last stage)
    per_layer = max(0, inv.param_numel - 2 * ends) / max(layers, 1)
    sizes = [len(stage_layers(layers, p, s)) * per_layer + (ends if s in (0, p - 1) else 0) for s in range(p)]
    share = max(sizes) / max(inv.param_numel, 1)
    scaled = ModelStates(*(int(v * share) for v in dataclasses.astuple(states)))
    m = b.pp_microbatches or recipe.train.batch_size
    in_flight = m if b.pp_schedule == "GPipe" else min(m, p)
    per_microbatch = saved / m * max(len(stage_layers(layers, p, 0)), 1) / max(layers, 1)
    activations = int(per_microbatch * in_flight + loss_peak / m)
    line = (
        f"{p} stages, largest {max(sizes) / 1e6:.1f}M parameters; {m} micro-batches of "
        f"{recipe.train.batch_size // m} rows, {in_flight} in flight on stage 0 ({b.pp_schedule}); "
        f"bubble {bubble_fraction(p, m):.0%}"
    )
    return scaled, activations, line


def planned_precision(recipe: Recipe, num_gpus: int) -> Recipe:
    """`precision: auto` for the machines planned for, not the one the planner runs on: bf16 on GPUs
    (Ampere and newer compute it), fp32 for a CPU-only plan (a CPU with AVX512-BF16/AMX trains in bf16:
    set precision: bf16 to plan that); LLM_FORGE_PRECISION_AUTO fixes it everywhere, as for training."""
    if (forced := forced_precision()) is not None:
        return resolve_precision(recipe, forced, "LLM_FORGE_PRECISION_AUTO")
    if num_gpus > 0:
        return resolve_precision(recipe, "bf16", "planned for GPUs with bf16")
    return resolve_precision(recipe, "no", "planned for a CPU without native bf16")


def planning_inputs(
    recipe: Recipe,
    num_gpus: int,
    gpu_memory_gib: float,
    cpu_memory_gib: float | None,
    configs_dir: str | Path | None,
    config,
    num_machines: int,
) -> tuple[Recipe, ModelInventory, list[Backend]]:
    """What every plan of a recipe starts from, its machine arguments checked: the recipe with `precision:
    auto` resolved for the machines planned for (and, without a `config` given, an image-text checkpoint read,
    so that it is planned as training builds it), its model counted on the meta device, and the backend files."""
    if num_gpus < 0:
        raise UserError(f"--num-gpus must be 0 or more (got {num_gpus})")
    if num_machines < 1:
        raise UserError(f"--num-machines must be 1 or more (got {num_machines})")
    if gpu_memory_gib <= 0:
        raise UserError(f"--gpu-memory must be positive (got {gpu_memory_gib:g} GiB)")
    if cpu_memory_gib is not None and cpu_memory_gib <= 0:
        raise UserError(f"--cpu-memory must be positive (got {cpu_memory_gib:g} GiB)")
    recipe = planned_precision(recipe, num_gpus)
    if config is None:
        recipe = resolve_image_text(recipe)
    return recipe, inventory(recipe, config), read_backends(Path(configs_dir) if configs_dir else CONFIGS_DIR)


def plan_rank(p: BackendPlan) -> tuple:
    """How plans are ordered: those that fit first, then the fastest, then the smallest peak."""
    return (not p.fits, -p.speed, p.peak_gib)


def estimate(
    recipe: Recipe,
    num_gpus: int = 1,
    gpu_memory_gib: float = 80,
    cpu_memory_gib: float | None = None,
    configs_dir: str | Path | None = None,
    config=None,
    num_machines: int = 1,
) -> list[BackendPlan]:
    """One plan per backend file (plus a gradient-checkpointing variant where that is what makes it fit),
    fastest first among those that fit; the first fitting plan is marked `recommended`. Planned for
    `num_machines` machines of `num_gpus` GPUs; host memory is judged only when `cpu_memory_gib` is given."""
    cpu_gib = cpu_memory_gib
    recipe, inv, backends = planning_inputs(
        recipe, num_gpus, gpu_memory_gib, cpu_memory_gib, configs_dir, config, num_machines
    )
    plans = []
    for b in backends:
        ckpt = recipe.model.gradient_checkpointing or b.activation_checkpointing
        p = plan_backend(recipe, inv, b, num_gpus, gpu_memory_gib, cpu_gib, ckpt, num_machines)
        plans.append(p)
        if not ckpt and _short_of_gpu_memory(p, b, recipe, num_gpus, num_machines, inv.config):
            alt = plan_backend(recipe, inv, b, num_gpus, gpu_memory_gib, cpu_gib, True, num_machines)
            if alt.fits:
                plans.append(alt)
    if not any(p.fits for p in plans):
        plans += sequence_parallel_plans(
            recipe, inv, backends, num_gpus, gpu_memory_gib, cpu_gib, num_machines
        )
    plans.sort(key=plan_rank)
    for p in plans:
        p.command = launch_command(p, recipe)
    if plans and plans[0].fits:
        plans[0].recommended = True
    return plans


def sequence_parallel_plans(
    recipe: Recipe,
    inv: ModelInventory,
    backends: list[Backend],
    num_gpus: int,
    gpu_gib: float,
    cpu_gib: float | None,
    num_machines: int,
) -> list[BackendPlan]:
    """When nothing fits as the files say (long sequences: activations grow with data.max_length): DeepSpeed
    Ulysses at the smallest sequence-parallel degree above its file's that fits the GPUs planned for (a
    degree that divides the GPUs, the attention heads and data.max_length), launched with
    `--parallelism_config_sp_size D` (accelerate's flag overrides the file); the smallest degree without
    gradient checkpointing, else the smallest with it. Empty when no degree makes it fit."""
    world = num_gpus * num_machines
    for b in (b for b in backends if b.sp_size > 1 and not b.cpu):
        for ckpt in sorted({recipe.model.gradient_checkpointing or b.activation_checkpointing, True}):
            for degree in (d for d in range(b.sp_size + 1, world + 1) if world % d == 0):
                wider = dataclasses.replace(b, sp_size=degree, num_processes=world)  # as launched
                p = plan_backend(recipe, inv, wider, num_gpus, gpu_gib, cpu_gib, ckpt, num_machines)
                if p.fits:
                    p.launch_flags = f" --parallelism_config_sp_size {degree}"
                    return [p]
    return []


def _short_of_gpu_memory(
    p: BackendPlan, b: Backend, recipe: Recipe, num_gpus: int, num_machines: int, config
) -> bool:
    """The plan is refused by nothing but GPU memory (gradient checkpointing may then make it fit)."""
    return (
        not b.cpu
        and p.peak_gib + CUDA_CONTEXT_GIB > p.device_limit_gib
        and not planner_refusal(recipe, b, num_gpus, num_machines, config)
    )


# ----------------------------------------------------------------------------- output


def launch_command(p: BackendPlan, recipe: Recipe, recipe_path: str = "RECIPE.yaml") -> str:
    rel = (
        os.path.relpath(p.file, ROOT)
        if Path(p.file).is_absolute() and Path(p.file).is_relative_to(ROOT)
        else p.file
    )
    nproc = f" --num_processes {p.devices}" if "single" not in p.backend else ""
    if p.machines > 1:  # run on every machine, with its rank and machine 0's address
        nproc += (
            f" --num_machines {p.machines} --machine_rank $MACHINE_RANK --main_process_ip $MAIN_PROCESS_IP"
        )
    extra = (
        " model.gradient_checkpointing=true"
        if p.gradient_checkpointing and not recipe.model.gradient_checkpointing
        else ""
    )
    return (
        f"accelerate launch --config_file {rel}{nproc}{p.launch_flags} -m training.train {recipe_path}{extra}"
    )
