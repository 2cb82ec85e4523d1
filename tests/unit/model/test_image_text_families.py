"""The image-text families users bring most, through the support matrix's image-text checks
(training.tools.image_text_support, which benchmarks.image_text_models runs for docs/models.md on every type):
each built tiny from its own transformers config class with its own processor class, saved as a checkpoint and
trained by training.train on two chat records with a picture each. LoRA and full fine-tuning train with finite losses and
move what they train; final/ loads in plain transformers (and peft) with the logits the trained model gave.
Qwen2.5-VL's processor cannot load without torchvision: there the trainer refuses before training, saying so."""

from __future__ import annotations

import importlib.util

import pytest

from training.tools.image_text_support import check_type

# (type, the runs checked): Qwen2.5-VL once (without torchvision the answer is the processor's, before training)
FAMILIES = [("idefics3", ("lora", "full")), ("gemma3", ("lora", "full")), ("qwen2_5_vl", ("lora",))]
TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.mark.parametrize("model_type, methods", FAMILIES, ids=[t for t, _ in FAMILIES])
def test_a_common_image_text_family_trains_and_reloads_or_is_refused_with_the_reason(model_type, methods):
    row = check_type(model_type, methods)
    if model_type == "qwen2_5_vl" and not TORCHVISION:
        said = row.cells["lora"]
        assert said.startswith(
            "no (refused): model.name_or_path: cannot load the processor of the image-text model"
        )
        assert said.endswith("processors with a video part need torchvision)"), said
        assert row.cells["reload"] == "no: neither run trained"
        return
    for method in methods:
        assert row.cells[method] == "yes", f"{model_type} {method}: {row.cells[method]}"
    assert row.cells["reload"] == ("yes" if len(methods) == 2 else f"yes ({methods[0]} only)"), row.cells[
        "reload"
    ]
