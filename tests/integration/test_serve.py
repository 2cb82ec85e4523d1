"""python -m training.serve, the OpenAI-compatible server, answered by the `openai` client package over loopback:
chat, `n`, `seed`, `logprobs`, streaming, tools, errors (400, 401, 404, too long), a run's LoRA adapter served
by name beside its base (loaded once) or loaded and unloaded while the server runs (vLLM's routes), and a
non-loopback bind refused without a key. The server runs in a
thread of this process (uvicorn on a free port of 127.0.0.1); the models are a tiny random Llama with the
bundled SmolLM2 tokenizer (initialised wide enough that its greedy replies are words, not newlines) and LoRA
adapters of it."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import yaml

from conftest import ROOT, TINY_ARCH, TOKENIZER, run_cli
from serving import running, scripted
from training.generation import ChatOptions, generate, load_for_chat
from training.generation.openai_api import ChatRequest, ChoiceStream, prepare
from training.generation.served import Choice, Sampling, load_served
from training.serve import build_app, listen, main

KEY = "sk-test-key"
CONTEXT = 512
TOOLS_TEMPLATE = ROOT / "data/tools/chatml_tools.jinja"
TOOLS = json.loads((ROOT / "data/tools/tools.json").read_text())
ASK = [{"role": "user", "content": "Tell me a story about a dog."}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (+ the bundled tokenizer), its weights drawn wide (initializer_range 0.3)."""
    from transformers import AutoModelForCausalLM

    from training.config import Architecture, ModelSection
    from training.data.tokenizer import load_tokenizer
    from training.model.build import from_scratch_config

    out = tmp_path_factory.mktemp("serve-base")
    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    config = from_scratch_config(Architecture(**TINY_ARCH), tok)
    config.initializer_range = 0.3
    config.max_position_embeddings = CONTEXT  # room for the tool definitions
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def lora_run(base_dir: Path, out: Path, seed: int) -> Path:
    """A run directory whose final/ is a LoRA adapter of `base_dir` (random, non-zero updates) + tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump({"output_dir": str(out)}))
    model.save_pretrained(out / "final")
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out / "final")
    return out


@pytest.fixture(scope="module")
def models(base_dir, tmp_path_factory):
    """base, its two adapters (runs "tuned" and "other"), and the base again with a template that renders
    tools ("tools")."""
    runs = tmp_path_factory.mktemp("serve-runs")
    named = {
        "base": str(base_dir),
        "tuned": str(lora_run(base_dir, runs / "tuned", 1)),
        "other": str(lora_run(base_dir, runs / "other", 2)),
    }
    served = load_served(named)
    served.update(load_served({"tools": str(base_dir)}, chat_template=TOOLS_TEMPLATE.read_text()))
    return served


@pytest.fixture(scope="module")
def url(models):
    with running(build_app(models, api_key=KEY)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)


def own_reply(source, messages, max_tokens: int) -> str:
    """training.generation.generate's greedy reply, from the source loaded on its own."""
    model, tok = load_for_chat(str(source))
    return generate(model, tok, messages, ChatOptions(max_new_tokens=max_tokens))


