"""The sizes the Export tab says: before a GGUF job, the file's estimated size (the model's parameters, counted
from its safetensors headers without loading it, times the bytes each takes in the chosen outtype, and the
tokenizer the file carries); after a job, the size of what it wrote."""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open

from training.run.rundir import ADAPTER_CONFIG, RunDir

# bytes per parameter in each GGUF outtype (q8_0: blocks of 32 int8 weights and one fp16 scale)
GGUF_BYTES = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
TOKENIZER = "tokenizer.json"  # its vocabulary and merges go into the GGUF file too


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def parameters(model_dir: Path) -> int | None:
    """A saved model's parameter count from its safetensors headers; None for an adapter or no safetensors."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files or (model_dir / ADAPTER_CONFIG).is_file():
        return None
    count = 0
    for f in files:
        with safe_open(f, "pt") as st:
            count += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118 (no __iter__)
    return count


def gguf_estimate(run_root: Path, outtype: str) -> str:
    """What the GGUF button would write, said before it runs."""
    final = RunDir(run_root).final
    if (final / ADAPTER_CONFIG).is_file():
        return "GGUF size: merged into its base model first, so about the base model's size in that outtype"
    n = parameters(final)
    if n is None or outtype not in GGUF_BYTES:
        return ""
    vocab = (final / TOKENIZER).stat().st_size if (final / TOKENIZER).is_file() else 0
    size = n * GGUF_BYTES[outtype] + vocab
    return f"GGUF ({outtype}): about **{megabytes(size)}** ({n / 1e6:,.1f}M parameters × {GGUF_BYTES[outtype]:g} bytes, and the tokenizer)"


def written(run_root: Path, action: str) -> Path | None:
    """What a finished export job wrote: the GGUF file, or the merged model's directory (None: nothing local)."""
    run = RunDir(run_root)
    return {"gguf": run.gguf, "merge": run.merged}.get(action)


def size_on_disk(path: Path) -> int:
    """A file's size, or a directory's files' sizes summed."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
