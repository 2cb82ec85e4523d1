"""Model FLOPs of a training step, the devices' peak FLOP/s, and model FLOPs utilisation (MFU).

Convention (PaLM appendix B, as used by nanoGPT/torchtitan): the forward pass of one token costs
2 FLOPs per weight of every matmul (attention projections, MLP, LM head; the embedding lookup is
free) plus 2*2*seq*d_attn per layer for the attention scores and the weighted sum (the full square,
not halved for causality). Training costs 3x the forward (the backward computes gradients for
inputs and for weights). Frozen weights (LoRA/QLoRA base) cost 2x (forward + input gradients).
Recomputation by gradient checkpointing is not counted: this is MFU, not hardware FLOPs utilisation.

A step's FLOPs are counted from its batches, not from max_length (`FlopsPerUnit`, `batch_flops`):
body matmuls per real token (padding excluded), attention per document from the documents' real
lengths (sum of L^2: packed documents separately, padded rows at their unpadded length), and the output
head per position it computes: only the labelled ones under the chunked/fused next-token loss
(training.objectives.next_token), every real token where the model returns whole logits.

The peak: a GPU's from the datasheet table below; a CPU's is measured, torch.mm at the model's shapes
in the run's dtype and threads, cached per machine (training.model.matmul_ceiling).
MFU = step FLOPs / step seconds / (peak per device x devices).

`speed_report` states once per run what it really uses (attention implementation, torch.compile,
Liger, FLOPs per token, device peak and where it comes from).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import asdict, dataclass

import torch

from training.config import Recipe, matmul_dtype
from training.core import pages
from training.core.batch import labelled_tokens, real_tokens, squared_lengths
from training.core.dtypes import DTYPES
from training.core.errors import RecipeError
from training.model import layer_config
from training.model.matmul_ceiling import Ceiling, busy, forget, matmul_ceiling, vector_bound

log = logging.getLogger(__name__)

# Dense (no structured sparsity) peak tensor throughput per GPU, FLOP/s, from NVIDIA datasheets.
# "bf16" also stands for fp16; "tf32" is used for fp32 matmuls when TF32 is allowed.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 SXM": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 NVL": {"bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12},
    "H100 PCIe": {"bf16": 756.0e12, "tf32": 378.0e12, "fp32": 51.2e12},
    "A100": {"bf16": 312.0e12, "tf32": 156.0e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "tf32": 183.0e12, "fp32": 91.6e12},
    "L40": {"bf16": 181.05e12, "tf32": 90.5e12, "fp32": 90.5e12},
    "L4": {"bf16": 121.0e12, "tf32": 60.0e12, "fp32": 30.3e12},
    "A10G": {"bf16": 125.0e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "A10": {"bf16": 125.0e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71.0e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "V100": {"bf16": 125.0e12, "fp32": 15.7e12},  # fp16 only (no bf16 tensor cores)
    "T4": {"bf16": 65.0e12, "fp32": 8.1e12},  # fp16 only
}

# torch.cuda.get_device_name() spellings -> table key; the first match wins, so specific names come first.
_NAME_PATTERNS = [
    ("h200", "H200"),
    ("h100 nvl", "H100 NVL"),
    ("h100 pcie", "H100 PCIe"),
    ("h100", "H100 SXM"),
    ("a100", "A100"),
    ("l40s", "L40S"),
    ("l40", "L40"),
    ("l4", "L4"),
    ("a10g", "A10G"),
    ("a10", "A10"),
    ("4090", "RTX 4090"),
    ("3090", "RTX 3090"),
    ("v100", "V100"),
    ("t4", "T4"),
]


def gpu_key(device_name: str) -> str | None:
    """The PEAK_FLOPS key for a CUDA device name such as 'NVIDIA H100 80GB HBM3', or None if unknown."""
    name = device_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if pattern in name:
            return key
    return None


def compute_dtype(precision: str, weight_dtype: str) -> torch.dtype:
    """The dtype the matmuls run in (training.config.matmul_dtype), as a torch dtype."""
    return DTYPES[matmul_dtype(precision, weight_dtype)]


def precision_key(precision: str, weight_dtype: str) -> str:
    """Which GPU peak applies: bf16/fp16 mixed precision or half weights -> 'bf16'; fp32 -> 'tf32' or 'fp32'."""
    if compute_dtype(precision, weight_dtype) != torch.float32:
        return "bf16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device: torch.device, precision: str = "bf16", weight_dtype: str = "float32") -> float | None:
    """A GPU's datasheet peak FLOP/s for this precision; None for an unlisted GPU and for a CPU, whose
    ceiling is measured instead (`device_peak`)."""
    if device.type != "cuda":
        return None
    key = gpu_key(torch.cuda.get_device_name(device))
    if key is None:
        return None
    return PEAK_FLOPS[key].get(precision_key(precision, weight_dtype))


def mlp_shapes(config) -> list[tuple[int, int]]:
    """(k, n) of the MLP's matmuls, [tokens, k] @ [k, n]: the shapes a CPU's ceiling is measured at."""
    d = _dims(config)
    return [(d["h"], d["f"]), (d["f"], d["h"])]


def device_peak(device: torch.device, precision: str, weight_dtype: str, config, rows: int) -> Ceiling:
    """The peak FLOP/s of one device (None: unknown) and how it was obtained: a GPU's from the datasheet
    table, a CPU's measured with torch.mm at the model's MLP shapes and `rows` tokens
    (training.model.matmul_ceiling)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(device, precision, weight_dtype)
        if peak is None:
            return Ceiling(None, f"unknown ({name} is not in the peak table: MFU not reported)")
        key = precision_key(precision, weight_dtype)
        return Ceiling(peak, f"{peak / 1e12:.0f} TFLOP/s ({gpu_key(name)} datasheet, {key})")
    if device.type == "cpu":
        return matmul_ceiling(mlp_shapes(config), rows, compute_dtype(precision, weight_dtype))
    return Ceiling(None, f"unknown on {device.type} (MFU not reported)")


