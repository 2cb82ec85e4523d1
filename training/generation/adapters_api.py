"""LoRA adapters loaded and unloaded while the server runs, through vLLM's routes and bodies, so that a trainer
that pushes its adapter (rl.server_push: adapter, training/generation/server_engine.py) talks to `vllm serve
--enable-lora` (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and to python -m training.serve alike:

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": DIR[, "base_model_name": SERVED]}
    POST /v1/unload_lora_adapter  {"lora_name": NAME}

A loaded adapter is served under NAME like one given at start: attached by peft to the model that
`base_model_name` names (needed only when the server serves models of different bases), switched in by name, its
base's tokenizer, template and context. The model loaded alone becomes a peft model whose base is served with its
adapters disabled (what load_served does for an adapter given at start). The directory is read on this machine:
a trainer elsewhere needs a filesystem both see. Every refusal is OpenAI's error object (400, 404).
"""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict

from training.generation.openai_api import APIError, bad_request, served_model, validated
from training.generation.served import Served
from training.run.rundir import is_adapter


class LoadAdapter(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_path: str
    base_model_name: str | None = None
    load_inplace: bool = False  # vLLM's: replace the weights of an adapter loaded under this name


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are enough here


def parse_load(body: bytes) -> LoadAdapter:
    request = validated(body, LoadAdapter)
    if not request.lora_name.strip():
        raise bad_request("lora_name: give the name the adapter is served under", "lora_name")
    if not is_adapter(request.lora_path):
        raise bad_request(
            f"lora_path: {request.lora_path} holds no adapter_config.json (a peft adapter directory, as a "
            "run's final/ or save_pretrained writes it, on the server's machine)",
            "lora_path",
        )
    return request


def parse_unload(body: bytes) -> UnloadAdapter:
    return validated(body, UnloadAdapter)


def base_of(models: dict[str, Served], request: LoadAdapter) -> Served:
    """The served model the adapter attaches to: the one `base_model_name` names, else the only model served."""
    if request.base_model_name is not None:
        return served_model(models, request.base_model_name)
    distinct = {id(s.model): s for s in models.values()}
    if len(distinct) > 1:
        raise bad_request(
            f"this server serves models of different bases ({', '.join(models)}): name the one the adapter "
            "loads on with base_model_name",
            "base_model_name",
        )
    return next(iter(distinct.values()))


def load_adapter(models: dict[str, Served], request: LoadAdapter) -> Served:
    """The adapter at `request.lora_path` attached to its base: what serves it as `request.lora_name` (the
    caller adds it to `models`), or, with load_inplace, the adapter of that name with its new weights. 400 for a
    name in use or an adapter the base does not take."""
    name, path = request.lora_name, request.lora_path
    existing = models.get(name)
    if existing is not None and not (request.load_inplace and existing.adapter == name):
        raise bad_request(f"The lora adapter '{name}' has already been loaded", "lora_name")
    base = existing or base_of(models, request)
    with base.lock:
        try:
            model = _attached(base.model, name, path, replace=existing is not None)
        except (ValueError, OSError, RuntimeError, KeyError, TypeError) as e:
            raise bad_request(f"lora_path: {path} does not load on {base.name} ({e})", "lora_path") from None
        _rebind(models, base.model, model)  # it may now be a peft model
    if existing is not None:
        return existing
    return dataclasses.replace(base, name=name, source=path, adapter=name, parent=base.parent or base.name)


def _rebind(models: dict[str, Served], old, new) -> None:
    """Every name served by the model `old` served by `new` (the same weights, wrapped or unwrapped by peft)."""
    for s in models.values():
        if s.model is old:
            s.model = new


def _attached(model, name: str, path: str, replace: bool):
    """`model` with the adapter at `path` under `name` (a peft model; the model alone is wrapped)."""
    from peft import PeftModel

    if not hasattr(model, "peft_config"):
        return PeftModel.from_pretrained(model, path, adapter_name=name).eval()
    if replace:
        model.delete_adapter(name)
    model.load_adapter(path, adapter_name=name)
    return model.eval()


def adapter_to_unload(models: dict[str, Served], request: UnloadAdapter) -> Served:
    """What serves the adapter named `request.lora_name`; 404 for a name not served, 400 for a model that is
    not an adapter."""
    served = models.get(request.lora_name)
    if served is None:
        raise APIError(
            404,
            f"The lora adapter '{request.lora_name}' cannot be found",
            param="lora_name",
            code="model_not_found",
        )
    if served.adapter is None:
        raise bad_request(
            f"{request.lora_name} is a model, not an adapter: it cannot be unloaded", "lora_name"
        )
    return served


def unload_adapter(models: dict[str, Served], served: Served) -> None:
    """The adapter detached from its base (between draws); the last one gone, the names still served by that
    model are served by the plain model again (peft cannot generate with no adapter)."""
    model = served.model
    with served.lock:
        if len(model.peft_config) > 1:  # another made the active one first (peft's disable_adapter reads it)
            model.set_adapter(next(n for n in model.peft_config if n != served.adapter))
            model.delete_adapter(served.adapter)
            return
        _rebind(models, model, model.unload())
