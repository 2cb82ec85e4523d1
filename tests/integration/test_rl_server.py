"""rl.generator: server: the rollouts drawn by python -m training.serve (here in a thread of this process, on
127.0.0.1) through its /v1/completions, the policy's weights pushed to /v1/weights before each step's draws. The
server's draws are keyed as the in-process engine's: an RL run drawn on the server equals the run drawn in
process (fp32 on the CPU: the same completions, rewards, losses and final weights). The completions API answers
the `openai` client (token-id prompts, `n`, `seed`, vLLM's `return_token_ids`) and refuses what it cannot do with
OpenAI's error shape; a recipe naming no server that answers is refused before training."""

from __future__ import annotations

import contextlib
import json

import openai
import pytest
import torch
from safetensors.torch import save as save_safetensors
from test_rl import REWARD, assert_rl_run, write_recipe

from conftest import train_inprocess
from launching import STEPS, TWO_RANKS, kill_and_resume
from serving import running
from training.core.errors import RecipeError
from training.generation import Request, TransformersEngine, sample_seed
from training.generation.served import load_served
from training.generation.server_engine import ServerEngine, pushed_weights
from training.serve import build_app

FP32 = 'precision="no"'


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    return load_served({"policy": str(tiny_model_dir)})


@pytest.fixture(scope="module")
def url(served):
    with running(build_app(served)) as base_url:
        yield base_url


def test_completions_draw_the_keyed_tokens_of_the_in_process_engine(url, served):
    """Choice 0 of seed s draws what the transformers engine draws for the key's seed s, choice 1 what it draws
    for sample_seed(s, 0, 0, 1); temperature 0 is greedy; the text is the tokens' text."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    policy = served["policy"]
    prompt = policy.tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    got = client.completions.create(
        model="policy", prompt=prompt, max_tokens=6, n=2, seed=7, extra_body={"return_token_ids": True}
    )
    engine = TransformersEngine(0, 6, 1.0, 1.0, policy.eos_token_ids, policy.tokenizer.pad_token_id)
    want = engine.batch(
        policy.model, [Request(prompt, 7, 6), Request(prompt, sample_seed(7, 0, 0, 1), 6)], "cpu"
    )
    for i, choice in enumerate(got.choices):
        tokens = want.ids[i, : int(want.mask[i].sum())].tolist()
        assert choice.model_extra["token_ids"] == tokens and len(tokens) == 6
        assert choice.text == policy.tokenizer.decode(tokens, skip_special_tokens=True)
    assert got.choices[0].model_extra["token_ids"] != got.choices[1].model_extra["token_ids"]
    greedy = client.completions.create(model="policy", prompt="Once upon a time", max_tokens=6, temperature=0)
    g = engine.batch(policy.model, [Request(prompt, None, 6)], "cpu")
    assert greedy.choices[0].text == policy.tokenizer.decode(g.ids[0, : int(g.mask[0].sum())].tolist())
    assert greedy.usage.prompt_tokens == len(prompt)


def test_completions_and_weights_refuse_what_they_cannot_do(url, served):
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    for kwargs, said in (
        ({"prompt": [1, 2], "max_tokens": 10**6}, "maximum context length"),
        ({"prompt": [10**9]}, "prompt: token ids must be in"),
        ({"prompt": "x", "extra_body": {"best_of": 2}}, "Unrecognized request argument supplied: best_of"),
        ({"prompt": "x", "stream": True}, "stream is not supported"),
    ):
        with pytest.raises(openai.BadRequestError, match=said):
            client.completions.create(model="policy", **kwargs)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    import httpx

    bad = save_safetensors({"no.such.weight": torch.zeros(2)})
    r = httpx.post(f"{url}/weights", params={"model": "policy"}, content=bad)
    assert (
        r.status_code == 400
        and "the model does not have, e.g. no.such.weight" in r.json()["error"]["message"]
    )
    r = httpx.post(f"{url}/weights", params={"model": "policy"}, content=b"not safetensors")
    assert r.status_code == 400 and "not a safetensors file" in r.json()["error"]["message"]


def test_a_policy_the_served_model_cannot_take_is_refused_with_the_keys_named(url, served):
    """A server serving another model than the recipe's: the first push answers 400, which the trainer gives
    as a RecipeError (exit 2) naming rl.server_url and rl.server_model."""
    policy = served["policy"]
    engine = ServerEngine(
        TransformersEngine(0, 4, 1.0, 1.0, policy.eos_token_ids, policy.tokenizer.pad_token_id), url, "policy"
    )
    wider = torch.nn.Linear(3, 5)
    wider.weight.requires_grad_(True)
    with pytest.raises(
        RecipeError, match=r"rl.server_url / rl.server_model: .* answered 400: 2 weight\(s\) the model"
    ):
        engine.batch(wider, [Request([1, 2], 7, 2)], "cpu", version=1)


def test_pushed_weights_of_a_lora_policy_are_its_merged_base_layers(tiny_model_dir):
    """A LoRA policy pushes its adapted layers with the adapter merged in, under the plain model's names, and
    stays unmerged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    pushed = pushed_weights(model)
    assert pushed and all(".q_proj." in n or ".v_proj." in n for n in pushed)
    name = "model.layers.0.self_attn.q_proj.weight"
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    torch.testing.assert_close(pushed[name], layer.base_layer.weight.detach() + delta)
    assert not layer.merged


