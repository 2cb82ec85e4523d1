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

A probe can read low without the load average showing it (another job starting in the same second), and a
disturbed figure would make every later run on the machine print an MFU over 100%. So no figure is trusted
beyond what the vector units allow: `vector_bound` (FLOPs per cycle of the widest FMA units this CPU's flags
name, times the clock with a boost allowance, times the threads) is an upper bound of what torch.mm can
reach. A probe that reads under `PLAUSIBLE` of it at a dtype the CPU computes natively is not cached; a
busy probe is not used: the run takes the best quiet figure cached for this CPU at any shape, else the
vector bound. And a run that goes faster than its ceiling proves the ceiling wrong: the speed report
(training.model.speed.SpeedReport.mfu) forgets the cached figure and measures MFU against the vector bound
from then on, or says nothing (`mfu` None) where even that is passed: never a figure over 100%.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from training.core.fs import cache_root, read_json_object, write_atomic
from training.core.machine import BF16_FLAGS, cpu_clock_mhz, cpu_flags, cpu_key, cpu_model

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


PLAUSIBLE = 0.25  # a native-dtype probe under this share of the vector bound was disturbed: not cached
BOOST = 1.5  # /proc/cpuinfo's clock is the nominal one on these VMs; boost clocks run up to this much faster
FMA_FLOPS_PER_CYCLE = (  # per core, flag -> FLOPs per cycle of a dtype (two FMA units, 2 FLOPs each per lane)
    ("amx_bf16", {torch.bfloat16: 2048, torch.float16: 2048}),
    ("avx512_bf16", {torch.bfloat16: 128}),
    ("avx512f", {torch.float32: 64}),
    ("fma", {torch.float32: 32}),
)


@dataclass(frozen=True)
class Ceiling:
    flops: float | None  # FLOP/s of one process; None: unknown (MFU not reported)
    description: str  # where the figure comes from, for the start-up line
    key: str | None = None  # the cache entry it was read from or written to (forgotten if proven wrong)


def vector_bound(dtype: torch.dtype, threads: int | None = None) -> float | None:
    """An upper bound of the FLOP/s torch.mm can reach on this CPU in `dtype`: the widest FMA units its flags
    name, at its clock times BOOST, on `threads` cores (torch's thread count, at most the cores); a dtype it
    only emulates gets fp32's bound (emulation is slower). None where the clock or the units are unknown."""
    mhz, flags = cpu_clock_mhz(), cpu_flags()
    if not mhz:
        return None
    threads = min(threads or torch.get_num_threads(), os.cpu_count() or 1)

    def units(d: torch.dtype) -> list[int]:
        return [table[d] for flag, table in FMA_FLOPS_PER_CYCLE if flag in flags and d in table]

    per_cycle = units(dtype) or units(torch.float32)  # a dtype only emulated: fp32's units bound it
    if not per_cycle:
        return None
    return max(per_cycle) * mhz * 1e6 * BOOST * threads


def forget(key: str | None) -> None:
    """Remove a cached ceiling that a run proved too low (it went faster than it): the next run measures."""
    if not key:
        return
    path = cache_path()
    cache = read_json_object(path)
    if cache.pop(key, None) is not None:
        with contextlib.suppress(OSError):  # an unwritable cache is measured again anyway
            write_atomic(path, json.dumps(cache, indent=1, sort_keys=True))


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
    key = (
        f"{cpu_key()} | torch {torch.__version__} | {threads} threads | {name} | "
        f"{rows} rows x " + ", ".join(f"{k}x{n}" for k, n in shapes)
    )
    path = cache_path()
    cache = read_json_object(path)
    flops = _cached_flops(cache.get(key))
    shown = " and ".join(f"{rows}x{k}x{n}" for k, n in shapes)
    if flops is not None:
        return described(flops, name, threads, f"{shown}; cached in {path}", key)
    start, loaded = time.perf_counter(), busy()
    flops = max(measure(rows, k, n, dtype, budget_s / len(shapes)) for k, n in shapes)
    seconds = time.perf_counter() - start
    bound = vector_bound(dtype, threads)
    native = dtype not in NATIVE_FLAGS or any(f in cpu_flags() for f in NATIVE_FLAGS[dtype])
    if not loaded and native and bound and flops < PLAUSIBLE * bound:
        loaded = f"{flops / 1e9:.3g} GFLOP/s is under {PLAUSIBLE:.0%} of the vector units' {bound / 1e9:.3g}"
    if loaded:  # disturbed: this figure would overstate MFU; a quiet one cached for this CPU, else the bound
        return quiet_fallback(
            cache, key, dtype, threads, f"measured on a busy machine ({loaded}): not cached, not used"
        )
    cache[key] = {"flops": flops, "date": time.strftime("%Y-%m-%d %H:%M")}
    how = f"measured in {seconds:.1f} s, cached in {path}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(cache, indent=1, sort_keys=True))
    except OSError as e:
        how = f"measured in {seconds:.1f} s, not cached ({e})"
    return described(flops, name, threads, f"{shown}; {how}", key)


def described(flops: float, name: str, threads: int, how: str, key: str | None) -> Ceiling:
    text = f"measured torch.mm ceiling {flops / 1e9:.3g} GFLOP/s {name} on {cpu_model()}, {threads} threads ({how})"
    return Ceiling(flops, text, key)


def quiet_fallback(cache: dict, key: str, dtype: torch.dtype, threads: int, why: str) -> Ceiling:
    """The best figure cached for this CPU, torch, threads and dtype at any shape (a quiet measurement), else
    the vector units' bound, else none (MFU unknown)."""
    prefix = key.split(" | ")[:5]
    same = [k for k in cache if k.split(" | ")[:5] == prefix and _cached_flops(cache[k]) is not None]
    name = DTYPE_NAMES.get(dtype, str(dtype))
    if same:
        best = max(same, key=lambda k: _cached_flops(cache[k]))
        flops = _cached_flops(cache[best])
        return described(flops, name, threads, f"{why}; a quiet measurement at {best.split(' | ')[-1]}", best)
    if (bound := vector_bound(dtype, threads)) is not None:
        text = f"{bound / 1e9:.3g} GFLOP/s {name}: the vector units' bound on {cpu_model()}, {threads} threads ({why})"
        return Ceiling(bound, text)
    return Ceiling(None, f"unknown ({why}; MFU not reported)")