def test_models_are_listed_by_name(client, models):
    assert [m.id for m in client.models.list().data] == ["base", "tuned", "other", "tools"]
    assert client.models.retrieve("tuned").id == "tuned"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_greedy_reply_is_generate_s_and_its_stream_joins_to_it(client, base_dir):
    """temperature 0 gives training.generation.generate's reply; streamed, its chunks join to the same text,
    the usage counts the prompt's and the completion's tokens."""
    reply = client.chat.completions.create(model="base", messages=ASK, temperature=0, max_tokens=10)
    expected = own_reply(base_dir, ASK, 10)
    assert len(expected.split()) >= 3  # words, not newlines: the comparison means something
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "length" and reply.model == "base"
    assert reply.usage.completion_tokens == 10 and reply.usage.prompt_tokens > 10

    chunks = list(
        client.chat.completions.create(
            model="base",
            messages=ASK,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it did stream
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.model_dump() == reply.usage.model_dump()


def test_n_and_seed_draw_the_same_completions_again(client):
    def draw(seed, n=2):
        r = client.chat.completions.create(
            model="base", messages=ASK, temperature=1.0, top_p=0.9, max_tokens=8, n=n, seed=seed
        )
        assert [c.index for c in r.choices] == list(range(n))
        return [c.message.content for c in r.choices]

    first = draw(7)
    assert draw(7) == first and first[0] != first[1]  # same seed, same texts; the two choices differ
    assert draw(8) != first
    assert draw(7, n=1) == first[:1]  # choice i is keyed by (seed, i), whatever n
    streamed = client.chat.completions.create(
        model="base", messages=ASK, temperature=1.0, top_p=0.9, max_tokens=8, n=2, seed=7, stream=True
    )
    texts = ["", ""]
    for c in streamed:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == first


def test_return_token_ids_gives_the_rendered_prompt_and_the_drawn_tokens(client, models):
    """vLLM's return_token_ids (what verifiers' client reads to train on the tokens drawn): the prompt's ids as
    the template rendered it, each choice's generated ids with the end token that finished it."""
    served = models["base"]
    r = client.chat.completions.create(
        model="base",
        messages=ASK,
        temperature=1.0,
        max_tokens=40,
        n=2,
        seed=3,
        extra_body={"return_token_ids": True},
    )
    text = served.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert r.model_extra["prompt_token_ids"] == served.tokenizer(text, add_special_tokens=False)["input_ids"]
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert served.tokenizer.decode(ids, skip_special_tokens=True).strip() == c.message.content.strip()
        assert (ids[-1] in served.eos_token_ids) == (c.finish_reason == "stop")
    plain = client.chat.completions.create(model="base", messages=ASK, max_tokens=2)
    assert "prompt_token_ids" not in (plain.model_extra or {})


def test_requests_that_arrive_together_are_drawn_in_one_batch_as_each_alone(client, monkeypatch):
    """Six chat requests sent at once are drawn together (in at most two batches), and each
    reply, its log-probabilities too, is the one its seed draws alone (streamed: the unbatched draw)."""
    from concurrent.futures import ThreadPoolExecutor

    from training.generation.completions_api import Batcher

    sizes, original = [], Batcher._draw

    def first_waits(self, batch, *a):  # the first draw starts once every request has arrived
        deadline = time.monotonic() + 60
        while not sizes and len(batch) + self.jobs.qsize() < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        sizes.append(len(batch))
        return original(self, batch, *a)

    monkeypatch.setattr(Batcher, "_draw", first_waits)

    def ask(seed, stream=False):
        r = client.chat.completions.create(
            model="base", messages=ASK, temperature=1.0, max_tokens=6, seed=seed, logprobs=True, stream=stream
        )
        if not stream:
            return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]
        chunks = [c.choices[0] for c in r if c.choices]
        return "".join(c.delta.content or "" for c in chunks), [
            t.logprob for c in chunks for t in (c.logprobs.content if c.logprobs else [])
        ]

    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, range(6)))
    assert sum(sizes) == 6 and len(sizes) <= 2  # the first request alone at most, the rest together
    for seed, (text, logprobs) in enumerate(together):
        alone_text, alone_logprobs = ask(seed, stream=True)
        assert text == alone_text
        assert logprobs == pytest.approx(alone_logprobs, abs=1e-4)


def test_logprobs_are_the_chosen_tokens_under_the_model(client, models):
    r = client.chat.completions.create(
        model="base", messages=ASK, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 3 for e in entries)
    for e in entries:  # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    served = models["base"]
    ids = served.tokenizer.apply_chat_template(
        ASK, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad(), served.active():
        logits = served.model(**ids).logits[0, -1]
    assert entries[0].logprob == pytest.approx(torch.log_softmax(logits, -1).max().item(), abs=1e-5)


def test_adapters_are_served_by_name_beside_their_base(client, models, base_dir):
    """Both adapters and the base share one loaded model; each name answers as it would loaded alone."""
    assert models["tuned"].model is models["other"].model is models["base"].model

    def reply(name):
        r = client.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=8)
        return r.choices[0].message.content

    replies = {name: reply(name) for name in ("tuned", "base", "other")}
    assert reply("tuned") == replies["tuned"]  # switched back from the others
    assert replies["tuned"] == own_reply(models["tuned"].source, ASK, 8)
    assert replies["other"] == own_reply(models["other"].source, ASK, 8)
    assert replies["base"] == own_reply(base_dir, ASK, 8)
    assert len(set(replies.values())) == 3  # the adapters change the replies