def _dims(config) -> dict[str, int]:
    # an image-text model (model.vision) is counted by its language model: the vision encoder's FLOPs per
    # image are not in the count (a known gap: such runs' MFU reads low by the encoder's share)
    config = getattr(config, "text_config", None) or config
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = layer_config.mean(config, "head_dim") or h // heads  # Gemma 4's differ per layer
    kv = getattr(config, "num_key_value_heads", None) or heads
    return dict(
        h=h,
        # MLP width; GPT-2's is n_inner (None: 4*h) and ungated (2 matrices, not Llama's 3). Other
        # types are counted as Llama-shaped (an approximation: an MoE counts one expert, not top-k)
        f=layer_config.mean(config, "intermediate_size") or getattr(config, "n_inner", None) or 4 * h,
        mlp=3 if hasattr(config, "intermediate_size") else 2,
        layers=config.num_hidden_layers,
        q=heads * head_dim,
        kv=kv * head_dim,
        vocab=config.vocab_size,
    )


def matmul_params(config, outputs: int | None = None) -> int:
    """Weights that take part in a matmul per token: q/k/v/o and gate/up/down per layer, plus the head."""
    d = _dims(config)
    per_layer = d["h"] * d["q"] + 2 * d["h"] * d["kv"] + d["q"] * d["h"] + d["mlp"] * d["h"] * d["f"]
    return d["layers"] * per_layer + head_params(config, outputs)


def head_params(config, outputs: int | None = None) -> int:
    """The output head's weights: hidden x vocabulary, or x `outputs` (a reward model's one score)."""
    d = _dims(config)
    return d["h"] * (outputs or d["vocab"])


