"""The plan as people read it: the table, the launch command of each configuration, the machines and host
lines, the Mixture-of-Experts line and the data scale."""

from __future__ import annotations

from pathlib import Path

from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from training.config import Recipe
from training.config.architectures import router_shape
from training.core.paths import CONFIGS_DIR
from training.data.scale import scale_lines
from training.data.tokenizer import load_tokenizer
from training.launch.backend import read_backends
from training.launch.refusals import ULYSSES_FILE
from training.model.vision import resolve_image_text
from training.planning.inventory import model_config
from training.planning.memory import CUDA_CONTEXT_GIB, BackendPlan


def format_plan(plans: list[BackendPlan]) -> str:
    """A markdown table (GiB per device, host GiB per machine) and a recommendation line."""
    head = (
        "| backend | GPUs | method | ckpt | params | grads | optimizer | activations | buffers | peak/GPU | host | fits | speed |\n"
        "|---|---:|---|:-:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|"
    )
    rows = []
    for p in plans:
        mark = "**yes**" if p.recommended else ("yes" if p.fits else f"no: {p.reason}")
        name = f"{p.backend} ({p.mesh})" if p.mesh else p.backend
        rows.append(
            f"| {name} | {p.devices} | {p.method} | {'on' if p.gradient_checkpointing else 'off'} | {p.params_gib:.2f} | "
            f"{p.grads_gib:.2f} | {p.optimizer_gib:.2f} | {p.activations_gib:.2f} | {p.buffers_gib:.2f} | {p.peak_gib:.2f} | "
            f"{p.host_gib:.1f} | {mark} | {p.speed:.2f} |"
        )
    best = next((p for p in plans if p.recommended), None)
    if best is None:
        line = (
            "**Nothing fits.** Try more GPUs (--num-gpus), an offload config, model.gradient_checkpointing=true, "
            "a smaller train.batch_size or data.max_length, method.type=lora/qlora, or for long sequences "
            f"sequence parallelism over more GPUs ({ULYSSES_FILE})."
        )
    else:
        extra = ", with gradient checkpointing" if best.gradient_checkpointing else ""
        line = (
            f"**Recommended: {best.backend}** on {best.devices} device(s){extra}, the fastest configuration that fits "
            f"({best.peak_gib:.1f} GiB peak per device): `{best.command}`"
        )
    legend = (
        f"GiB per device; host = GiB of CPU memory per machine (offloaded states, or the copy made while loading if larger). "
        f"A configuration fits when peak + {CUDA_CONTEXT_GIB} GiB CUDA context <= the GPU memory. "
        f"speed = estimated throughput relative to one GPU. A mesh (in brackets) runs on exactly the processes it "
        f"multiplies to; tensor parallelism (tp) divides the layers its plan splits by tp; sequence (sp, DeepSpeed "
        f"Ulysses) and context (cp) parallelism divide the activations of every sequence by sp / cp."
    )
    stages = [f"- {p.backend}: {p.pipeline}" for p in plans if p.pipeline and not p.gradient_checkpointing]
    if stages:
        stages.insert(
            0, "Pipeline stages (per device: the largest stage; more micro-batches shrink the bubble):"
        )
    return "\n".join([head, *rows, "", legend, machines_line(plans), host_line(plans), *stages, "", line])


def moe_line(recipe: Recipe, configs_dir: Path | str = CONFIGS_DIR, config=None) -> str | None:
    """A Mixture-of-Experts model's total and active (per token) parameters, its expert parameters per
    device under each expert-parallel config, and a recommendation; None for a dense model."""

    config = config if config is not None else model_config(recipe)
    shape = router_shape(config)
    if shape is None:
        return None
    experts, top_k = shape
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert + expert * top_k // experts
    line = (
        f"**MoE**: {experts} experts per layer, {top_k} per token: {total / 1e6:.1f}M parameters in all, "
        f"{active / 1e6:.1f}M active per token; experts hold {expert / 1e6:.1f}M"
    )
    eps = sorted({b.ep_size for b in read_backends(Path(configs_dir)) if b.ep_size > 1})
    for ep in eps:
        ok = experts % ep == 0
        line += (
            f"; under expert parallelism over {ep} processes {expert / ep / 1e6:.1f}M expert parameters per "
            f"device ({total - expert + expert // ep:,} parameters per device)"
            if ok
            else f"; ep_size {ep} does not divide {experts} experts"
        )
    if eps and expert > total / 2 and recipe.method.type == "full":
        line += ". Recommended: ep.yaml when the experts dominate memory (they do here: "
        line += f"{expert / total:.0%} of the parameters)"
    return line


def machines_line(plans: list[BackendPlan]) -> str:
    machines = max((p.machines for p in plans), default=1)
    if machines > 1:
        return (
            f"Planned for {machines} machines (--num-machines): run the command on every machine, with "
            f"MACHINE_RANK=0..{machines - 1} and MAIN_PROCESS_IP = machine 0's address."
        )
    return "Planned for one machine (--num-machines 1): multi-node configs are not candidates."


def host_line(plans: list[BackendPlan]) -> str:
    """What was assumed about host memory, and why."""
    limit = next((p.host_limit_gib for p in plans), None)
    if limit is None:
        need = max((p.host_gib for p in plans if p.fits), default=0.0)
        return (
            "Host memory: no limit assumed (no --cpu-memory given; the machine the planner runs on need not be "
            f"the one that trains), so host memory was not judged; the fitting plans need up to {need:.1f} GiB "
            "per machine (host column). Give --cpu-memory to judge it."
        )
    return f"Host memory: judged against {limit:g} GiB per machine (--cpu-memory)."


def print_data_scale(recipe, world: int) -> None:
    """Tokens in the corpus, per step, steps per epoch, preprocessing time (training/data/scale.py)."""

    try:
        # an image-text checkpoint's records are tokenized as training does
        recipe = resolve_image_text(recipe)
        tokenizer = load_tokenizer(recipe.model, recipe.data.images)
        lines = scale_lines(recipe, tokenizer, max(1, world), recipe.train.max_steps)
    except Exception as e:  # the plan stands without it (hub data offline, a tokenizer not at hand)
        lines = [f"data scale: not estimated ({str(e).splitlines()[0] if str(e) else type(e).__name__})"]
    print("\n".join(lines))
