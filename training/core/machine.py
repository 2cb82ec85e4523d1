"""`precision: auto`: bf16 mixed precision where the hardware computes bf16 natively, fp32 elsewhere.

Resolved once per run by whoever knows the machine, never by the recipe schema: the training set-up
(training.loop.setup) resolves it for this machine with `auto_precision`, before the accelerator, the
refusal rules, the model card and config.yaml see it; the planner resolves it for the machine it plans
for (training.planning.memory.planned_precision):
- a CUDA GPU that supports bf16 (Ampere and newer)      -> bf16
- a CPU with native bf16 instructions (AVX512-BF16, AMX) -> bf16 (measured 1.3-1.5x faster on LoRA, see
  docs/benchmarks.md); on a CPU without them bf16 is emulated and slower than fp32 -> "no"
The CPU check is this module's `cpu_has_native_bf16`, the one place that reads the CPU's flags.
`LLM_FORGE_PRECISION_AUTO=no|bf16` fixes what `auto` means (the test suite sets `no`, so that its recipes
train the same on every CPU and GPU).

The same /proc/cpuinfo facts name the CPU wherever a CPU figure is shown (`cpu_model`, `cpu_description`:
the start-up speed line, the measured matmul ceiling's cache key, every benchmark): a figure from one CPU
kind does not hold on another.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The flags that decide matmul speed on x86 CPUs, in the order a description names them.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_field(name: str) -> str | None:
    """The first processor's `name` line in /proc/cpuinfo ("model name", "cpu family", "cpu MHz"), or None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
        if not line.strip():  # the end of the first processor's block
            break
    return None


def cpu_model() -> str:
    """The CPU's name with its family and model numbers, which tell apart CPUs sold under one name
    (e.g. 'AMD EPYC (family 25 model 1)'); the platform's processor or machine name elsewhere."""
    name = cpu_field("model name") or platform.processor() or platform.machine() or "unknown CPU"
    family, model = cpu_field("cpu family"), cpu_field("model")
    return f"{name} (family {family} model {model})" if family and model else name


def cpu_key() -> str:
    """What tells this machine's CPU apart for a cache of what was measured or probed on it: its model and a hash of
    its flags (a VM moved to another CPU kind gets another key)."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_model()} | flags {flags}"


def cpu_clock_mhz() -> float | None:
    """The first processor's current clock in MHz ("cpu MHz" in /proc/cpuinfo), or None."""
    try:
        return float(cpu_field("cpu MHz") or "")
    except ValueError:
        return None


def cpu_description() -> str:
    """One line that names this CPU for any figure measured on it: model, cores, clock, and which of the
    flags that decide matmul speed (AVX2/FMA, AVX512, AVX512-BF16, AMX) it has and lacks."""
    flags = cpu_flags()
    has = [f for f in SPEED_FLAGS if f in flags]
    lacks = [f for f in SPEED_FLAGS if f not in flags]
    parts = [cpu_model(), f"{os.cpu_count()} cores"]
    if (mhz := cpu_clock_mhz()) is not None:
        parts.append(f"{mhz:.0f} MHz")
    if flags:
        parts.append(
            " ".join(has) + (f" (no {' '.join(lacks)})" if lacks else "") if has else f"no {' '.join(lacks)}"
        )
    return ", ".join(parts)


def cpu_has_native_bf16() -> bool:
    return any(f in cpu_flags() for f in BF16_FLAGS)


def forced_precision() -> str | None:
    """What LLM_FORGE_PRECISION_AUTO fixes `auto` to ("no" or "bf16"), on every machine; None if unset."""
    forced = os.environ.get("LLM_FORGE_PRECISION_AUTO")
    return forced if forced in ("no", "bf16") else None


def auto_precision() -> tuple[str, str]:
    """(precision, why) for `precision: auto` on this machine."""
    import torch

    if (forced := forced_precision()) is not None:
        return forced, "LLM_FORGE_PRECISION_AUTO"
    if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true"):
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{torch.cuda.get_device_name(0)} supports bf16"
        return "no", f"{torch.cuda.get_device_name(0)} has no bf16"
    if cpu_has_native_bf16():
        return "bf16", "the CPU computes bf16 natively (AVX512-BF16/AMX)"
    return "no", "the CPU has no native bf16 (no AVX512-BF16/AMX): fp32 is faster there"


def emulated_bf16_warning(setting: str | None, device_type: str, native_bf16: bool) -> str | None:
    """The warning for a recipe setting that forces bf16 (e.g. "precision=bf16") where the CPU only emulates it;
    None where bf16 is fine or nothing forces it."""
    if setting is None or device_type != "cpu" or native_bf16:
        return None
    key, _ = setting.split("=", 1)
    return (
        f"{setting} on a CPU without native bf16 (no AVX512-BF16/AMX): bf16 matmuls are emulated here, "
        f"many times slower than fp32 (docs/methods.md#precision); {key}: auto picks fp32 on this CPU"
    )