def test_adapters_loaded_at_run_time_by_vllms_routes_answer_as_loaded_alone(base_dir, tmp_path):
    """POST /v1/load_lora_adapter (vLLM's body) serves a run's adapter by name on the model served alone, whose
    base answers as before; load_inplace swaps in another's weights; POST /v1/unload_lora_adapter stops serving
    it. What cannot be done gets OpenAI's error shape."""
    tuned = lora_run(base_dir, tmp_path / "tuned", 1) / "final"
    other = lora_run(base_dir, tmp_path / "other", 2) / "final"
    served = load_served({"base": str(base_dir)})
    with running(build_app(served)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)

        def post(route, **body):
            return httpx.post(f"{url}/{route}", json=body, timeout=60)

        def reply(name):
            r = client.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=8)
            return r.choices[0].message.content

        base = reply("base")
        r = post("load_lora_adapter", lora_name="policy-1", lora_path=str(tuned))
        assert r.status_code == 200 and "policy-1" in r.text
        listed = client.models.list().data
        assert [m.id for m in listed] == ["base", "policy-1"] and listed[1].model_extra["parent"] == "base"
        assert reply("policy-1") == own_reply(tuned, ASK, 8) != base
        assert reply("base") == base == own_reply(base_dir, ASK, 8)  # the base under the adapter, disabled

        again = post("load_lora_adapter", lora_name="policy-1", lora_path=str(other))
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        swapped = post("load_lora_adapter", lora_name="policy-1", lora_path=str(other), load_inplace=True)
        assert swapped.status_code == 200 and reply("policy-1") == own_reply(other, ASK, 8)

        missing = post("load_lora_adapter", lora_name="x", lora_path=str(tmp_path / "none"))
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        assert "holds no adapter_config.json" in missing.json()["error"]["message"]
        model = post("unload_lora_adapter", lora_name="base")
        assert model.status_code == 400 and "not an adapter" in model.json()["error"]["message"]

        assert post("unload_lora_adapter", lora_name="policy-1").status_code == 200
        assert [m.id for m in client.models.list().data] == ["base"]
        with pytest.raises(openai.NotFoundError):
            reply("policy-1")
        assert post("unload_lora_adapter", lora_name="policy-1").status_code == 404
        assert reply("base") == base


