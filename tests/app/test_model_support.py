"""The Configure tab's "Will this model work?" (app/model_support.py, no browser): the recipe's model through
`python -m training.support` in the workspace, its row as a table; a recipe that builds its model from scratch,
or one to fix first, gets the reason instead."""

from __future__ import annotations

import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from app.model_support import model_support
from app.workspace import Workspace
from conftest import SMOLLM2_TOKENIZER, TINY_ARCH
from training.planning.support import CHECKS


def recipe_text(model: dict) -> str:
    data = {"train": "data/train.jsonl", "format": "chat"}  # inside the workspace (the rule), never read here
    return yaml.safe_dump(
        {"output_dir": "runs/support", "model": {"tokenizer": SMOLLM2_TOKENIZER, **model}, "data": data}
    )


def test_the_recipes_model_gets_its_row_of_the_support_matrix(tmp_path):
    ws = Workspace(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH)).save_pretrained(tmp_path / "models/llama")
    shown = model_support(ws, recipe_text({"name_or_path": "models/llama"}))
    assert shown.startswith(
        "**models/llama**: llama (text), built tiny from its config: 11 of 11 checks yes, "
    )
    rows = [line for line in shown.splitlines() if line.startswith("| ") and line != "| check | answer |"]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(CHECKS)
    assert "| lora | yes |" in rows and "| fsdp | yes: LlamaDecoderLayer |" in rows


def test_a_model_from_scratch_or_a_recipe_to_fix_is_not_checked(tmp_path):
    ws = Workspace(tmp_path)
    scratch = model_support(ws, recipe_text({"from_scratch": dict(TINY_ARCH)}))
    assert scratch.startswith("The recipe builds its model from scratch (model.from_scratch)")
    assert model_support(ws, "output_dir: runs/x\n").startswith("Fix the recipe first:")
