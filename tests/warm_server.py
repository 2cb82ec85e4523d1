"""Imported last by the fork server (tests/forked.py): what every child would otherwise do once for itself is done
here once, before the forks.

- transformers builds its table of checkpoint renamings (about 1,100 compiled patterns, 0.2-0.6 CPU-s) the first
  time a process loads or saves a model;
- matplotlib loads its font and lays out text the first time a run draws loss.png (training.run.metrics.plot_loss,
  called here on two rows);
- then the heap is frozen (gc.freeze): the collector no longer walks the millions of objects the imports made
  each time a child's allocations trigger a full collection (reading the tokenizer's JSON did, 0.3-0.4 s).
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

from transformers.conversion_mapping import get_checkpoint_conversion_mapping

from training.run.metrics import plot_loss

get_checkpoint_conversion_mapping("llama")

with tempfile.TemporaryDirectory(prefix="llm-forge-warm-") as tmp:
    metrics = Path(tmp, "metrics.jsonl")
    metrics.write_text(
        "".join(json.dumps({"step": s, "loss": 2.0 / s, "eval_loss": 2.1 / s}) + "\n" for s in (1, 2))
    )
    plot_loss(metrics, Path(tmp, "loss.png"))

gc.collect()
gc.freeze()