def attention_flops_per_token(config, seq_len: int) -> int:
    """Forward FLOPs of QK^T and scores@V for one token at this sequence length (all layers)."""
    d = _dims(config)
    return d["layers"] * 2 * 2 * seq_len * d["q"]


def forward_flops_per_token(config, seq_len: int) -> int:
    return 2 * matmul_params(config) + attention_flops_per_token(config, seq_len)


@dataclass(frozen=True)
class FlopsPerUnit:
    """Training FLOPs split by what they scale with, so that a step is counted from its real batches."""

    token: int  # per real (non-padding) token: the body's matmuls, and the adapters'
    head: int  # per position whose logits the output head computes
    attention: int  # per unit of squared sequence length: a document of L tokens costs attention * L^2

    def per_token(self, seq_len: int) -> int:
        """One token of a sequence of seq_len tokens, every position's logits computed."""
        return self.token + self.head + self.attention * seq_len

    def of(self, tokens, head_positions, squared_lengths):
        """The FLOPs of `tokens` real tokens, `head_positions` logits positions and documents whose squared
        lengths sum to `squared_lengths` (ints, or tensors of counts)."""
        return self.token * tokens + self.head * head_positions + self.attention * squared_lengths


def training_flops(
    config, frozen_base: bool = False, adapter_params: int = 0, head_outputs: int | None = None
) -> FlopsPerUnit:
    """The training FLOPs of a model: 3 x forward for trained weights; with `frozen_base` (LoRA/QLoRA) the
    base's weights cost 2 x (forward + input gradients) and the `adapter_params` adapter weights 3 x 2 each.
    Attention's matmuls have no weights: 3 x forward either way. `head_outputs`: the head's width where it
    is not the vocabulary (a reward model's score head: 1)."""
    per_weight = 4 if frozen_base else 6
    head = head_params(config, head_outputs)
    return FlopsPerUnit(
        token=per_weight * (matmul_params(config, head_outputs) - head) + 6 * adapter_params,
        head=per_weight * head,
        attention=3 * attention_flops_per_token(config, 1),
    )


def training_flops_per_token(config, seq_len: int, frozen_base: bool = False, adapter_params: int = 0) -> int:
    """Model FLOPs to train on one token of a seq_len-token sequence (training_flops, every position
    computing logits)."""
    return training_flops(config, frozen_base, adapter_params).per_token(seq_len)


def model_training_flops(model) -> FlopsPerUnit:
    """training_flops of a built (possibly peft-wrapped) model: LoRA weights counted as adapters, and a
    sequence classifier's head (a reward model) as num_labels wide."""
    lora = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    scores = any(type(m).__name__.endswith("ForSequenceClassification") for m in model.modules())
    outputs = model.config.num_labels if scores else None
    return training_flops(model.config, frozen_base=bool(lora), adapter_params=lora, head_outputs=outputs)


def mfu(flops_per_s: float, peak_per_device: float | None, num_devices: int = 1) -> float | None:
    """Achieved model FLOP/s over the devices' peak; None when the peak is unknown (an unlisted GPU)."""
    if not peak_per_device:
        return None
    return flops_per_s / (peak_per_device * num_devices)


def head_on_labelled_only(recipe: Recipe, loss_impl: str | None) -> bool:
    """Whether the output head computes logits for the labelled positions only (MFU counts the head there): the
    chunked or fused next-token loss (SFT, pretraining, distillation), and the RL and preference objectives
    (logits from the first scored token on, training.model.logits: the unscored positions among them are not
    counted). A reward model's score head runs on every position."""
    if recipe.rl is not None:
        return True
    if recipe.preference is not None:
        return recipe.preference.objective != "reward"
    return loss_impl in ("chunked", "liger", "cut_cross_entropy")


def loss_label(recipe: Recipe, loss) -> str | None:
    """The start-up line's loss: the next-token loss's choice (LossChoice.describe) where it makes the
    logits; the objective's own where a preference or RL objective takes them instead."""
    if loss is None:
        return None
    if recipe.preference is not None and recipe.preference.objective == "reward":
        return "whole logits (the reward model's score head)"
    if recipe.preference is not None or recipe.rl is not None:
        return "the scored positions' logits (the objective's per-token log-probabilities)"
    return loss.describe()


