"""The model inside its wrappers.

`inner_module`: inside DDP / DeepSpeed engine wrappers by their `.module` alone, where no accelerator is
at hand (FSDP2 and peft wrap in place or forward).

`deepspeed_unimported`: accelerate's unwrap (`extract_model_from_parallel`, which `unwrap_model`,
`get_state_dict` and transformers' `save_pretrained` call) imports deepspeed whenever the package is
installed, only to test the model against `DeepSpeedEngine`: about 1.8 s of CPU in every process of
every run that does not use DeepSpeed. A model can only be wrapped in a DeepSpeedEngine once deepspeed
has been imported, so inside this context accelerate is told that deepspeed is available exactly when it
has been imported: DeepSpeed runs unwrap as before, the others never import it.
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import accelerate.utils.other
import torch


def inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / DeepSpeed engine wrappers (FSDP2 and peft wrap in place or forward)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def deepspeed_imported() -> bool:
    return "deepspeed" in sys.modules


@contextlib.contextmanager
def deepspeed_unimported():
    """Inside: accelerate's unwrap never imports deepspeed for nothing (see the module's docstring)."""
    with mock.patch.object(accelerate.utils.other, "is_deepspeed_available", deepspeed_imported):
        yield
