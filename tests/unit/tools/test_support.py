"""python -m training.support PATH ("will my model work?"): the support matrix's row for one model, built tiny
from its own config (a checkpoint directory as save_pretrained writes it, or its config.json alone), each "no"
with its reason; exit 2 with one message for a path that holds no model and for a model_type transformers does
not know."""

from __future__ import annotations

import json

import pytest
from transformers import (
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
)

from conftest import run_cli
from training.core.errors import UserError
from training.planning.support import CHECKS
from training.support import kind_of

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def cells_of(stdout: str) -> dict[str, str]:
    """The row's cells as the command prints them: '  check    cell'."""
    rows = [line.split(None, 1) for line in stdout.splitlines() if line.startswith("  ")]
    return {name: cell for name, cell in rows}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("support") / "llama"
    LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, vocab_size=300, **SMALL)).save_pretrained(path)
    return path


def test_a_local_checkpoint_gets_its_row_yes_or_no_per_check(llama):
    done = run_cli("training.support", llama)
    assert done.returncode == 0, done.stderr
    cells = cells_of(done.stdout)
    assert list(cells) == list(CHECKS)
    assert cells["fsdp"] == "yes: LlamaDecoderLayer" and cells["tp"].startswith("yes: ")
    assert all(cells[c] == "yes" for c in ("lora", "full", "chunked", "varlen", "ckpt", "tiled", "reload")), (
        cells
    )
    assert done.stdout.splitlines()[-1].startswith("llama (text): 11 of 11 checks yes, ")


def test_the_row_is_of_the_checkpoints_own_config_and_says_why_not(tmp_path):
    """A config.json alone (no weights): Gemma 2's soft-capped logits keep the full loss, its sliding window
    padded attention, with the reasons the trainer gives, the capping the file's own value."""
    Gemma2Config(final_logit_softcapping=20.0, sliding_window=64, head_dim=16, **SMALL).save_pretrained(
        tmp_path
    )
    done = run_cli("training.support", tmp_path / "config.json", "--json")
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.splitlines()[-1])
    assert (row["model_type"], row["kind"]) == ("gemma2", "text")
    cells = row["cells"]
    assert (
        cells["chunked"]
        == "no (full loss): the model post-processes its logits (final_logit_softcapping=20.0)"
    )
    assert cells["varlen"] == "no (padded): sliding-window attention"
    assert cells["lora"] == cells["full"] == "yes"


def test_a_directory_without_a_model_and_an_unknown_type_exit_2_with_the_reason(tmp_path):
    (tmp_path / "empty").mkdir()
    done = run_cli("training.support", tmp_path / "empty")
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        f"error: {tmp_path / 'empty'}: holds no model: expected a config.json (a checkpoint directory as "
        "save_pretrained writes it, or the config.json itself)"
    )
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown/config.json").write_text(json.dumps({"model_type": "llama9000"}))
    done = run_cli("training.support", tmp_path / "unknown")
    assert done.returncode == 2
    assert (
        f"error: {tmp_path / 'unknown/config.json'}: model_type 'llama9000' is not a type transformers"
        in (done.stderr)
    )
    assert "Traceback" not in done.stderr


def test_a_config_with_a_vision_part_gets_the_image_text_checks_and_an_encoder_is_refused():
    assert kind_of(Gemma3Config(), "x") == "image-text"
    assert kind_of(Gemma3TextConfig(), "x") == kind_of(LlamaConfig(), "x") == "text"
    with pytest.raises(UserError) as refused:
        kind_of(ViTConfig(), "vit/config.json")
    assert str(refused.value) == (
        "vit/config.json: model_type 'vit' is neither a causal LM nor an image-text model transformers "
        "registers, so it is nothing this trainer trains"
    )
