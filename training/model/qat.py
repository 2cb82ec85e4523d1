"""Quantization-aware training (method.qat) with torchao.

Before training, every linear layer but the output head becomes torchao's FakeQuantizedLinear
(`quantize_(model, QATConfig(scheme, step="prepare"))`): its weights (and, for int8-int4, its input
activations) are quantized and dequantized in each forward, with straight-through gradients, so training
finds weights that keep their accuracy once quantized. The parameters keep their names and float values:
checkpoints, resume and every data-parallel backend are those of full fine-tuning, and final/ is a plain
float model. Loading final/ with transformers' `TorchAoConfig(<the same scheme>)` quantizes it on load
(torchao's convert step): that model computes exactly what the fake-quantized training forward computed
(tests/integration/test_qat.py); the model card says how (QAT.load_snippet).
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


def apply_qat(model, recipe: Recipe) -> None:
    """Swap the quantized linear layers for torchao's fake-quantized ones (in place)."""
    qat = recipe.method.qat
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
