"""Quantization-aware training (method.qat) with torchao.

Before training, every linear layer but the output head becomes torchao's FakeQuantizedLinear
(`quantize_(model, QATConfig(scheme, step="prepare"))`): its weights (and, for int8-int4, its input
activations) are quantized and dequantized in each forward, with straight-through gradients, so training
finds weights that keep their accuracy once quantized. The parameters keep their names and float values:
checkpoints, resume and every data-parallel backend are those of full fine-tuning, and final/ is a plain
float model. Loading final/ with transformers' `TorchAoConfig(<the same scheme>)` quantizes it on load
(torchao's convert step): that model computes exactly what the fake-quantized training forward computed
(tests/integration/test_qat.py); the model card says how (QAT.load_snippet).

`scheme: float8` is FP8 training behind the same key (torchao float8: the linear layers' matmuls in FP8
with dynamic scaling), on CUDA GPUs with FP8 tensor cores only, refused elsewhere with the reason.
"""

from __future__ import annotations

import logging

import torch

from training.config import Recipe
from training.config.schema import QAT
from training.core.errors import RecipeError

log = logging.getLogger(__name__)


def base_config(qat: QAT):
    """The torchao post-training quantization config that QAT simulates (and that loading final/ applies)."""
    try:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup
    except ImportError:
        raise RecipeError(
            "method.qat needs torchao: pip install 'llm-forge[qat]' (torchao), or remove method.qat"
        ) from None
    group = PerGroup(qat.group_size)
    if qat.scheme == "int8-int4":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=group)
    return IntxWeightOnlyConfig(
        weight_dtype=torch.int4 if qat.scheme == "int4" else torch.int8, granularity=group
    )


def quantized_linears(model) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers QAT quantizes: all but the output head (kept in float, as torchao's and
    ExecuTorch's recipes do; it is often tied to the embeddings)."""
    head = model.get_output_embeddings()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores


def fp8_refusal(device: torch.device) -> str | None:
    """Why FP8 training cannot run on `device` (None if it can)."""
    if device.type != "cuda":
        return f"FP8 training needs a CUDA GPU with FP8 tensor cores (Ada/Hopper or newer); this run is on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"FP8 training needs FP8 tensor cores (compute capability 8.9+); {name} has {capability[0]}.{capability[1]}"
    return None


def convert_float8(model) -> int:
    """The linear layers whose sizes FP8 matmuls take (multiples of 16), the output head excepted, made
    torchao Float8Linear (dynamic scaling); how many."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise RecipeError("method.qat needs torchao: pip install 'llm-forge[qat]' (torchao)") from None
    head = model.get_output_embeddings()

    def fits(m, fqn):
        return (
            isinstance(m, torch.nn.Linear)
            and m is not head
            and m.in_features % 16 == 0
            and m.out_features % 16 == 0
        )

    chosen = sum(1 for n, m in model.named_modules() if fits(m, n))
    convert_to_float8_training(model, module_filter_fn=fits)
    return chosen


def apply_float8(model, device: torch.device) -> None:
    """FP8 training (torchao float8) where the device has FP8 tensor cores; refused elsewhere."""
    if why := fp8_refusal(device):
        raise RecipeError(
            f"method.qat.scheme float8: {why}; use int8-int4/int4/int8 (QAT) or remove method.qat"
        )
    log.info(
        "FP8 training: %d linear layers compute in float8 (torchao, dynamic scaling)", convert_float8(model)
    )


def apply_qat(model, recipe: Recipe, device: torch.device | None = None) -> None:
    """Swap the quantized linear layers for torchao's fake-quantized ones (in place); scheme float8: FP8
    training instead (apply_float8)."""
    qat = recipe.method.qat
    if qat.scheme == "float8":
        apply_float8(model, device or torch.device("cpu"))
        return
    config = base_config(qat)
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    linears = quantized_linears(model)
    for name, m in linears:
        if m.in_features % qat.group_size:
            raise RecipeError(
                f"method.qat.group_size: {qat.group_size} does not divide {name}'s {m.in_features} input "
                f"features; pick a divisor (e.g. 32)"
            )
    chosen = {id(m) for _, m in linears}
    quantize_(model, QATConfig(config, step="prepare"), filter_fn=lambda m, fqn: id(m) in chosen)
    log.info(
        "QAT: %d linear layers fake-quantized (%s, groups of %d); the output head stays in float",
        len(linears),
        qat.scheme,
        qat.group_size,
    )