@pytest.fixture(scope="module")
def runs(url, tmp_path_factory, tiny_model_dir):
    """The recipe (full fine-tuning of the tiny model, fp32) and its run drawn in process."""
    w = tmp_path_factory.mktemp("rl_server")
    (w / "rewards.py").write_text(REWARD)
    recipe = write_recipe(
        w / "r.yaml", w / "unused", w / "rewards.py", model={"name_or_path": str(tiny_model_dir)}
    )
    assert train_inprocess(recipe, f"output_dir={w / 'here'}", FP32) == 0
    return {"recipe": recipe, "here": w / "here", "server": ("rl.generator=server", f"rl.server_url={url}")}


def test_an_rl_run_drawn_on_the_server_equals_the_run_drawn_in_process(runs, tmp_path):
    there = tmp_path / "there"
    assert train_inprocess(runs["recipe"], f"output_dir={there}", FP32, *runs["server"]) == 0
    assert_rl_run(there, runs["here"])
    samples = [(d / "samples.jsonl").read_text().splitlines() for d in (runs["here"], there)]
    assert [json.loads(s) for s in samples[0]] == [json.loads(s) for s in samples[1]]
    assert len(samples[0]) == 2 * STEPS


def test_an_async_run_drawn_on_the_server_equals_the_async_run_drawn_in_process(runs, tmp_path):
    """rl.async=1: the background copy's snapshot is what the server draws the next step's rollouts from, while
    held-out evaluation pushes the live weights between them (each push and its draws held together)."""
    here, there = tmp_path / "here", tmp_path / "there"
    assert train_inprocess(runs["recipe"], f"output_dir={here}", FP32, "rl.async=1") == 0
    assert train_inprocess(runs["recipe"], f"output_dir={there}", FP32, "rl.async=1", *runs["server"]) == 0
    assert_rl_run(there, here)


@pytest.mark.slow
def test_ddp_drawing_on_the_server_equals_one_process_through_kill_and_resume(runs, tmp_path):
    """2 ranks x batch 1 x 2 accumulation, each asking the server for its own rows' completions and pushing the
    same weights; killed in step 5 and resumed from step 3 (the weights pushed again first): equal to one
    process drawing in process."""
    out = tmp_path / "ddp"
    proc = kill_and_resume("ddp.yaml", runs["recipe"], out, *TWO_RANKS, FP32, *runs["server"])
    assert "from the server at http://127.0.0.1" in proc.stderr
    assert_rl_run(out, runs["here"])


def test_a_server_that_does_not_answer_is_refused_before_training(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "rewards.py").write_text(REWARD)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", tmp_path / "rewards.py")
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe, "rl.generator=server", "rl.server_url=http://127.0.0.1:9/v1")
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and "rl.server_url: no OpenAI-compatible server answers at http://127.0.0.1:9/v1" in err
    )