@dataclass
class SpeedReport:
    attn_implementation: str | None
    torch_compile: bool
    liger_kernels: bool
    # per token at max_length, every position computing logits: the start-up figure
    flops_per_token: int
    # per device, FLOP/s: a GPU's datasheet peak or a CPU's measured matmul ceiling; None if unknown
    peak_flops: float | None
    num_devices: int
    # training.objectives.next_token: chunked / liger / cut_cross_entropy / full (and why)
    loss_impl: str | None = None
    # where peak_flops comes from: a datasheet, measured (and cached), LLM_FORGE_CPU_PEAK_FLOPS
    peak_source: str | None = None
    unit: FlopsPerUnit | None = None  # how a step's FLOPs are counted from its batches
    head_labelled_only: bool = False  # the head computes logits of labelled positions only
    ceiling_key: str | None = None  # a CPU's cached ceiling (forgotten if a step proves it too low)
    bound: float | None = None  # a CPU's vector-unit bound: the peak once a step has outrun the ceiling

    def batch_flops(self, batch: dict) -> torch.Tensor:
        """Model FLOPs of training on one batch (float64 tensor on the batch's device): its real tokens,
        its documents' real lengths, and the positions the head computes."""
        heads = labelled_tokens(batch) if self.head_labelled_only else real_tokens(batch)
        return self.unit.of(real_tokens(batch).double(), heads.double(), squared_lengths(batch).double())

    def window_flops(self, batches: list[dict], device: torch.device) -> torch.Tensor:
        """Model FLOPs of training on this rank's batches of a window: a float64 tensor on `device`."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batches:
            total += self.batch_flops(batch).to(device)
        return total

    def mfu(self, flops_per_s: float) -> float | None:
        """Model FLOPs utilisation of the global model FLOP/s against all devices' peak, never over 1: a step
        faster than the peak proves the peak wrong (a CPU ceiling measured while the machine was busy), so the
        cached figure is forgotten and MFU is taken against the vector units' bound from then on, or not
        reported (None) where even that is passed."""
        value = mfu(flops_per_s, self.peak_flops, self.num_devices)
        if value is None or value <= 1:
            return value
        per_device = flops_per_s / self.num_devices
        log.warning(
            "MFU: the run reached %.3g GFLOP/s per device, over its peak of %.3g (%s): that peak read low; %s",
            per_device / 1e9,
            self.peak_flops / 1e9,
            self.peak_source,
            "taking MFU against the vector units' bound from now on" if self.bound else "MFU not reported",
        )
        forget(self.ceiling_key)  # the next run measures again
        self.peak_flops, self.ceiling_key, self.bound = self.bound, None, None
        self.peak_source = (
            "the vector units' bound (the measured ceiling read low)" if self.peak_flops else None
        )
        value = mfu(flops_per_s, self.peak_flops, self.num_devices)
        if value is not None and value > 1:
            return self.mfu(flops_per_s)  # past the bound too: not reported
        return value

    def as_row(self) -> dict:
        row = asdict(self)
        row.pop("ceiling_key")
        unit = row.pop("unit") or {}
        names = {"token": "real_token", "head": "logits_position", "attention": "squared_length"}
        row.update({f"flops_per_{names[k]}": v for k, v in unit.items()})
        return row


def speed_report(model, recipe: Recipe, accelerator, loss=None) -> SpeedReport:
    """What this run really uses, from the built (not yet prepared) model; logged once. `loss`: the
    training.objectives.next_token.LossChoice of the run."""
    config = getattr(model, "config", None)
    device = accelerator.device
    unit = model_training_flops(model)
    peak = Ceiling(None, "measured by the main process")
    if accelerator.is_main_process:  # the one that writes metrics; a CPU probe runs while the others wait
        rows = recipe.train.batch_size * recipe.data.max_length
        peak = device_peak(device, recipe.precision, recipe.model.dtype, config, rows)
    bound = None
    if device.type == "cpu":
        bound = vector_bound(compute_dtype(recipe.precision, recipe.model.dtype))
    report = SpeedReport(
        attn_implementation=getattr(config, "_attn_implementation", None),
        torch_compile=recipe.train.torch_compile,
        liger_kernels=recipe.model.liger_kernels,
        flops_per_token=unit.per_token(recipe.data.max_length),
        peak_flops=peak.flops,
        num_devices=accelerator.num_processes,
        loss_impl=loss_label(recipe, loss),
        peak_source=peak.description,
        unit=unit,
        head_labelled_only=head_on_labelled_only(recipe, loss.impl if loss is not None else None),
        ceiling_key=peak.key,
        bound=bound,
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
    log.info(
        "speed: device %s, attention %s, loss %s, torch.compile %s, Liger %s, %.3g model FLOPs/token at "
        "max_length (each step counts its real lengths), device peak %s, host memory: %s",
        name,
        report.attn_implementation,
        report.loss_impl,
        "on" if report.torch_compile else "off",
        "on" if report.liger_kernels else "off",
        report.flops_per_token,
        peak.description,
        pages.state(),
    )
    return report


def mfu_postfix(value: float | None) -> dict:
    """The progress bar's MFU field, when MFU is known (a GPU in the peak table, or a CPU)."""
    return {"mfu": f"{value:.1%}"} if value is not None else {}


