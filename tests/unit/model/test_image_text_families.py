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
import torch
from transformers import AutoModelForImageTextToText

from training.tools.image_text_support import check_type, checkpoint, prompt_inputs, records

FAMILIES = ["idefics3", "gemma3", "qwen2_5_vl", "qwen3_vl", "mistral3", "gemma4", "blip-2"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_common_image_text_family_trains_and_reloads_with_equal_logits(model_type):
    row = check_type(model_type, ("lora", "full"))
    assert row.cells == {"lora": "yes", "full": "yes", "reload": "yes"}, row.cells


# the image-text types whose pictures are no image tokens in the text (BLIP, UDOP, T5Gemma 2's encoder, Kosmos-2's
# position mask, Fuyu's flat patches), or that take no pictures (Mistral 4's language model) or learn no next token
# (pi0's actions)
REFUSED = ["blip", "udop", "t5gemma2", "mistral4", "pi0", "fuyu", "kosmos-2"]


@pytest.mark.parametrize("model_type", REFUSED)
def test_a_type_whose_pictures_are_no_image_tokens_is_refused_with_what_to_train_instead(model_type):
    row = check_type(model_type, ("lora", "full"))
    assert set(row.cells) == {"lora", "full", "reload"}
    for cell in row.cells.values():
        assert cell.startswith(f"no (refused): '{model_type}' is ") and "train a" in cell, cell


def test_a_model_that_needs_the_tokens_modalities_its_processor_gives_only_when_asked_trains(tmp_path):
    """Cosmos3-Edge's processor lists mm_token_type_ids among its model inputs but returns them only with
    return_mm_token_type_ids=True, and its model refuses pictures without them: the trainer's batches carry
    them (training.data.images.makes_token_types), and so does the prompt the checks compare logits on."""
    _, proc = checkpoint("cosmos3_edge", tmp_path / "checkpoint")
    inputs = prompt_inputs(proc, records(tmp_path))
    image_id = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    assert inputs["mm_token_type_ids"].tolist() == (inputs["input_ids"] == image_id).long().tolist()
    row = check_type("cosmos3_edge", ("lora", "full"))
    assert row.cells == {"lora": "yes", "full": "yes", "reload": "yes"}, row.cells


def test_got_ocr2_built_tiny_makes_the_256_tokens_per_picture_its_processor_writes(tmp_path):
    """GOT-OCR2's processor writes 256 image tokens per picture (a class constant its saved config does not
    carry): the tiny model's encoder sees 64 x 64 patches, which its projector folds to 16 x 16 features, and
    the checks' rows are long enough for them (LONGER_ROWS)."""
    ckpt, proc = checkpoint("got_ocr2", tmp_path / "checkpoint")
    inputs = prompt_inputs(proc, records(tmp_path))
    model = AutoModelForImageTextToText.from_pretrained(ckpt)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    assert int((inputs["input_ids"] == proc.image_token_id).sum()) == features.shape[1] == 256
    row = check_type("got_ocr2", ("lora", "full"))
    assert row.cells == {"lora": "yes", "full": "yes", "reload": "yes"}, row.cells


def test_fuyus_tiny_processor_keeps_every_token_of_the_picture(tmp_path):
    """Fuyu's processor drops the first token of a picture's part, the "▁" its SentencePiece tokenizer writes
    before |SPEAKER|: the tiny build's tokenizer splits as SentencePiece does (WORD_START), so a 32 x 32 picture
    keeps its 4 x 4 patch tokens and 4 row ends."""
    from training.model.tiny import tiny_image_text_config
    from training.model.tiny_processor import tiny_processor

    proc = tiny_processor("fuyu", tiny_image_text_config("fuyu"))
    inputs = prompt_inputs(proc, records(tmp_path))
    ids = inputs["input_ids"][0].tolist()
    assert (ids.count(proc.image_token_id), ids.count(proc.image_newline_id)) == (16, 4)
