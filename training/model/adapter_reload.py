"""final/'s adapter as peft loads it back.

transformers 5 renames checkpoint keys on load from a family's old names to its current ones
(transformers.conversion_mapping), and peft 0.21 applies the same conversion to adapter keys on
PeftModel.from_pretrained, although peft saved them in the current names: Mistral Large 4's
`mlp.shared_experts.` becomes `mlp.mlp.shared_experts.`, Inkling2's `sconv.weight_proj` becomes
`sconv.weight_proj.weight`, and those adapters reload as zero (peft says so in a warning only).

save_reloadable rewrites each such key at export into the form that peft's load-time conversion maps back
onto the model's name (the renamings that fired on it, undone with transformers' own reverse transforms,
checked by running peft's conversion on the result). Where no form maps back (Inkling2's weight_proj: the
renaming fires on every key that names it), the key stays and is reported; unreloadable_modules names such
linear layers beforehand, so that `all-linear` can leave them frozen rather than train adapters that reload
as zero.
"""

from __future__ import annotations

from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"


def peft_converted(model, state: dict[str, torch.Tensor], config=None, name: str = "default") -> dict:
    """`state` (adapter keys as saved) as peft's load-time conversion hands it on (as itself where this peft
    has no such conversion)."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
    except ImportError:  # pragma: no cover - a peft without transformers 5's conversion
        return state
    if config is None:
        from peft import LoraConfig

        config = LoraConfig()
    return convert_peft_adapter_state_dict_for_transformers(model, config, dict(state), name)


def model_renamings(model) -> list:
    """The WeightRenamings of the model's key conversion, scoped to their sub-models, in load order."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # pragma: no cover - a transformers without the conversion
        return []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [t for t in get_model_conversion_mapping(base) if isinstance(t, WeightRenaming)]


def undone(key: str, renamings: list) -> str:
    """`key` with the renamings that fire on it undone, the last first (transformers' reverse_transform)."""
    name = key.removeprefix(PEFT_PREFIX)
    fired = []
    renamed = name
    for r in renamings:
        renamed, pattern = r.rename_source_key(renamed)
        if pattern is not None:
            fired.append(r)
    for r in reversed(fired):
        try:
            name, _ = r.reverse_transform().rename_source_key(name)
        except Exception:  # noqa: BLE001 (a renaming with no clean reverse: the key stays as saved)
            return key
    return PEFT_PREFIX + name if key.startswith(PEFT_PREFIX) else name


def reloadable(model, state: dict[str, torch.Tensor], config=None) -> tuple[dict, list[str]]:
    """(`state` with each key that peft would rename on load written in the form it maps back from, the keys
    that no form brings back). Only LoRA keys are looked at, as peft converts only those."""
    lost = sorted(set(state) - set(peft_converted(model, state, config)))
    if not lost:
        return state, []
    renamings = model_renamings(model)
    candidate = {k: undone(k, renamings) for k in lost}
    rewritten = {candidate.get(k, k): v for k, v in state.items()}
    back = set(peft_converted(model, rewritten, config))
    kept = {k for k in lost if k not in back}  # their rewritten form does not come back either
    rewritten = {(k if k in kept else candidate.get(k, k)): v for k, v in state.items()}
    return rewritten, sorted(set(state) - set(peft_converted(model, rewritten, config)))


def save_reloadable(model, saved: Path) -> list[str]:
    """Rewrite saved/adapter_model.safetensors (a peft model's save_pretrained) so that peft loads every key
    it can back onto its layer; the keys it still cannot ([] where all load back, or `saved` holds no
    adapter)."""
    from safetensors.torch import load_file, save_file

    file = Path(saved) / ADAPTER_FILE
    if not hasattr(model, "peft_config") or not file.is_file():
        return []
    name = getattr(model, "active_adapter", "default")
    state = load_file(file)
    rewritten, lost = reloadable(model, state, model.peft_config[name])
    if rewritten is not state:
        save_file(rewritten, file, metadata={"format": "pt"})
    return lost


def keys_renamed_on_reload(model, saved: Path) -> list[str]:
    """The model's adapter keys that peft, loading saved/'s adapter back, fills from no saved weight (its
    conversion renamed them away, so those adapters reload as zero); [] where all come back, the model has
    no adapter, or this peft has no such conversion."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(saved) / ADAPTER_FILE
    if not hasattr(model, "peft_config") or not file.is_file():
        return []
    name = getattr(model, "active_adapter", "default")
    wanted = get_peft_model_state_dict(model, adapter_name=name)
    return sorted(set(wanted) - set(peft_converted(model, load_file(file), model.peft_config[name])))


def unreloadable_modules(model, names: list[str]) -> set[str]:
    """The modules among `names` (of the model before peft wraps it) whose LoRA weights no saved key brings
    back through peft's load-time conversion (Inkling2's short-convolution weight_proj)."""
    state = {f"{PEFT_PREFIX}{n}.lora_{ab}.weight": torch.zeros(1, 1) for n in names for ab in "AB"}
    _, lost = reloadable(model, state)
    return {k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in lost}
