"""The rollout engine on a server (rl.generator: server): the Engine interface of training.generation.engine, with
completions drawn by an OpenAI-compatible server on another process or machine (python -m training.serve, whose
/v1/completions takes token ids and returns the drawn ids) instead of in the training process.

Each completion is its own request, its seed the completion's key (seed, step, row, generation, turn), sent
together so the server draws them in one batch; our server draws choice 0 of a seed from the generator of that
seed, as the transformers engine does, so a run drawn on it equals the run drawn in process (the same weights,
the same dtype and device kind). Before the first draw of each step (and of each held-out evaluation) the policy's
weights are pushed to POST /v1/weights: the whole model for full fine-tuning, the base with the LoRA adapter merged
in for LoRA (as TRL pushes to vLLM), only the modules training changes. Or (rl.server_push: adapter) only the LoRA
adapter, saved under the run directory and loaded by the server from there under a new name through vLLM's
POST /v1/load_lora_adapter (the name before it unloaded), the completions then asked of that name: what `vllm serve
--enable-lora` takes as well as ours (training/generation/adapters_api.py).
"""

from __future__ import annotations

import logging
import re
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import save as save_safetensors

from training.core.errors import RecipeError
from training.generation.keyed import Completions, Request
from training.generation.requests_engine import RequestEngine, padded_completions
from training.generation.transformers_engine import TransformersEngine
from training.model.adapter_reload import save_reloadable

TIMEOUT_S = 600.0