def test_an_adapter_loaded_at_run_time_on_a_server_of_several_bases_names_its_own(models, url):
    """With models of different bases served, the adapter's base is named by base_model_name."""
    tuned = models["tuned"].source
    asked = httpx.post(
        f"{url}/load_lora_adapter",
        json={"lora_name": "t2", "lora_path": f"{tuned}/final"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "base_model_name"
    named = httpx.post(
        f"{url}/load_lora_adapter",
        json={"lora_name": "t2", "lora_path": f"{tuned}/final", "base_model_name": "base"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    try:
        assert named.status_code == 200 and models["t2"].model is models["base"].model
        assert models["t2"].parent == "base"
    finally:
        gone = httpx.post(
            f"{url}/unload_lora_adapter",
            json={"lora_name": "t2"},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
    assert gone.status_code == 200 and "t2" not in models and models["tuned"].model is models["base"].model
    unauthorized = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "tuned"}, timeout=60)
    assert unauthorized.status_code == 401


def test_tool_definitions_reach_the_template_and_a_template_without_tools_is_refused(client, models):
    asked = ChatRequest.model_validate({"model": "tools", "messages": ASK, "tools": TOOLS})
    prompt = prepare(asked, models["tools"]).prompt
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "calculate"' in prompt
    # a call and its result, sent back as an OpenAI client sends them (arguments as a JSON string)
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}
    asked = ChatRequest.model_validate({"model": "tools", "messages": [*ASK, turn, result], "tools": TOOLS})
    prompt = prepare(asked, models["tools"]).prompt
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt and "12 C, rain" in prompt
    r = client.chat.completions.create(
        model="tools", messages=[*ASK, turn, result], tools=TOOLS, max_tokens=4
    )
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:  # the bundled SmolLM2 template renders no tools
        client.chat.completions.create(model="base", messages=ASK, tools=TOOLS, max_tokens=4)
    assert "cannot render tools" in e.value.message and "--chat-template PATH" in e.value.message
    assert e.value.body["param"] == "tools"


def test_a_reply_that_calls_a_tool_comes_back_as_tool_calls(client, monkeypatch):
    monkeypatch.setattr("training.generation.http_app.draw", scripted("Let me look.\n" + CALL))
    monkeypatch.setattr("training.generation.http_app.batchable", lambda prepared: False)  # the scripted draw
    r = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}

    chunks = list(client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    content = "".join(d.content or "" for d in deltas)
    assert content == "Let me look." and "<" not in content  # the call's text never leaks into the content
    (streamed,) = [tc for d in deltas for tc in d.tool_calls or []]
    assert streamed.function.name == "get_weather" and json.loads(streamed.function.arguments) == {
        "city": "Oslo",
        "unit": "celsius",
    }
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stream_holds_back_text_that_may_still_change():
    """A stop string's start, an open tag and trailing whitespace wait until the reply settles."""

    prepared = SimpleNamespace(
        served=SimpleNamespace(name="x", tokenizer=None), prompt="", sampling=Sampling(stop=("END",))
    )
    stream = ChoiceStream(prepared, 0)
    said = []
    for text in [
        "  Hello",
        "  Hello wor",
        "  Hello world E",
        "  Hello world EN",
        "  Hello world <b",
        "  Hello world <b>x",
    ]:
        delta = stream.update(Choice(0, text=text))
        said.append(delta["delta"].get("content") if delta else None)
    assert said == ["Hello", " wor", "ld", None, None, None]


def test_errors_have_openai_s_shape_and_status(client, url, caplog):
    """Malformed JSON, a missing field, a wrong type, an unknown parameter: 400; an unknown model: 404; a missing
    or wrong key: 401; a prompt or prompt + max_tokens past the context: 400 naming the lengths. One log line
    each, no traceback."""
    caplog.set_level(logging.WARNING)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def post(body: str) -> tuple[int, dict]:
        r = httpx.post(f"{url}/chat/completions", content=body, headers=headers, timeout=30)
        return r.status_code, r.json()["error"]

    ok = {"model": "base", "messages": ASK, "max_tokens": 2}
    cases = [
        ("{not json", "the request body is not valid JSON", None),
        ("[1, 2]", "the request body must be a JSON object, not list", None),
        (json.dumps({"model": "base"}), "Missing required parameter: 'messages'", "messages"),
        (json.dumps({**ok, "n": "2"}), "n: Input should be a valid integer", "n"),
        (
            json.dumps({**ok, "temperature": 3}),
            "temperature: Input should be less than or equal to 2",
            "temperature",
        ),
        (json.dumps({**ok, "best_of": 2}), "Unrecognized request argument supplied: best_of", "best_of"),
        (
            json.dumps({**ok, "messages": [{"role": "robot", "content": "hi"}]}),
            "messages[0].role:",
            "messages[0].role",
        ),
        (
            json.dumps({**ok, "messages": [{"role": "user", "content": None}]}),
            "must have a string content",
            "messages[0]",
        ),
    ]
    for body, said, param in cases:
        status, error = post(body)
        assert status == 400 and said in error["message"], (body, error)
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=ASK)
    assert (
        e.value.status_code == 404 and e.value.body["code"] == "model_not_found" and "base" in e.value.message
    )
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=url, api_key="wrong-key", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.get(f"{url}/models", timeout=30)  # no key at all
    assert r.status_code == 401 and "didn't provide an API key" in r.json()["error"]["message"]

    long = [{"role": "user", "content": "dog " * 600}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="base", messages=long)
    assert e.value.body["code"] == "context_length_exceeded"
    assert (
        f"maximum context length is {CONTEXT} tokens" in e.value.message
        and "none left for the completion" in e.value.message
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="base", messages=ASK, max_tokens=500)
    assert e.value.body["code"] == "context_length_exceeded" and "500 in the completion" in e.value.message

    r = httpx.get(f"{url}/nothing", headers=headers, timeout=30)
    assert r.status_code == 404 and "Not Found" in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    assert len([rec for rec in caplog.records if "400" in rec.getMessage()]) >= len(cases)


def test_a_server_without_a_key_answers_anyone(models):
    with running(build_app({"base": models["base"]})) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="anything", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["base"]


def test_a_non_loopback_bind_without_a_key_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("LLM_FORGE_API_KEY", raising=False)
    done = run_cli("training.serve", "runs/none", "--host", "0.0.0.0", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--host 0.0.0.0 makes the server reachable from other machines" in done.stderr
    assert "--api-key KEY" in done.stderr and "Traceback" not in done.stderr

    def refused(*argv) -> str:
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "expected NAME=PATH" in refused("--model", "runs/x")
    assert "nothing to serve" in refused()
    assert "the name 'a' is already served" in refused("--model", "a=x", "--model", "a=y")
    taken = listen("127.0.0.1", 0)
    try:
        assert "cannot listen there" in refused("runs/none", "--port", str(taken.getsockname()[1]))
    finally:
        taken.close()
