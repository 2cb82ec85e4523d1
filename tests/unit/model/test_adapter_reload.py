"""final/'s adapter as peft loads it back (training.model.adapters.keys_renamed_on_reload): for a few families
transformers 5's checkpoint key conversion, which peft applies to adapter keys on load, renames keys that are
already in the new names, and those adapters reload as zero. The keys found are exactly the ones peft then
reports missing; a family without such a conversion has none."""

from __future__ import annotations

import warnings

import pytest
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from training.model.adapters import keys_renamed_on_reload
from training.model.tiny import tiny_config
from training.tools.image_text_support import checkpoint


def missing_on_reload(load_base, saved) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        PeftModel.from_pretrained(load_base(), saved)
    said = [str(w.message) for w in seen if "Found missing adapter keys" in str(w.message)]
    return said


@pytest.mark.parametrize("family", ["inkling2", "llama"])
def test_the_keys_found_are_those_peft_does_not_load_back(family, tmp_path):
    if family == "llama":
        config = tiny_config("llama")

        def load_base():
            return AutoModelForCausalLM.from_config(config)

        targets = ["q_proj", "v_proj"]
    else:
        ckpt, _ = checkpoint(family, tmp_path / "base")

        def load_base():
            return AutoModelForImageTextToText.from_pretrained(ckpt)

        # Inkling2's sconv.weight_proj is renamed on load by 5.24's conversion; its sink_proj is not
        targets = ["weight_proj", "sink_proj"]
    model = get_peft_model(load_base(), LoraConfig(r=2, target_modules=targets))
    model.save_pretrained(tmp_path / "final")
    lost = keys_renamed_on_reload(model, tmp_path / "final")
    said = missing_on_reload(load_base, tmp_path / "final")
    assert bool(lost) == bool(said), (lost, said)  # found exactly where peft drops some (inkling2 on 5.24)
    if family == "llama":
        assert lost == []
    assert all("weight_proj" in k for k in lost)
