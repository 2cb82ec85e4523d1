"""The model families users bring most, through the support matrix's own checks (training.planning.support,
which benchmarks.models runs for docs/models.md on every causal-LM type): each built tiny from its own transformers config class,
LoRA (all-linear, the default dropout) and full fine-tuning train only what they should, the chunked loss
equals the full one or the trainer says why it keeps the full one, packing is exact or refused with the
reason, checkpointing gives the same gradients, final/ reloads with equal logits, the planner counts the
model's parameters. A plain "no" (a crash, a mismatch) fails; a refusal with its reason is an answer."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from conftest import ROOT, TOKENIZER, train_inprocess
from training.config.architectures import type_refusal
from training.model.attention import packing_refusal
from training.model.lora_targets import resolve
from training.planning.support import check_lora, check_tiled, check_type, lora_recipe, tiny_model

FAMILIES = [
    "llama",
    "llama4_text",
    "mistral",
    "ministral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gemma2",
    "gemma3_text",
    "gemma4_text",
    "phi3",
    "phimoe",
    "gpt_oss",
    "deepseek_v3",
    "glm4",
    "glm4_moe",
    "olmo2",
    "olmo3",
    "smollm3",
    "granite",
    "granitemoehybrid",
    "falcon_h1",
    "nemotron_h",
    "lfm2",
]
MUST = ("lora", "full", "ckpt", "reload", "planner")  # every family trains, checkpoints, reloads, is planned
ANSWERS = {  # cells that may be a refusal, with the reason's opening
    "chunked": ("yes", "no (full loss): "),
    "varlen": ("yes", "no (padded): ", "no (refused): "),
    "tiled": ("yes", "no (refused): "),  # Mixture-of-Experts models without a dense MLP are refused
}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_common_family_trains_reloads_and_is_planned(model_type):
    row = check_type(model_type, known_gguf=set())
    for check in MUST:
        assert row.cells[check] == "yes", f"{model_type} {check}: {row.cells[check]}"
    for check, allowed in ANSWERS.items():
        assert row.cells[check].startswith(allowed), f"{model_type} {check}: {row.cells[check]}"
    assert row.cells["fsdp"].startswith("yes: "), row.cells["fsdp"]  # a wrap unit for FSDP2


def test_the_trainer_refuses_packing_a_hybrid_with_the_matrixs_reason(make_recipe, tmp_path, capsys):
    """A hybrid with state-space layers and data.packing: exit 2 before training, with the reason the
    matrix's varlen cell reports (training.model.attention.packing_refusal)."""
    tiny_model("nemotron_h").build().save_pretrained(tmp_path / "hybrid")
    why = packing_refusal(tiny_model("nemotron_h").build())
    assert why.startswith("nemotron_h's NemotronHMamba2Mixer layers carry state along the sequence")
    assert packing_refusal(tiny_model("llama").build()) == ""
    recipe = make_recipe(
        model={"name_or_path": str(tmp_path / "hybrid"), "tokenizer": TOKENIZER},
        data={
            "train": str(ROOT / "data/dates/train.jsonl"),
            "format": "chat",
            "packing": True,
            "max_length": 128,
        },
        train={"max_steps": 1},
    )
    with pytest.raises(SystemExit) as refused:
        train_inprocess(recipe)
    assert refused.value.code == 2
    assert f"error: data.packing: {why}" in capsys.readouterr().err
    assert not (tmp_path / "run/checkpoints").exists()


def test_a_drafter_is_refused_before_loading_with_the_matrixs_reason(make_recipe, tmp_path, capsys):
    """Gemma 4's assistant (a drafter for assisted generation) is listed as a causal LM but cannot run on its
    own: exit 2 naming model.name_or_path, the reason the matrix reports for the type, no weights read."""
    AutoConfig.for_model("gemma4_unified_assistant").save_pretrained(tmp_path / "drafter")  # no weights
    why = type_refusal("gemma4_unified_assistant")
    assert "a drafter for assisted generation" in why and type_refusal("llama") is None
    assert check_type("gemma4_unified_assistant").cells["lora"] == f"no (refused): {why}"
    recipe = make_recipe(
        model={"name_or_path": str(tmp_path / "drafter"), "tokenizer": TOKENIZER},
        data={"train": str(ROOT / "data/dates/train.jsonl"), "format": "chat"},
        train={"max_steps": 1},
    )
    with pytest.raises(SystemExit) as refused:
        train_inprocess(recipe)
    assert refused.value.code == 2
    assert f"error: model.name_or_path: {tmp_path / 'drafter'}: {why}" in capsys.readouterr().err


def test_image_text_refusals_leave_the_types_text_classes_to_train_as_causal_lms():
    """Fuyu's image-text model reads flat patches the trainer's batches do not carry, and Llama 4's image-text
    forward is broken in transformers 5.24: both are refused as image-text models, but their causal-LM classes
    train on text, and their support rows say so (a drafter is refused either way)."""
    for model_type in ("fuyu", "llama4"):
        assert type_refusal(model_type) is not None and type_refusal(model_type, image_text=False) is None
    assert type_refusal("gemma4_unified_assistant", image_text=False) is not None
    assert check_type("fuyu").cells["lora"] == "yes"


def test_a_linear_layer_with_its_own_forward_is_left_out_of_all_linear():
    """DeepSeek-V4's grouped output projection is an nn.Linear whose forward multiplies per group: peft's LoRA
    on it gave a shape error at the first step. all-linear leaves it frozen and says so; the rest trains."""
    model = tiny_model("deepseek_v4").build()
    targets = resolve(model, lora_recipe("deepseek_v4").method.lora)
    assert "self_attn.o_a_proj" not in targets.modules and "self_attn.o_b_proj" in targets.modules
    assert "self_attn.o_a_proj (DeepseekV4GroupedLinear) stay frozen" in targets.note
    assert check_lora(tiny_model("deepseek_v4")) == "yes"


def test_the_tiled_mlp_takes_the_embeddings_width_where_the_text_config_names_no_hidden_size():
    """BLT's text config has no hidden_size (model.tiled_mlp: true tiles by it): the embeddings' width is used,
    and the tiled model equals the untiled one (the matrix's tiled check)."""
    assert not hasattr(tiny_model("blt").build().config.get_text_config(), "hidden_size")
    assert check_tiled(tiny_model("blt")) == "yes"
