"""The composed image-text model (model.vision): "bring your own language model" copies the pretrained
causal LM's weights into the LLaVA model's language model and head, the new encoder and projector train,
and `tower: frozen` freezes the encoder alone."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from conftest import TINY_ARCH, TOKENIZER
from training.config import parse_recipe
from training.data import load_tokenizer
from training.model.build import build_model

VISION = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64}
VISION.update(num_hidden_layers=1, num_attention_heads=2)


def recipe_with(tmp_path, model: dict):
    return parse_recipe(
        {"output_dir": str(tmp_path / "run"), "model": model, "data": {"train": "x.jsonl", "format": "chat"}}
    )


def test_a_pretrained_language_model_is_copied_into_the_composed_model(tiny_model_dir, tmp_path):
    recipe = recipe_with(tmp_path, {"name_or_path": str(tiny_model_dir), "vision": dict(VISION)})
    tok = load_tokenizer(recipe.model)
    model = build_model(recipe, tok, torch.device("cpu"))
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    mine = model.model.language_model.state_dict()
    for name, value in lm.model.state_dict().items():
        if name == "embed_tokens.weight":  # one more row: the image token added to the tokenizer
            assert mine[name].shape[0] == value.shape[0] + 1 == len(tok)
            torch.testing.assert_close(mine[name][: value.shape[0]], value)
        else:
            torch.testing.assert_close(mine[name], value, msg=name)
    trained = {
        n.split(".")[1] for n, p in model.named_parameters() if p.requires_grad and n.startswith("model.")
    }
    assert trained == {"vision_tower", "multi_modal_projector", "language_model"}


def test_a_frozen_tower_leaves_only_the_projector_and_language_model_to_train(tmp_path):
    model_section = {
        "tokenizer": TOKENIZER,
        "from_scratch": dict(TINY_ARCH),
        "vision": {**VISION, "tower": "frozen"},
    }
    recipe = recipe_with(tmp_path, model_section)
    model = build_model(recipe, load_tokenizer(recipe.model), torch.device("cpu"))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("model.vision_tower.") for n in frozen)
    assert all(p.requires_grad for p in model.model.multi_modal_projector.parameters())


def test_the_saved_processor_renders_image_parts_as_training_did(tmp_path):
    """final/'s processor takes transformers' content parts ({"type": "image"}, {"type": "text"}) and renders
    the string training rendered for the same record: the image token in the image part's place."""
    from training.data.images import image_processor
    from training.model.vision import processor_for

    recipe = recipe_with(
        tmp_path, {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH), "vision": VISION}
    )
    tok = load_tokenizer(recipe.model)
    processor = processor_for(recipe, tok, image_processor(recipe.model.vision.image_size))
    parts = [
        {"role": "system", "content": "Look closely."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A circle."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And "}, {"type": "image"}, {"type": "text", "text": "?"}],
        },
    ]
    strings = [
        {"role": "system", "content": "Look closely."},
        {"role": "user", "content": "<image>What shape?"},
        {"role": "assistant", "content": "A circle."},
        {"role": "user", "content": "And <image>?"},
    ]
    want = tok.apply_chat_template(strings, tokenize=False, add_generation_prompt=True)
    assert want.count("<image>") == 2
    assert processor.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == want
    assert processor.apply_chat_template(strings, tokenize=False, add_generation_prompt=True) == want