def cpu_compile_warning(torch_compile: bool, device_type: str) -> str | None:
    """The start-up warning for train.torch_compile on a CPU, where it has measured slower than eager on
    both CPU kinds tried (docs/benchmarks.md, "torch.compile on CPU"); None elsewhere. A warning, not a
    refusal: other CPUs, torch versions and models may differ."""
    if not torch_compile or device_type != "cpu":
        return None
    return (
        "train.torch_compile=true on CPU: slower than eager wherever we measured it (0.93-0.94x on "
        "length-grouped batches after 3-4 minutes of compiling in the first step, on an AVX2 and an "
        "AVX512-BF16 CPU; 0.64x with data.packing; docs/benchmarks.md); set it to false unless your own "
        "measurement says otherwise"
    )


def cpu_sharing_warning(device_type: str, threads: int | None = None, load: str | None = None) -> str | None:
    """The start-up warning for a CPU that other work already keeps busy (`load`: matmul_ceiling.busy's reason,
    '' when it is not; read now by default) while torch runs several threads per process (`threads`, torch's
    own count by default); None elsewhere. OpenMP threads that share their cores with another job wait on each
    other at every operator: an agent RL step beside another 2-thread job took 1517 s with 2 threads and 63 s
    with 1 (2-core Zen 4, docs/rl.md)."""
    if device_type != "cpu":
        return None
    threads = torch.get_num_threads() if threads is None else threads
    load = busy() if load is None else load
    if threads < 2 or not load:
        return None
    return (
        f"the CPU is shared ({load}) and torch runs {threads} threads per process: threads that share their "
        "cores with another job wait on each other (an agent RL step took 24x longer where we measured it); run one "
        "job at a time, or give each its own cores (OMP_NUM_THREADS)"
    )


def check_speed_options(recipe: Recipe, device: torch.device) -> None:
    """Refuse speed options whose package this machine lacks, before anything loads. Liger kernels on a
    device without CUDA are refused earlier, with the other rules, by training.launch.refusals.refusal."""
    if (
        recipe.model.liger_kernels
        and device.type == "cuda"
        and importlib.util.find_spec("liger_kernel") is None
    ):
        raise RecipeError(
            "model.liger_kernels=true needs the liger-kernel package: pip install liger-kernel (or set it to false)"
        )
