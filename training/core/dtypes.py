"""The recipe's dtype names (model.dtype, method.quantization.*, export --dtype) as torch dtypes."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
