"""Imported last by the fork server (tests/forked.py): what every child would otherwise do once for itself is done
here once, before the forks.

- transformers builds its table of checkpoint renamings (about 1,100 compiled patterns, 0.2-0.6 CPU-s) the first
  time a process loads or saves a model;
- matplotlib loads its font and lays out text the first time a run draws loss.png;
- then the heap is frozen (gc.freeze): the collector no longer walks the millions of objects the imports made
  each time a child's allocations trigger a full collection (reading the tokenizer's JSON did, 0.3-0.4 s).
"""

from __future__ import annotations

import gc
import io

import matplotlib
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

get_checkpoint_conversion_mapping("llama")

matplotlib.use("Agg")  # what training.run.metrics.plot_loss uses
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([1, 2], [2.0, 1.0], label="train loss", lw=1)
ax.set_xlabel("step")
ax.legend()
fig.tight_layout()
fig.savefig(io.BytesIO(), format="png", dpi=100)
plt.close(fig)

gc.collect()
gc.freeze()
