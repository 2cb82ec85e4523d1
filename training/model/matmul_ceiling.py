"""The CPU's matmul ceiling: the FLOP/s torch.mm reaches on this machine at a model's shapes, measured once
per machine and cached; CPU MFU is measured against it (a GPU's is against its datasheet peak,
training.model.speed.PEAK_FLOPS).

A CPU has no datasheet figure torch reaches: what it reaches depends on the vector units (AVX2/FMA,
AVX512, AVX512-BF16/AMX), the dtype (bf16 without native instructions is ~100x slower than fp32), the
threads and the shapes. So the ceiling is measured: torch.mm of [rows, k] @ [k, n] at the model's MLP
shapes, in the run's compute dtype, with the run's thread count, rows = the run's tokens per micro-batch
(capped so that one product stays short, fewer in a dtype the CPU only emulates); after a warm-up,
`REPEATS` timed repeats of enough products for about `BUDGET_S` in all; the best repeat of the best shape
is the ceiling (other work on the machine only ever slows a repeat down). About a second, once per machine.
The rows do not depend on timings: on a busy machine one disturbed timing must not change the shape.

Cached in `cache_root()/matmul_ceiling.json` (training.core.fs: $LLM_FORGE_CACHE, else
$XDG_CACHE_HOME/llm-forge, else ~/.cache/llm-forge), one entry per CPU model, flags, torch version,
threads, dtype and shape, written atomically; an unreadable file is ignored and rewritten. A probe taken
while the machine is busy reads low (on the 2-core AVX2 dev box, 16-70 GFLOP/s fp32 beside a running
test suite, where torch.mm reached 168-181 in its quietest moment), which would overstate MFU for every later run: when the
1-minute load average exceeds the cores, the figure serves this run only and is not cached (the start-up
line says so). Delete the file to measure again.
`LLM_FORGE_CPU_PEAK_FLOPS=1.7e11` fixes the ceiling without measuring (the test suite sets it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from training.core.fs import cache_root, write_atomic
from training.core.machine import BF16_FLAGS, cpu_flags, cpu_model

log = logging.getLogger(__name__)

ENV = "LLM_FORGE_CPU_PEAK_FLOPS"
CACHE_FILE = "matmul_ceiling.json"
BUDGET_S = 0.6  # timed seconds over all shapes (the warm-ups come on top)
REPEATS = 3
PRODUCT_FLOPS = 2**31  # rows are capped so that one product costs about this (13 ms at 160 GFLOP/s) ...
MIN_ROWS = 256  # ... but not below this many rows (a thin product reads low) ...
EMULATED_PRODUCT_FLOPS = 2**26  # ... except in a dtype the CPU emulates (bf16 on AVX2: 40 ms at 1.7 GFLOP/s)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
NATIVE_FLAGS = {torch.bfloat16: BF16_FLAGS, torch.float16: ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class Ceiling:
    flops: float  # FLOP/s of one process
    description: str  # where the figure comes from, for the start-up line


def cache_path() -> Path:
    return cache_root() / CACHE_FILE


def time_mm(a: torch.Tensor, b: torch.Tensor, iterations: int) -> float:
    """Seconds for `iterations` products a @ b."""
    start = time.perf_counter()
    for _ in range(iterations):
        torch.mm(a, b)
    return time.perf_counter() - start


def probe_rows(rows: int, shapes: list[tuple[int, int]], dtype: torch.dtype) -> int:
    """The probe's rows: the run's `rows`, capped so that the largest product costs about PRODUCT_FLOPS
    (at least MIN_ROWS rows), or EMULATED_PRODUCT_FLOPS in a dtype without the CPU's native instructions."""
    size = 2 * max(k * n for k, n in shapes)
    native = NATIVE_FLAGS.get(dtype)  # None: fp32, native everywhere
    if native is not None and not any(f in cpu_flags() for f in native):
        return max(1, min(rows, EMULATED_PRODUCT_FLOPS // size))
    return max(1, min(rows, max(MIN_ROWS, PRODUCT_FLOPS // size)))


def measure(rows: int, k: int, n: int, dtype: torch.dtype, budget_s: float) -> float:
    """The best FLOP/s of torch.mm [rows, k] @ [k, n] over REPEATS repeats of about budget_s / REPEATS s."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    time_mm(a, b, 2)  # warm-up: threads, allocations, kernel selection
    per_product = max(min(time_mm(a, b, 1) for _ in range(2)), 1e-7)  # the less disturbed of two
    iterations = max(1, round(budget_s / REPEATS / per_product))
    best = max(iterations / max(time_mm(a, b, iterations), 1e-9) for _ in range(REPEATS))
    return 2 * rows * k * n * best


def busy() -> str:
    """'' or why this machine is too busy for a measurement to be kept: a 1-minute load average above its
    core count (other work was running on every core)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this platform
        return ""
    cores = os.cpu_count() or 1
    return f"load average {load:.1f} on {cores} cores" if load > cores else ""


def fixed_ceiling() -> float | None:
    """LLM_FORGE_CPU_PEAK_FLOPS as FLOP/s, when it is set to a positive number."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        log.warning("%s=%r is not a positive number of FLOP/s; measuring the ceiling instead", ENV, raw)
        return None
    return value


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten
    return data if isinstance(data, dict) else {}


def _cached_flops(entry) -> float | None:
    flops = entry.get("flops") if isinstance(entry, dict) else None
    ok = isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0
    return float(flops) if ok else None


def matmul_ceiling(
    shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, budget_s: float = BUDGET_S
) -> Ceiling:
    """This CPU's torch.mm ceiling (FLOP/s of one process) at [rows, k] @ [k, n] for each (k, n) of
    `shapes`, in `dtype`, with torch's current thread count: fixed by LLM_FORGE_CPU_PEAK_FLOPS, else read
    from the cache, else measured (and cached)."""
    if (fixed := fixed_ceiling()) is not None:
        return Ceiling(fixed, f"{fixed / 1e9:.3g} GFLOP/s (fixed by {ENV})")
    threads, name = torch.get_num_threads(), DTYPE_NAMES.get(dtype, str(dtype))
    rows = probe_rows(rows, shapes, dtype)
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    key = (
        f"{cpu_model()} | flags {flags} | torch {torch.__version__} | {threads} threads | {name} | "
        f"{rows} rows x " + ", ".join(f"{k}x{n}" for k, n in shapes)
    )
    path = cache_path()
    cache = _read_cache(path)
    flops = _cached_flops(cache.get(key))
    how = f"cached in {path}"
    if flops is None:
        start, loaded = time.perf_counter(), busy()
        flops = max(measure(rows, k, n, dtype, budget_s / len(shapes)) for k, n in shapes)
        seconds = time.perf_counter() - start
        how = f"measured in {seconds:.1f} s, cached in {path}"
        if loaded:
            how = f"measured in {seconds:.1f} s on a busy machine ({loaded}): may read low, not cached"
        else:
            cache[key] = {"flops": flops, "date": time.strftime("%Y-%m-%d %H:%M")}
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, json.dumps(cache, indent=1, sort_keys=True))
            except OSError as e:
                how = f"measured in {seconds:.1f} s, not cached ({e})"
    shown = " and ".join(f"{rows}x{k}x{n}" for k, n in shapes)
    return Ceiling(
        flops,
        f"measured torch.mm ceiling {flops / 1e9:.3g} GFLOP/s {name} on {cpu_model()}, {threads} threads "
        f"({shown}; {how})",
    )
