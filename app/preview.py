"""The Configure tab's data preview: `python -m training.preview` run on the form's recipe (a subprocess, as
every training tool the app drives, under the workspace's rule), shown as the first records with the tokens
that carry the loss highlighted, the length histogram against max_length, and the counts."""

from __future__ import annotations

import html
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from matplotlib.figure import Figure

from app.runs import tool_env
from app.workspace import Workspace

PREVIEW_TIMEOUT_S = 300


def run_preview(ws: Workspace, text: str, examples: int = 3) -> dict:
    """training.preview's JSON for the recipe `text` (checked by the caller), run in the workspace; a
    RuntimeError with its message when it refuses the recipe or fails."""
    with tempfile.TemporaryDirectory(prefix="llm-forge-preview-") as tmp:
        recipe = Path(tmp) / "recipe.yaml"
        recipe.write_text(text)
        argv = [sys.executable, "-m", "training.preview", str(recipe), "--examples", str(examples), "--json"]
        try:
            proc = subprocess.run(
                argv, cwd=ws.root, env=tool_env(ws), capture_output=True, text=True, timeout=PREVIEW_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"data preview: no answer within {PREVIEW_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        raise RuntimeError(said[-1].removeprefix("error: ") if said else proc.stderr[-1000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def examples_html(out: dict) -> str:
    """The records as the model sees them, the loss tokens highlighted."""
    if not out["examples"]:
        return (
            f"<p>None of the first records keeps a token to learn from at max_length={out['max_length']}: "
            "training drops them (their answers are cut away).</p>"
        )
    parts = []
    for i, ex in enumerate(out["examples"], 1):
        body = "".join(
            f"<mark>{html.escape(s['text'])}</mark>" if s["loss"] else html.escape(s["text"])
            for s in ex["segments"]
        )
        parts.append(
            f"<p><b>Example {i}</b>: {ex['tokens']} tokens, {ex['loss_tokens']} carry the loss (highlighted)</p>"
            f"<pre class='preview-example'>{body}</pre>"
        )
    return "\n".join(parts)


def summary_markdown(out: dict) -> str:
    if not out["lengths"]:
        return f"`{out['format']}` data: examples are blocks of max_length={out['max_length']} tokens."
    return (
        f"**{out['scanned']:,} records** read, **{out['tokens']:,} tokens** untruncated; "
        f"**{out['longer_than_max_length']} ({out['share_longer']:.1%})** are longer than "
        f"max_length={out['max_length']} (data.too_long: {out['too_long']})"
    )


def lengths_figure(out: dict) -> Figure | None:
    """The records' token lengths, max_length marked."""
    if not out["lengths"]:
        return None
    edges, counts = out["lengths"]["edges"], out["lengths"]["counts"]
    fig = Figure(figsize=(8, 2.6), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:])], align="edge", alpha=0.8)
    ax.axvline(out["max_length"], color="#d62728", linestyle="--", label=f"max_length {out['max_length']}")
    ax.set_xlabel("tokens per record")
    ax.set_ylabel("records")
    ax.legend(fontsize=8)
    return fig
