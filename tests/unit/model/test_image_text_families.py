"""The image-text families users bring most, through the support matrix's image-text checks
(training.tools.image_text_support, which benchmarks.image_text_models runs for docs/models.md on every type):
each built tiny from its own transformers config class with its own processor class, saved as a checkpoint and
trained by training.train on two chat records with a picture each. LoRA and full fine-tuning train with finite losses and
move what they train; final/ loads in plain transformers (and peft) with the logits the trained model gave.
Mistral 3 (Pixtral's [IMG] tokens, its merged patches) and Gemma 4 (a heterogeneous config, audio tokens its
processor insists on) joined with torchvision in the stack; BLIP-2 (its processor writes the Q-Former's query tokens
before the whole text, the trainer in the placeholder's place). Qwen2.5-VL without torchvision is in
tests/integration/test_qwen_vl.py."""

from __future__ import annotations

import pytest

from training.tools.image_text_support import check_type

FAMILIES = ["idefics3", "gemma3", "qwen2_5_vl", "qwen3_vl", "mistral3", "gemma4", "blip-2"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_common_image_text_family_trains_and_reloads_with_equal_logits(model_type):
    row = check_type(model_type, ("lora", "full"))
    assert row.cells == {"lora": "yes", "full": "yes", "reload": "yes"}, row.cells


# the image-text types whose pictures are no image tokens in the text (BLIP, UDOP, T5Gemma 2's encoder), or that
# take no pictures (Mistral 4's language model, Evolla's proteins) or learn no next token (pi0's actions,
# DiffusionGemma's denoising)
REFUSED = ["blip", "instructblip", "udop", "t5gemma2", "mistral4", "evolla", "pi0", "diffusion_gemma"]


@pytest.mark.parametrize("model_type", REFUSED)
def test_a_type_whose_pictures_are_no_image_tokens_is_refused_with_what_to_train_instead(model_type):
    row = check_type(model_type, ("lora", "full"))
    assert set(row.cells) == {"lora", "full", "reload"}
    for cell in row.cells.values():
        assert cell.startswith(f"no (refused): '{model_type}' is ") and "train a" in cell, cell
