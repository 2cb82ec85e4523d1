"""The Chat tab through an OpenAI-compatible server (app/chat_server.py): python -m training.serve's app on a free
port of 127.0.0.1 (tests/serving.py), serving a tiny random Llama under a key, asked by the tab's own chat turn
(`chat_turn`): the server's models listed, a reply streamed that is the one the server gives whole for the same
seed, a tool call and its result there and back, and every failure said in words (no server, no key, a wrong key,
a model it does not serve, a refused request, a failure mid-stream)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import sys

import gradio as gr
import openai
import pytest

from app.chat_models import ChatModels
from app.chat_server import ServedModel, ServerError, api_key, list_models, server_url, wire_messages
from app.chat_tab import chat_turn
from app.runs import LaunchRefused
from app.serving import Serving
from app.workspace import Workspace
from conftest import ROOT
from serving import running, scripted
from training.core.hosts import API_KEY_ENV
from training.generation.served import load_served
from training.serve import build_app

KEY = "sk-chat-tab"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    """The tiny model served as "tiny", and again as "tools" with a chat template that renders tools."""
    models = load_served({"tiny": str(tiny_model_dir)})
    template = (ROOT / "data/tools/chatml_tools.jinja").read_text()
    models.update(load_served({"tools": str(tiny_model_dir)}, chat_template=template))
    with running(build_app(models, api_key=KEY)) as base_url:
        yield base_url


def test_a_served_model_is_listed_and_streams_the_reply_the_server_gives_whole(url, tmp_path):
    assert list_models(url, KEY) == ["tiny", "tools"]
    assert server_url(url.removeprefix("http://").removesuffix("/v1") + "/") == url  # http:// and /v1 added
    chats = ChatModels(Workspace(tmp_path))
    assert (
        chats.load("A", f"tiny @ {url}", KEY)
        == f"slot A: **tiny**, served at {url} (its replies stream from the server)"
    )
    assert chats.describe() == f"A: tiny @ {url} · B: (empty)" and not chats.takes_pictures

    def turn(message, hist, seed):
        return [
            copy.deepcopy(a)
            for _, a, _ in chat_turn(
                chats, message, hist, [], "Be brief.", 1.0, 0.9, 12, None, "", False, seed
            )
        ]

    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)

    def whole(messages, seed):
        asked = [{"role": "system", "content": "Be brief."}, *messages]
        r = client.chat.completions.create(
            model="tiny", messages=asked, temperature=1.0, top_p=0.9, max_tokens=12, seed=seed
        )
        return r.choices[0].message.content

    shown = turn("Tell me a story.", [], 7)
    first = whole([{"role": "user", "content": "Tell me a story."}], 7)
    assert first.strip() and shown[-1] == [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": first},
    ]
    assert len({a[-1]["content"] for a in shown}) > 3  # it streamed: the reply grew over several updates
    # the next turn gives the server the conversation; the same seed draws the same reply again
    again = turn("And then?", shown[-1], 7)[-1]
    assert again[-1]["content"] == whole([*shown[-1], {"role": "user", "content": "And then?"}], 7)
    assert turn("Tell me a story.", [], 8)[-1][-1]["content"] != first  # another seed, another reply


def test_a_served_tool_call_shows_as_a_section_and_its_result_goes_back(url, tmp_path, monkeypatch):
    """The server reads the tool call from the reply; the tab shows it as a section; sent as a tool result, the
    answer reaches the server's template as the call's response (OpenAI's ids and JSON-string arguments)."""
    prompts = []

    def recorded(text):
        draw = scripted(text)

        def recording(served, prompt_ids, *args, **kwargs):
            prompts.append(served.tokenizer.decode(prompt_ids))
            return draw(served, prompt_ids, *args, **kwargs)

        return recording

    chats = ChatModels(Workspace(tmp_path))
    chats.load("A", f"tools @ {url}", KEY)
    monkeypatch.setattr("training.generation.http_app.draw", recorded("Let me look.\n" + CALL))
    tools = json.dumps([WEATHER])
    *_, (_, first, _) = chat_turn(chats, "Weather in Oslo?", [], [], "", 0.0, 1.0, 16, None, tools)
    assert [(m["role"], (m.get("metadata") or {}).get("title"), m["content"]) for m in first] == [
        ("user", None, "Weather in Oslo?"),
        ("assistant", "Tool call: get_weather", '```json\n{\n  "city": "Oslo"\n}\n```'),
        ("assistant", None, "Let me look."),
    ]
    assert '"name": "get_weather"' in prompts[0]  # the Tools field reached the server's template
    monkeypatch.setattr("training.generation.http_app.draw", recorded("It is 12 C."))
    *_, (_, after, _) = chat_turn(chats, "12 C, rain", first, [], "", 0.0, 1.0, 16, None, tools, True)
    assert after[-1] == {"role": "assistant", "content": "It is 12 C."}
    assert CALL in prompts[1] and "<tool_response>\n12 C, rain\n</tool_response>" in prompts[1]
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    assert wire_messages(
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "f", "content": "2"},
        ]
    ) == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "name": "f", "content": "2", "tool_call_id": "call_0_0"},
    ]


