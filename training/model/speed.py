"""Model FLOPs per token, peak FLOPS of common GPUs, and model FLOPs utilisation (MFU).

Convention (PaLM appendix B, as used by nanoGPT/torchtitan): the forward pass of one token costs
2 FLOPs per weight of every matmul (attention projections, MLP, LM head; the embedding lookup is
free) plus 2*2*seq*d_attn per layer for the attention scores and the weighted sum (the full square,
not halved for causality). Training costs 3x the forward (the backward computes gradients for
inputs and for weights). Frozen weights (LoRA/QLoRA base) cost 2x (forward + input gradients).
Recomputation by gradient checkpointing is not counted: this is MFU, not hardware FLOPs utilisation.

`speed_report` states once per run what it really uses (attention implementation, torch.compile,
Liger, FLOPs per token, device peak) and turns its tokens/s into MFU.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import asdict, dataclass

import torch

from training.config import Recipe
from training.core.errors import RecipeError

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


def precision_key(precision: str, weight_dtype: str) -> str:
    """Which peak applies: bf16/fp16 mixed precision or half weights -> 'bf16'; fp32 -> 'tf32' or 'fp32'."""
    if precision in ("bf16", "fp16") or weight_dtype in ("bfloat16", "float16"):
        return "bf16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device: torch.device, precision: str = "bf16", weight_dtype: str = "float32") -> float | None:
    """Peak FLOP/s of one device for this precision; None on CPU or an unknown GPU (then MFU is not reported)."""
    if device.type != "cuda":
        return None
    key = gpu_key(torch.cuda.get_device_name(device))
    if key is None:
        return None
    return PEAK_FLOPS[key].get(precision_key(precision, weight_dtype))


def _dims(config) -> dict[str, int]:
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return dict(
        h=h,
        # MLP width; GPT-2's is n_inner (None: 4*h) and ungated (2 matrices, not Llama's 3). Other
        # types are counted as Llama-shaped (an approximation: an MoE counts one expert, not top-k)
        f=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h,
        mlp=3 if hasattr(config, "intermediate_size") else 2,
        layers=config.num_hidden_layers,
        q=heads * head_dim,
        kv=kv * head_dim,
        vocab=config.vocab_size,
    )


def matmul_params(config) -> int:
    """Weights that take part in a matmul per token: q/k/v/o and gate/up/down per layer, plus the LM head."""
    d = _dims(config)
    per_layer = d["h"] * d["q"] + 2 * d["h"] * d["kv"] + d["q"] * d["h"] + d["mlp"] * d["h"] * d["f"]
    return d["layers"] * per_layer + d["h"] * d["vocab"]


def attention_flops_per_token(config, seq_len: int) -> int:
    """Forward FLOPs of QK^T and scores@V for one token at this sequence length (all layers)."""
    d = _dims(config)
    return d["layers"] * 2 * 2 * seq_len * d["q"]


def forward_flops_per_token(config, seq_len: int) -> int:
    return 2 * matmul_params(config) + attention_flops_per_token(config, seq_len)


def training_flops_per_token(
    config, seq_len: int, trainable_matmul_params: int | None = None, extra_trainable_params: int = 0
) -> int:
    """Model FLOPs to train on one token.

    Full training: 3 x forward. With adapters, pass `trainable_matmul_params=0` (the base is frozen:
    forward + input gradients, 2 x) and `extra_trainable_params` = the adapter weights (3 x 2 FLOPs each).
    """
    n = matmul_params(config)
    trainable = n if trainable_matmul_params is None else trainable_matmul_params
    frozen = n - trainable
    attention = attention_flops_per_token(config, seq_len)
    return 6 * trainable + 4 * frozen + 3 * attention + 6 * extra_trainable_params


def model_training_flops_per_token(model, seq_len: int) -> int:
    """training_flops_per_token for a built (possibly peft-wrapped) model: LoRA weights counted as adapters."""
    config = model.config
    lora = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    if lora:
        return training_flops_per_token(
            config, seq_len, trainable_matmul_params=0, extra_trainable_params=lora
        )
    return training_flops_per_token(config, seq_len)


def mfu(
    tokens_per_s: float, flops_per_token: float | None, peak_per_device: float | None, num_devices: int = 1
) -> float | None:
    """Achieved model FLOP/s over the devices' peak; None when the peak is unknown (CPU, unknown GPU)."""
    if not peak_per_device or not flops_per_token:
        return None
    return tokens_per_s * flops_per_token / (peak_per_device * num_devices)


@dataclass
class SpeedReport:
    attn_implementation: str | None
    torch_compile: bool
    liger_kernels: bool
    flops_per_token: int
    peak_flops: float | None  # per device, FLOP/s; None on CPU or an unlisted GPU
    num_devices: int
    loss_impl: str | None = (
        None  # training.objectives.next_token: chunked / liger / cut_cross_entropy / full (and why)
    )

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation of the global tokens/s against all devices' peak."""
        return mfu(tokens_per_s, self.flops_per_token, self.peak_flops, self.num_devices)

    def as_row(self) -> dict:
        return asdict(self)


def speed_report(model, recipe: Recipe, accelerator, loss=None) -> SpeedReport:
    """What this run really uses, from the built (not yet prepared) model; logged once. `loss`: the
    training.objectives.next_token.LossChoice of the run."""
    config = getattr(model, "config", None)
    report = SpeedReport(
        attn_implementation=getattr(config, "_attn_implementation", None),
        torch_compile=recipe.train.torch_compile,
        liger_kernels=recipe.model.liger_kernels,
        flops_per_token=model_training_flops_per_token(model, recipe.data.max_length),
        peak_flops=peak_flops(accelerator.device, recipe.precision, recipe.model.dtype),
        num_devices=accelerator.num_processes,
        loss_impl=loss.describe() if loss is not None else None,
    )
    device = accelerator.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
    peak = "unknown (MFU not reported on CPU or an unlisted GPU)"
    if report.peak_flops:
        peak = f"{report.peak_flops / 1e12:.0f} TFLOP/s"
    log.info(
        "speed: device %s, attention %s, loss %s, torch.compile %s, Liger %s, %.3g model FLOPs/token, "
        "device peak %s",
        name,
        report.attn_implementation,
        report.loss_impl,
        "on" if report.torch_compile else "off",
        "on" if report.liger_kernels else "off",
        report.flops_per_token,
        peak,
    )
    return report


def mfu_postfix(value: float | None) -> dict:
    """The progress bar's MFU field, when MFU is known."""
    return {"mfu": f"{value:.1%}"} if value is not None else {}


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
