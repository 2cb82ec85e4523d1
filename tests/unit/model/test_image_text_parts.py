"""The parts of a pretrained image-text model (training.model.vision.image_text_parts) where transformers' layout
is not LLaVA's: Llama 4 has no base model inside (its parts are its own children), Gemma 4 Unified has no vision
tower (its patches go into the language model through an embedder), Granite 4 Vision's projectors are in
ModuleLists, Emu3's and Chameleon's tower is a VQ image tokenizer; and a per-layer config attribute
(training.model.layer_config) read per layer: Gemma 4's heterogeneous head size, Gemma 3n's list of MLP widths."""

from __future__ import annotations

import pytest
from accelerate import init_empty_weights
from transformers import AutoModelForImageTextToText

from training.config.architectures import has_vision_part
from training.model import layer_config
from training.model.tiny import tiny_config, tiny_image_text_config
from training.model.vision import image_text_parts


def meta_model(model_type: str):
    with init_empty_weights():
        return AutoModelForImageTextToText.from_config(tiny_image_text_config(model_type))


@pytest.mark.parametrize(
    "model_type, want",
    [
        (
            "llama4",
            {
                "tower": ["vision_model"],
                "projector": ["multi_modal_projector"],
                "language model": ["language_model"],
            },
        ),
        (
            "gemma4_unified",
            {"tower": [], "projector": ["model.embed_vision"], "language model": ["model.language_model"]},
        ),
        (
            "llava",
            {
                "tower": ["model.vision_tower"],
                "projector": ["model.multi_modal_projector"],
                "language model": ["model.language_model"],
            },
        ),
    ],
)
def test_the_parts_are_found_whatever_the_layout(model_type, want):
    assert image_text_parts(meta_model(model_type)) == want


def test_a_projector_in_a_container_trains_module_by_module():
    # Granite 4 Vision's projectors are ModuleLists (one per vision layer, one per spatial group): peft's
    # modules_to_save refuses a container, so each projector in it is a part of its own
    projector = image_text_parts(meta_model("granite4_vision"))["projector"]
    assert "model.layerwise_projectors.0" in projector and "model.spatial_projectors.3" in projector
    assert "model.layerwise_projectors" not in projector and "model.spatial_projectors" not in projector


@pytest.mark.parametrize("model_type, decoder", [("emu3", "model.text_model"), ("chameleon", "model")])
def test_a_vq_image_tokenizer_is_the_tower(model_type, decoder):
    # Emu3's and Chameleon's pictures are codes of a VQ tokenizer, tokens of the text: no projector; Chameleon's
    # language model is its base model, the tokenizer inside it
    cfg = tiny_image_text_config(model_type)
    cfg.vocabulary_map = {"<image>": 5}  # the model reads its image token here (tiny_processor fills it)
    with init_empty_weights():
        model = AutoModelForImageTextToText.from_config(cfg)
    assert image_text_parts(model) == {
        "tower": ["model.vqmodel"],
        "projector": [],
        "language model": [decoder],
    }
    assert (
        has_vision_part(cfg) and has_vision_part(cfg.to_dict()) and not has_vision_part(tiny_config("llama"))
    )


def test_a_per_layer_attribute_is_read_per_layer():
    gemma4 = tiny_config("gemma4_text")  # its layer 1 (full attention) has a head size of its own
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        gemma4.head_dim  # noqa: B018 - what the planner read before
    heads = layer_config.layer_values(gemma4, "head_dim")
    assert len(heads) == 2 and heads[1] == 32 and heads[0] != 32
    assert layer_config.largest(gemma4, "head_dim") == max(heads)
    assert layer_config.mean(gemma4, "head_dim") == round(sum(heads) / 2)
    gemma3n = tiny_image_text_config("gemma3n").text_config
    assert isinstance(gemma3n.intermediate_size, list)
    assert layer_config.layer_values(gemma3n, "intermediate_size") == list(gemma3n.intermediate_size)
    llama = tiny_config("llama")
    assert (
        layer_config.layer_values(llama, "intermediate_size")
        == [llama.intermediate_size] * llama.num_hidden_layers
    )
    assert layer_config.largest(llama, "no_such_attribute") is None