def pushed_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights that training changes, under the plain model's names, on the CPU: a LoRA adapter merged
    into its base layers (peft's merge_adapter, undone after), else the trainable parameters."""
    if not hasattr(model, "peft_config"):
        return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    prefix = model.prefix  # "lora_"
    adapted = {n.rsplit(f".{prefix}", 1)[0] for n, _ in model.named_parameters() if f".{prefix}" in n}
    out = {}
    model.merge_adapter()
    try:
        for name, p in model.named_parameters():
            module = name.rsplit(".", 1)[0]
            if prefix in name or "original_module" in name:
                continue
            if module.removesuffix(".base_layer") in adapted or p.requires_grad:
                plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
                out[plain.replace("modules_to_save.default.", "")] = p.detach().cpu().clone()
    finally:
        model.unmerge_adapter()
    return out


class AdapterPush:
    """rl.server_push: adapter. Each push saves the policy's adapter to DIRECTORY/NAME and has the server load it as
    NAME (new at every push: `<served model>-lora-<run>-rank<r>-<n>`, so a server never mixes two versions, nor
    two ranks' or a resumed run's), then unloads the one before and deletes its directory."""

    def __init__(self, directory: Path, rank: int):
        self.directory, self.rank = Path(directory), rank
        self.run, self.count = secrets.token_hex(3), 0
        self.current: str | None = None  # the name the server holds
        for stale in self.directory.glob(f"*-rank{rank}-*"):  # a killed run's, loaded by the server before
            shutil.rmtree(stale, ignore_errors=True)

    def push(self, engine: ServerEngine, model: torch.nn.Module) -> str:
        """The name the server now draws the policy's adapter by."""
        self.count += 1
        model_name = re.sub(r"[^A-Za-z0-9._-]", "-", engine.model)  # vLLM's default name is the hub path, a/b
        name = f"{model_name}-lora-{self.run}-rank{self.rank}-{self.count}"
        path = self.directory / name
        adapter = getattr(model, "active_adapter", "default")
        model.save_pretrained(path, selected_adapters=[adapter], safe_serialization=True)
        if adapter != "default":  # peft writes any other adapter in a directory of its name
            path = path / adapter
        save_reloadable(model, path)
        # base_model_name: ours picks the base by it where it serves several; vLLM (one base) ignores it
        body = {"lora_name": name, "lora_path": str(path.resolve()), "base_model_name": engine.model}
        r = engine.client.post("/load_lora_adapter", json=body)
        if r.status_code == 404:
            raise RecipeError(
                f"rl.server_push=adapter: the server at {engine.url} does not load LoRA adapters while it runs "
                "(POST /v1/load_lora_adapter: 404); start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or python -m training.serve; or push the weights "
                "(rl.server_push=weights)"
            )
        engine.check_answer(r, "rl.server_push=adapter (the server could not load the policy's adapter)")
        if self.current is not None:
            engine._call("POST", "/unload_lora_adapter", json={"lora_name": self.current})
            shutil.rmtree(self.directory / self.current, ignore_errors=True)
        self.current = name
        return name


class ServerEngine(RequestEngine):
    """The Engine interface on an OpenAI-compatible server (see the module doc)."""

    synced = False  # each process asks the server on its own

    def __init__(
        self,
        base: TransformersEngine,
        url: str,
        model: str | None,
        api_key: str | None = None,
        adapters: AdapterPush | None = None,
    ):
        self.base, self.url, self.model = base, url.rstrip("/"), model
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per completion request
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=TIMEOUT_S)
        self.adapters = adapters  # rl.server_push: adapter
        self.drawn_as = model  # the name the completions are asked of (a pushed adapter's)
        self._pushed = None  # the key of the weights the server holds
        self._lock = threading.Lock()  # a push and the draws on it, whole (rl.async draws beside evaluation)

    def check(self, key: str) -> None:
        """RecipeError (exit 2, naming `key`) unless the server answers and serves the model."""
        try:
            cards = self._call("GET", "/models").json()["data"]
            names = [m["id"] for m in cards if not m.get("parent")]  # not the adapters loaded on them
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError, TypeError, AttributeError) as e:
            raise RecipeError(
                f"{key}: no OpenAI-compatible server answers at {self.url} ({e}); start one, e.g. "
                f"python -m training.serve MODEL --port 8000, and give http://127.0.0.1:8000/v1"
            ) from None
        if self.model is None and len(names) == 1:
            self.model = self.drawn_as = names[0]
        elif self.model is None:
            raise RecipeError(
                f"rl.server_model: the server at {self.url} serves {', '.join(names)}: name one"
            )
        elif self.model not in names:
            raise RecipeError(
                f"rl.server_model: the server at {self.url} serves {', '.join(names)}, not {self.model!r}"
            )

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        return self.check_answer(self.client.request(method, path, **kw))

    def check_answer(
        self, r: httpx.Response, keys: str = "rl.server_url / rl.server_model"
    ) -> httpx.Response:
        """`r`, or RecipeError naming `keys` (a 4xx: what was asked does not fit what the server serves) or
        RuntimeError. The message is OpenAI's error object's (or vLLM's older top-level one), else the body."""
        if r.status_code != 200:
            try:
                body = r.json()
                message = body.get("error", body)["message"]
            except (ValueError, KeyError, TypeError, AttributeError):
                message = r.text[:300]
            said = f"the generation server at {self.url} answered {r.status_code}: {message}"
            if 400 <= r.status_code < 500:  # what was asked of it does not fit what it serves
                raise RecipeError(f"{keys}: {said}")
            raise RuntimeError(said)
        return r

    def push(self, model: torch.nn.Module) -> None:
        if self.adapters is not None:
            self.drawn_as = self.adapters.push(self, model)
            return
        body = save_safetensors(pushed_weights(model))
        self._call("POST", "/weights", params={"model": self.model}, content=body)

    def _one(self, r: Request) -> list[int]:
        b = self.base
        body = {
            "model": self.drawn_as,
            "prompt": r.ids,
            "max_tokens": r.max_new_tokens,
            "temperature": 0.0 if r.seed is None else b.temperature,
            "top_p": b.top_p,
            "seed": r.seed,
            "return_token_ids": True,
        }
        return self._call("POST", "/completions", json=body).json()["choices"][0]["token_ids"]

    @torch.no_grad()
    def batch(self, model, requests: list[Request], device, version=None, prefixes=None) -> Completions:
        """The completions of `requests`, each its own request (sent together), the weights pushed first when the
        policy may have changed (`version`: the step it is at; `model`: the live policy, or rl.async's copy)."""
        key = ("eval" if all(r.seed is None for r in requests) else "rollout", version, id(model))
        start = time.perf_counter()
        with self._lock:
            if key != self._pushed:
                self.push(model)
                self._pushed = key
            with ThreadPoolExecutor(max_workers=min(64, len(requests))) as pool:
                tokens = list(pool.map(self._one, requests))
        c = padded_completions(tokens, self.eos_token_ids, self.pad_token_id, time.perf_counter() - start)
        return Completions(c.ids.to(device), c.mask.to(device), c.seconds)

    def idle(self, model, device) -> None:  # never synced: no idle calls
        return None
