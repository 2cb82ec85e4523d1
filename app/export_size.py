"""The sizes the Export tab says: before a GGUF job, the file's estimated size (the model's weights, counted
from its safetensors headers without loading it, at the bytes each takes in the chosen outtype, and the
vocabulary and merges the file carries); after a job, the size of what it wrote. For the tests' tiny model the
estimate is 8,224,247 bytes, the file llama.cpp's converter writes 8,227,040."""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open

from training.run.rundir import ADAPTER_CONFIG, RunDir

# bytes per weight of a matrix in each GGUF outtype (q8_0: blocks of 32 int8 weights and one fp16 scale); vectors
# (norms, biases) stay float32
GGUF_BYTES = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
TOKENIZER = "tokenizer.json"  # its vocabulary and merges go into the GGUF file too


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def parameters(model_dir: Path) -> tuple[int, int] | None:
    """A saved model's (parameters in matrices, in vectors), from its safetensors headers; None for an adapter
    or no safetensors."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files or (model_dir / ADAPTER_CONFIG).is_file():
        return None
    shapes = []
    for f in files:
        with safe_open(f, "pt") as st:
            shapes += [st.get_slice(k).get_shape() for k in st.keys()]  # noqa: SIM118 (no __iter__)
    return sum(math.prod(s) for s in shapes if len(s) > 1), sum(math.prod(s) for s in shapes if len(s) <= 1)


def vocabulary_bytes(model_dir: Path) -> int:
    """What a GGUF file holds of the tokenizer: each token (a length and its bytes, and its type) and merge."""
    path = model_dir / TOKENIZER
    if not path.is_file():
        return 0
    model = json.loads(path.read_text()).get("model", {})
    tokens = sum(8 + len(t.encode()) + 4 for t in model.get("vocab", {}))
    merges = (m if isinstance(m, str) else " ".join(m) for m in model.get("merges", []))
    return tokens + sum(8 + len(m.encode()) for m in merges)


def gguf_estimate(run_root: Path, outtype: str) -> str:
    """What the GGUF button would write, said before it runs."""
    final = RunDir(run_root).final
    if (final / ADAPTER_CONFIG).is_file():
        return "GGUF size: merged into its base model first, so about the base model's size in that outtype"
    counted = parameters(final)
    if counted is None or outtype not in GGUF_BYTES:
        return ""
    matrices, vectors = counted
    size = matrices * GGUF_BYTES[outtype] + vectors * 4 + vocabulary_bytes(final)
    millions = (matrices + vectors) / 1e6
    return f"GGUF ({outtype}): about **{megabytes(size)}** ({millions:,.1f}M parameters, and the tokenizer)"


def written(run_root: Path, action: str) -> Path | None:
    """What a finished export job wrote: the GGUF file, or the merged model's directory (None: nothing local)."""
    run = RunDir(run_root)
    return {"gguf": run.gguf, "merge": run.merged}.get(action)


def size_on_disk(path: Path) -> int:
    """A file's size, or a directory's files' sizes summed."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
