"""Datasets of the bundled lm-evaluation-harness tasks, read from this repository (no network)."""

from __future__ import annotations

import json

from training.core.paths import ROOT

DATES_TEST = ROOT / "data/dates/test.jsonl"  # in a checkout (data/ is not part of the package)


def dates_test(**_metadata):
    """data/dates/test.jsonl as a DatasetDict with one `test` split of chat records."""
    import datasets

    rows = [json.loads(line) for line in DATES_TEST.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