def test_a_server_s_failures_are_said_in_words(url, tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(ServerError, match=f"no server answers at {nobody} .*python -m training.serve RUN"):
        list_models(nobody, None)
    with pytest.raises(
        ServerError,
        match=r"asks for an API key: give its key in the API key field \(or set LLM_FORGE_API_KEY",
    ):
        list_models(url, api_key(""))
    with pytest.raises(ServerError, match=r"refused the API key given \(Incorrect API key provided.\)"):
        list_models(url, "wrong")
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert list_models(url, api_key("  ")) == ["tiny", "tools"]  # the key from the environment
    with pytest.raises(ServerError, match=r"has no /models here .*the API's base, ending in /v1"):
        list_models(url.removesuffix("/v1") + "/api", KEY)
    for given, said in [
        ("", "Server URL: give the address of an OpenAI-compatible server"),
        ("ftp://host/v1", "expected http://HOST:PORT/v1"),
        ("http://host:port/v1", "not an address"),
    ]:
        with pytest.raises(ServerError, match=said):
            server_url(given)
    chats = ChatModels(Workspace(tmp_path))
    with pytest.raises(ServerError, match=f"the server at {url} serves tiny, tools, not 'nope'"):
        chats.load("A", f"nope @ {url}", KEY)

    # in a chat turn, as the tab shows them: a model it no longer serves, a request it refuses, a failure mid-stream
    chats.slots["A"] = ServedModel(url, "gone", KEY)
    with pytest.raises(gr.Error, match=f"the server at {url} does not serve 'gone'"):
        list(chat_turn(chats, "Hi", [], [], "", 0.0, 1.0, 4))
    chats.slots["A"] = ServedModel(url, "tiny", KEY)
    with pytest.raises(gr.Error, match="Seed 'x': give a whole number, or leave it blank for none"):
        list(chat_turn(chats, "Hi", [], [], "", 1.0, 1.0, 4, None, "", False, "x"))
    with pytest.raises(gr.Error, match=f"the server at {url} answered 400: .*maximum context length is 256"):
        list(chat_turn(chats, "Hi", [], [], "", 0.0, 1.0, 1000))
    with pytest.raises(gr.Error, match=f"the server at {url} answered 400: .*cannot render tools"):
        list(chat_turn(chats, "Hi", [], [], "", 0.0, 1.0, 4, None, json.dumps([WEATHER])))

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr("training.generation.http_app.draw", broken)
    with pytest.raises(
        gr.Error, match=rf"the server at {url} failed: the server failed \(RuntimeError\); see its log"
    ):
        list(chat_turn(chats, "Hi", [], [], "", 0.0, 1.0, 4))


def test_a_seed_draws_a_loaded_model_s_sampled_reply_again(tmp_path, tiny_model_dir):
    ws = Workspace(tmp_path)
    (ws.runs / "tiny").mkdir(parents=True)
    (ws.runs / "tiny" / "final").symlink_to(tiny_model_dir, target_is_directory=True)
    (ws.runs / "tiny" / "config.yaml").write_text("data: {}\n")
    chats = ChatModels(ws)
    chats.load("A", "runs/tiny")

    def reply(seed):
        *_, (_, hist, _) = chat_turn(chats, "Hi", [], [], "", 1.0, 0.9, 8, None, "", False, seed)
        return hist[-1]["content"]

    assert reply(3) == reply(3) != reply(4)
    chats.unload()


def test_serve_starts_one_server_finds_it_again_and_stops_it(tmp_path, monkeypatch):
    """Serve's processes, with a stand-in for python -m training.serve that listens on its port (the real one
    costs an interpreter's imports: started by hand, docs/app.md): one at a time, found again by a restarted
    app, stopped; one that ends at once is said with its own last line."""
    listens = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(120)"
    monkeypatch.setattr(
        "app.serving.serve_argv", lambda path, port: [sys.executable, "-c", listens, str(port)]
    )
    ws = Workspace(tmp_path)
    serving = Serving(ws)
    server = serving.start("runs/x", str(ws.runs / "x"))
    try:
        serving.wait_listening(server)
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
        assert Serving(ws).current() == server  # what a restarted app finds
        assert Serving(ws).describe().startswith(f"serving **runs/x** at {server.url} (pid {server.pid}")
        with pytest.raises(LaunchRefused, match=f"runs/x is served at {server.url}; stop it first"):
            serving.start("runs/y", "y")
        assert serving.stop() == f"stopped the server of runs/x at {server.url}"
        assert serving.current() is None and serving.stop() == "no server started here is running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
    fails = "print('error: runs/z: no such run or adapter directory'); raise SystemExit(2)"
    monkeypatch.setattr("app.serving.serve_argv", lambda path, port: [sys.executable, "-c", fails])
    with pytest.raises(LaunchRefused, match="the server of runs/z ended: error: runs/z: no such run"):
        serving.wait_listening(serving.start("runs/z", "z"))