LORA = {"method": {"type": "lora", "lora": {"r": 4, "dropout": 0.0}}}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_model_dir):
    """A LoRA recipe of the tiny model and its runs drawn in process, synchronous and with rl.async=1."""
    w = tmp_path_factory.mktemp("rl_server_lora")
    (w / "rewards.py").write_text(REWARD)
    model = {"name_or_path": str(tiny_model_dir)}
    recipe = write_recipe(w / "r.yaml", w / "unused", w / "rewards.py", model=model, **LORA)
    for name, when in (("sync", ()), ("async", ("rl.async=1",))):
        assert train_inprocess(recipe, f"output_dir={w / name}", FP32, *when) == 0
    return {"recipe": recipe, "sync": w / "sync", "async": w / "async"}


@contextlib.contextmanager
def adapter_server(tiny_model_dir):
    """A server of its own (its model becomes a peft model once an adapter loads) and the run's overrides."""
    served = load_served({"policy": str(tiny_model_dir)})
    with running(build_app(served)) as url:
        yield served, ("rl.generator=server", f"rl.server_url={url}", "rl.server_push=adapter")


def assert_one_version_left(served, run):
    (kept,) = (run / "served_adapters").iterdir()
    assert sorted(served) == ["policy", kept.name] and kept.name.startswith("policy-lora-")
    assert served[kept.name].adapter == kept.name and (kept / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("when", ["sync", "async"])
def test_a_lora_run_pushing_its_adapter_to_the_server_equals_the_run_drawn_in_process(
    when, lora_runs, tmp_path, tiny_model_dir
):
    """rl.server_push=adapter: before each draw the policy's adapter (rl.async: the background copy's) is saved under
    the run directory and loaded by the server through vLLM's /v1/load_lora_adapter under a new name (the one before
    unloaded), the completions asked of that name. The run equals the one drawn in process (which draws from the
    merged layers, or with rl.async through the copy's adapter); the server holds one version at the end."""
    there = tmp_path / "there"
    with adapter_server(tiny_model_dir) as (served, server):
        asked = ("rl.async=1",) if when == "async" else ()
        assert train_inprocess(lora_runs["recipe"], f"output_dir={there}", FP32, *asked, *server) == 0
    assert_rl_run(there, lora_runs[when])
    assert_one_version_left(served, there)


@pytest.mark.slow
def test_ddp_pushing_adapters_equals_one_process_through_kill_and_resume(lora_runs, tmp_path, tiny_model_dir):
    """2 ranks, each pushing its adapter under names of its own; killed in step 5 and resumed from step 3 (the
    killed run's adapter directories removed, new names): equal to one process drawing in process."""
    out = tmp_path / "ddp"
    with adapter_server(tiny_model_dir) as (served, server):
        kill_and_resume("ddp.yaml", lora_runs["recipe"], out, *TWO_RANKS, FP32, *server)
    assert_rl_run(out, lora_runs["sync"])
    kept = sorted(p.name for p in (out / "served_adapters").iterdir())
    assert sorted(n.rsplit("-", 2)[1] for n in kept) == ["rank0", "rank1"]
    assert set(kept) <= set(served)  # and the killed run's last versions, which it never unloaded


def test_pushing_the_adapter_is_refused_for_full_fine_tuning_and_without_a_server(
    tmp_path, tiny_model_dir, capsys
):
    (tmp_path / "rewards.py").write_text(REWARD)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", tmp_path / "rewards.py")
    for overrides, said in [
        (("rl.generator=server", "rl.server_url=http://127.0.0.1:9/v1"), "needs method.type=lora or qlora"),
        ((), "server_push: adapter is how weights reach generator: server"),
    ]:
        with pytest.raises(SystemExit) as e:
            train_inprocess(recipe, "rl.server_push=adapter", *overrides)
        assert e.value.code == 2 and said in capsys.readouterr().err
