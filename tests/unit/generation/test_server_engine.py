"""rl.server_push=adapter against a stand-in for `vllm serve --enable-lora` (httpx's MockTransport): what the trainer
asks of the server at each push (vLLM's load and unload bodies, a new name each time, the completions asked of the
newest), the directories it leaves, and the refusal of a server without runtime LoRA loading. The same pushes
against python -m training.serve, drawing a whole run: tests/integration/test_rl_server.py."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from training.core.errors import RecipeError
from training.generation import Request, TransformersEngine
from training.generation.server_engine import AdapterPush, ServerEngine


class FakeVLLM:
    """vLLM's routes as the trainer uses them; `lora_routes=False`: started without VLLM_ALLOW_RUNTIME_LORA_UPDATING;
    `max_rank`: its --max-lora-rank."""

    def __init__(self, lora_routes: bool = True):
        self.lora_routes, self.calls, self.loaded, self.max_rank = lora_routes, [], {}, 16

    def __call__(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path.removeprefix("/v1/")
        body = json.loads(request.content) if request.content else None
        self.calls.append((route, body))
        if route == "models":
            return httpx.Response(
                200, json={"data": [{"id": "base"}, *({"id": n, "parent": "base"} for n in self.loaded)]}
            )
        if route in ("load_lora_adapter", "unload_lora_adapter") and not self.lora_routes:
            return httpx.Response(404, json={"detail": "Not Found"})
        if route == "load_lora_adapter" and self.max_rank < 2:  # vLLM's older error body
            message = "LoRA rank 2 is greater than max_lora_rank 1."
            return httpx.Response(400, json={"object": "error", "message": message, "code": 400})
        if route == "load_lora_adapter":
            self.loaded[body["lora_name"]] = body["lora_path"]
            return httpx.Response(
                200, text=f"Success: LoRA adapter '{body['lora_name']}' added successfully."
            )
        if route == "unload_lora_adapter":
            del self.loaded[body["lora_name"]]
            return httpx.Response(200, text="Success")
        if route == "completions":
            return httpx.Response(200, json={"choices": [{"token_ids": [5, 2]}]})
        return httpx.Response(404, json={"detail": "Not Found"})


def engine_on(fake: FakeVLLM, directory, rank: int = 0) -> ServerEngine:
    base = TransformersEngine(0, 4, 1.0, 1.0, [2], 0)
    engine = ServerEngine(base, "http://vllm:8000/v1", None, adapters=AdapterPush(directory, rank))
    engine.client = httpx.Client(base_url=engine.url, transport=httpx.MockTransport(fake))
    engine.check("rl.server_url")
    return engine


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(LlamaForCausalLM(config), lora)


def test_each_push_loads_a_new_name_unloads_the_one_before_and_draws_from_it(policy, tmp_path):
    (tmp_path / "base-lora-0a0a0a-rank0-3").mkdir(parents=True)  # a killed run's, of this rank
    (tmp_path / "base-lora-0a0a0a-rank1-3").mkdir()  # another rank's: not this one's to remove
    fake = FakeVLLM()
    engine = engine_on(fake, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base-lora-0a0a0a-rank1-3"]
    for version in (1, 2):
        assert engine.batch(policy, [Request([1, 2], 7, 4)], "cpu", version=version).ids.tolist() == [[5, 2]]
    loads = [body for route, body in fake.calls if route == "load_lora_adapter"]
    first, second = (b["lora_name"] for b in loads)
    assert all(b["base_model_name"] == "base" for b in loads)  # ours picks the base by it; vLLM ignores it
    assert first.startswith("base-lora-") and first.endswith("-rank0-1") and second.endswith("-rank0-2")
    assert ("unload_lora_adapter", {"lora_name": first}) in fake.calls
    asked = [body["model"] for route, body in fake.calls if route == "completions"]
    assert asked == [first, second] and list(fake.loaded) == [second]
    # (the names' middle part differs from run to run: sorted, `second` came first once in a full run)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["base-lora-0a0a0a-rank1-3", second])
    saved = json.loads((tmp_path / second / "adapter_config.json").read_text())
    assert saved["r"] == 2 and (tmp_path / second / "adapter_model.safetensors").is_file()


def test_a_served_name_with_a_slash_makes_one_directory_a_push(policy, tmp_path):
    """vllm serve names its model by the hub path it loaded: the adapter's name and directory keep no slash."""
    fake = FakeVLLM()
    engine = engine_on(fake, tmp_path)
    engine.model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    engine.batch(policy, [Request([1, 2], 7, 4)], "cpu", version=1)
    (pushed,) = tmp_path.iterdir()
    assert pushed.name.startswith("HuggingFaceTB-SmolLM2-135M-Instruct-lora-") and list(fake.loaded) == [
        pushed.name
    ]


def test_a_resumed_run_draws_from_the_base_whatever_adapters_a_killed_run_left_loaded(tmp_path):
    """vLLM lists the adapters it holds beside the base (their cards name it as parent): the served model a run
    defaults to is the base."""
    fake = FakeVLLM()
    fake.loaded = {"base-lora-0a0a0a-rank0-4": "/x", "base-lora-0b0b0b-rank1-4": "/y"}
    assert engine_on(fake, tmp_path).model == "base"


def test_a_server_that_cannot_load_adapters_is_refused_with_what_to_start(policy, tmp_path):
    engine = engine_on(FakeVLLM(lora_routes=False), tmp_path)
    with pytest.raises(RecipeError, match="does not load LoRA adapters while it runs") as e:
        engine.batch(policy, [Request([1, 2], 7, 4)], "cpu", version=1)
    said = str(e.value)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in said and "rl.server_push=weights" in said


def test_an_adapter_the_server_refuses_names_the_key_and_what_the_server_said(policy, tmp_path):
    narrow = FakeVLLM()
    narrow.max_rank = 1  # vllm serve --max-lora-rank 1; the policy's r is 2
    with pytest.raises(RecipeError) as e:
        engine_on(narrow, tmp_path).batch(policy, [Request([1, 2], 7, 4)], "cpu", version=1)
    assert str(e.value).startswith("rl.server_push=adapter (the server could not load the policy's adapter)")
    assert str(e.value).endswith("answered 400: LoRA rank 2 is greater than max_lora_rank 1.")
