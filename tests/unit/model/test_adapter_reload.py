"""final/'s adapter as peft loads it back (training.model.adapter_reload): transformers 5's checkpoint key
conversion, which peft applies to adapter keys on load, renames some families' keys that are already in the
current names, so those adapters would reload as zero. save_reloadable writes them in the form that maps back
(Mistral Large 4's shared experts); what no form brings back (Inkling2's sconv.weight_proj) is reported, and
'all-linear' on an image-text model leaves those layers frozen (vision.reloadable_targets), so that its
final/ reloads whole. A family without such a conversion is written as it was."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from training.model.adapter_reload import keys_renamed_on_reload, save_reloadable, unreloadable_modules
from training.model.tiny import tiny_config
from training.model.vision import reloadable_targets
from training.tools.image_text_support import checkpoint

IDS = torch.arange(3, 19).unsqueeze(0)  # a text-only prompt: every family here takes input_ids alone


def base_loader(family, tmp_path):
    if family == "llama":
        config = tiny_config("llama")
        torch.manual_seed(0)
        state = AutoModelForCausalLM.from_config(config).state_dict()

        def load_llama():
            model = AutoModelForCausalLM.from_config(config)
            model.load_state_dict(state)
            return model

        return load_llama
    ckpt, _ = checkpoint(family, tmp_path / "base")
    return lambda: AutoModelForImageTextToText.from_pretrained(ckpt)


def trained_adapter(load_base, targets, saved):
    """A LoRA model on `targets` whose B matrices are non-zero (as after training), saved to `saved`; its
    logits on IDS."""
    torch.manual_seed(1)
    model = get_peft_model(load_base(), LoraConfig(r=2, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
        logits = model.eval()(input_ids=IDS).logits
    model.save_pretrained(saved)
    return model, logits


def reloaded(load_base, saved) -> tuple[list[str], torch.Tensor]:
    """(the adapter keys peft says it did not load, the reloaded model's logits on IDS)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load_base(), saved)
    missing = [str(w.message) for w in seen if "Found missing adapter keys" in str(w.message)]
    with torch.no_grad():
        return missing, model.eval()(input_ids=IDS).logits


def language_model_linears(model) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".language_model." in f".{n}"
    ]


def test_mistral_large4s_shared_experts_are_saved_in_the_form_peft_maps_back(tmp_path):
    load_base = base_loader("mistral_large4", tmp_path)
    targets = ["gate_proj", "up_proj", "down_proj", "q_proj"]
    model, logits = trained_adapter(load_base, targets, tmp_path / "final")
    before = keys_renamed_on_reload(model, tmp_path / "final")
    assert any("shared_experts" in k for k in before)  # peft's conversion renames them as saved by peft
    assert reloaded(load_base, tmp_path / "final")[0]  # ... and reloads them as zero

    assert save_reloadable(model, tmp_path / "final") == []
    assert keys_renamed_on_reload(model, tmp_path / "final") == []
    assert_reloads_whole(load_base, tmp_path / "final", logits)


def assert_reloads_whole(load_base, final, logits) -> None:
    """peft loads every adapter weight of `final` back, and the model's logits are those it was saved with."""
    missing, again = reloaded(load_base, final)
    assert missing == []
    torch.testing.assert_close(again, logits, rtol=0, atol=0)


def test_inkling2s_weight_proj_cannot_be_saved_to_reload_and_is_reported(tmp_path):
    load_base = base_loader("inkling2", tmp_path)
    model, _ = trained_adapter(load_base, ["weight_proj", "sink_proj"], tmp_path / "final")
    lost = save_reloadable(model, tmp_path / "final")
    missing, _ = reloaded(load_base, tmp_path / "final")
    assert lost and all("sconv.weight_proj.lora_" in k for k in lost)  # sink_proj's come back
    assert (
        missing and "sconv.weight_proj" in missing[0] and "sink_proj" not in missing[0]
    )  # peft says the same
    assert unreloadable_modules(load_base(), language_model_linears(load_base())) == {
        k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in lost
    }


@pytest.mark.parametrize("family", ["inkling2", "mistral_large4"])
def test_all_linear_on_the_language_model_reloads_whole(family, tmp_path):
    load_base = base_loader(family, tmp_path)
    base = load_base()
    targets = reloadable_targets(base, language_model_linears(base))
    assert targets
    model, logits = trained_adapter(load_base, targets, tmp_path / "final")
    assert save_reloadable(model, tmp_path / "final") == []
    assert_reloads_whole(load_base, tmp_path / "final", logits)


def test_a_family_without_a_key_conversion_is_saved_as_it_was(tmp_path):
    load_base = base_loader("llama", tmp_path)
    model, logits = trained_adapter(load_base, ["q_proj", "v_proj"], tmp_path / "final")
    saved = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert save_reloadable(model, tmp_path / "final") == []
    assert load_file(tmp_path / "final" / "adapter_model.safetensors").keys() == saved.keys()
    assert_reloads_whole(load_base, tmp_path / "final", logits)
