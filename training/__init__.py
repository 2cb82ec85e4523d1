"""llm-forge's training package: recipes, data, models, the training loop and its CLIs.

Importing it silences four start-up messages of libraries we depend on, so that the first lines a
user sees are ours. Each is dropped only in the exact form that is noise; anything else those
libraries say still shows. This runs before any of them is imported: every `python -m training.X`,
the app and the tests import this package first.

- bitsandbytes (imported by peft) on CPUs with AVX512-BF16: "Failed to load CPU gemm_4bit_forward
  from kernels-community: No module named 'kernels'" -- an optional package for a faster 4-bit CPU
  kernel; bitsandbytes uses its own kernel instead. A `kernels` package that is installed but fails
  is still reported.
- DeepSpeed (imported by accelerate whenever it unwraps a model, DeepSpeed run or not): "Setting
  accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." on every
  machine without a GPU. The run's own "speed:" line names the device it trains on.
- peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` (a FutureWarning about
  the libraries' code, not the user's).
- torchao (method.qat), which transformers imports whenever it is installed: with a CPU build of torch,
  "Failed to load .../torchao/_C_mxfp8...so" and "_C_cutlass_90a" (CUDA kernels a CPU torch cannot
  load), and torch's "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
  torch.compile" for each Enum torchao registers. On a CUDA build a failed torchao library still shows.

First of all, a `python -m training.X` command executes itself again, in the same process, with glibc's malloc
asking for huge pages where that can help (training/core/pages.py): a tunable is read only when a process starts.

It also readies torchvision's import beside a CPU build of torch (training/core/torchvision_ops.py): PyPI's
torchvision, built for the CUDA torch of its release, otherwise fails to import there, and transformers' image
and video processors need its transforms.
"""

from __future__ import annotations

import logging
import warnings

from training.core import pages, torchvision_ops

pages.relaunch()  # first: a `python -m training.X` command may execute itself again, with huge pages

torchvision_ops.install()


class _DropMessage(logging.Filter):
    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not all(part in text for part in self.parts)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community", "No module named 'kernels'")
)
logging.getLogger("DeepSpeed").addFilter(_DropMessage("Setting accelerator to CPU."))


class _DropOnCPUTorch(_DropMessage):
    def filter(self, record: logging.LogRecord) -> bool:
        import torch  # loaded by then: torchao imports it first

        return torch.version.cuda is not None or super().filter(record)


logging.getLogger("torchao").addFilter(_DropOnCPUTorch("Failed to load", "/torchao/_C"))
logging.getLogger("torch.utils._pytree").addFilter(
    _DropMessage("is an Enum subclass and is now natively supported by torch.compile")
)
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
