"""The Configure tab's data preview and data check: `python -m training.preview` run on the form's recipe (a
subprocess, as every training tool the app drives, under the workspace's rule).

The preview shows the first records with the tokens that carry the loss highlighted, the length histogram
against max_length, and the counts. The check (`--check`) reads the first records of every data file as the
trainer reads them; its problems are shown under data.train / data.eval and refused by Start. It runs once per
`data_key` (the recipe's data and model settings and the size and time of the files they name), in the
background after an edit; the form's own validation reads its last answers (`known_data_problems`).
"""

from __future__ import annotations

import glob
import html
import json
import re
import tempfile
from pathlib import Path

from matplotlib.figure import Figure

from app.runs import tool_json
from app.workspace import Workspace

PREVIEW_TIMEOUT_S = 300
CHECK_RECORDS = 200  # the data check reads this many records of each file
_CHECKED: dict[str, dict[str, list[str]]] = {}  # data_key -> the check's problems {recipe key: [message]}
_KEEP = 64  # answers kept


def run_preview(ws: Workspace, text: str, examples: int = 3) -> dict:
    """training.preview's JSON for the recipe `text` (checked by the caller), run in the workspace; a
    RuntimeError with its message when it refuses the recipe or fails."""
    return _preview_tool(ws, text, ["--examples", str(examples)])


def preview_key(raw: dict | None) -> str | None:
    """What a data preview depends on: the recipe's data and model sections (None: a YAML that does not parse)."""
    if not isinstance(raw, dict):
        return None
    return json.dumps([raw.get("data"), raw.get("model")], sort_keys=True, default=str)


def data_key(ws: Workspace, raw: dict) -> str | None:
    """What the data check's answer depends on: the recipe's data and model settings and the size and time of
    the files they name (so an edited file is checked again). None, and no check, for a recipe without
    data.train or one naming something that is no file of the workspace: a name being typed, or a hub
    dataset (read at training)."""
    data = raw.get("data")
    if not isinstance(data, dict) or not data.get("train"):
        return None
    stats = []
    for name in _data_paths(data):
        paths = [Path(p) for p in sorted(glob.glob(str(ws.root / name)))]
        if not paths or not all(p.is_file() for p in paths):
            return None
        for path in paths:
            st = path.stat()
            stats.append((str(path), st.st_size, st.st_mtime_ns))
    return json.dumps([data, raw.get("model"), stats], sort_keys=True, default=str)


def _data_paths(data: dict) -> list[str]:
    """The file names (or globs) of data.train (plain, or a mixture's sources' paths) and data.eval (plain, or
    named sets)."""
    train, held = data.get("train"), data.get("eval")
    sources = train if isinstance(train, list) else [train]
    names = [n for src in sources for n in _strings(src.get("path") if isinstance(src, dict) else src)]
    return names + [n for v in (held.values() if isinstance(held, dict) else [held]) for n in _strings(v)]


def _strings(x) -> list[str]:
    return (
        [x]
        if isinstance(x, str)
        else [s for item in x for s in _strings(item)]
        if isinstance(x, list)
        else []
    )


def known_data_problems(ws: Workspace, raw: dict) -> dict[str, list[str]]:
    """The data check's problems for this recipe, if the check has run for its data_key ({} if not)."""
    key = data_key(ws, raw)
    return _CHECKED.get(key, {}) if key else {}


def check_data(ws: Workspace, text: str, raw: dict) -> bool:
    """Run the data check on the recipe unless its data_key has an answer; whether it ran. A check that
    fails on something else (a model it cannot load) puts that message under the key it names, else under
    data.train, as the trainer would stop there too."""
    key = data_key(ws, raw)
    if key is None or key in _CHECKED:
        return False
    try:
        problems = _preview_tool(ws, text, ["--check", "--scan", str(CHECK_RECORDS)])["problems"]
    except RuntimeError as e:
        named = re.match(r"([a-z_]+(?:\.[a-z_]+)+): ", str(e))
        problems = {named.group(1) if named else "data.train": [str(e)]}
    while len(_CHECKED) >= _KEEP:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[key] = problems
    return True


def _preview_tool(ws: Workspace, text: str, args: list[str]) -> dict:
    """training.preview's JSON (with `args`) for the recipe `text`, run in the workspace; a RuntimeError with
    its message when it refuses the recipe or fails."""
    with tempfile.TemporaryDirectory(prefix="llm-forge-preview-") as tmp:
        recipe = Path(tmp) / "recipe.yaml"
        recipe.write_text(text)
        return tool_json(
            ws, ["training.preview", str(recipe), *args, "--json"], PREVIEW_TIMEOUT_S, "data preview"
        )


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
