"""final/README.md, the model card: Hub front matter, base model and its licence, method and its
hyper-parameters, data files with their sha256, the final train and eval metrics from metrics.jsonl,
the loss plot, the launch command and the recipe, for a full and a LoRA run."""

from __future__ import annotations

import re
import shutil

import yaml

from conftest import ROOT, TINY_ARCH, TOKENIZER, train_inprocess
from training.core.fs import file_digest
from training.run.metrics import read_metrics
from training.run.modelcard import read_front_matter

DATA = ROOT / "data/tiny_stories.txt"


def run(tmp_path, name: str, model: dict, method: dict) -> tuple:
    recipe = {
        "output_dir": str(tmp_path / name),
        "seed": 0,
        "model": model,
        "data": {
            "train": str(DATA),
            "eval": str(DATA),
            "format": "text",
            "max_length": 32,
            "max_examples": 60,
        },
        "method": method,
        "train": {"lr": 1e-2, "batch_size": 4, "max_steps": 3, "warmup_steps": 0},
        "eval": {"at_start": False, "max_batches": 2},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert train_inprocess(path) == 0
    out = tmp_path / name
    return out, (out / "final" / "README.md").read_text()


def check_common(out, card: str) -> None:
    rows = read_metrics(out / "metrics.jsonl")
    last = [r for r in rows if r.get("loss") is not None][-1]
    last_eval = [r for r in rows if r.get("eval_loss") is not None][-1]
    assert f"| train | `{DATA}` | `{file_digest(DATA)}` |" in card
    assert f"| eval | `{DATA}` | `{file_digest(DATA)}` |" in card
    assert f"| train loss | {last['loss']:.4f} |" in card
    assert f"| eval_loss (step {last_eval['step']}) | {last_eval['eval_loss']:.4f} |" in card
    assert "![loss](../loss.png)" in card and (out / "final" / "../loss.png").is_file()
    assert "```bash\npython -m training.train " in card
    recipe_block = re.search(r"```yaml\n(.*?)```", card, re.S).group(1)
    assert yaml.safe_load(recipe_block) == yaml.safe_load((out / "config.yaml").read_text())


def test_full_run_card(tmp_path):
    out, card = run(
        tmp_path, "full", {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)}, {"type": "full"}
    )
    front = read_front_matter(card)
    assert front["library_name"] == "transformers" and "full" in front["tags"]
    assert "base_model" not in front and "license" not in front
    assert "trained from scratch" in card and "- method: **full**" in card
    check_common(out, card)


def test_lora_run_card_names_base_licence_and_adapter(tmp_path, tiny_model_dir):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "README.md").write_text("---\nlicense: mit\n---\n# a base\n")
    out, card = run(
        tmp_path,
        "lora",
        {"name_or_path": str(base)},
        {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
    )
    front = read_front_matter(card)
    assert front["library_name"] == "peft" and front["license"] == "mit" and "lora" in front["tags"]
    assert f"A LoRA adapter for `{base}`" in card
    assert "- LoRA: r=4, alpha=8, dropout=0, targets: all-linear" in card
    assert "- base model licence: mit" in card
    check_common(out, card)
