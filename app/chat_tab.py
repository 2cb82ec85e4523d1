"""The Chat tab: load one or two models (A, and B to compare side by side), or pick models an OpenAI-compatible
server serves (app/chat_server.py), and chat with both at once; one chat turn (`chat_turn`) is a module-level
function, so tests call it without a browser. How a conversation shows in the panes is app/chat_messages.py."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.chat_messages import TOOL_RESULT, chat_refusal, model_messages, pending_call, reply_messages
from app.chat_models import ChatModels
from app.chat_server import ServedModel, ServerError, api_key, list_models, served_source, server_url
from app.context import AppContext, Page, user_error
from app.runs import LaunchRefused
from app.serving import Serving
from app.workspace import PathRefused
from training.core.errors import UserError


@dataclass(frozen=True)
class ChatView:
    """The Chat tab's components."""

    src_a: gr.Dropdown
    load_a: gr.Button
    src_b: gr.Dropdown
    load_b: gr.Button
    unload_btn: gr.Button
    server_url: gr.Textbox
    api_key: gr.Textbox
    list_served: gr.Button
    serve_a: gr.Button
    stop_serving: gr.Button
    chat_status: gr.Markdown
    bot_a: gr.Chatbot
    bot_b: gr.Chatbot
    inputs: list  # what a chat turn reads: [message, bot A, bot B, system, temperature, top-p, max new, picture, tools,
    # send as, seed]
    send: gr.Button
    clear: gr.Button


def chat_tab(ctx: AppContext, page: Page) -> None:
    """Load one or two models (A, and B to compare side by side) and chat with both at once."""
    chats = ctx.chats
    view = _chat_layout(ctx.ws.chat_sources(ctx.runs.run_dirs()), chats.describe(), chats.takes_pictures)
    serving = _server_events(ctx, page, view)

    def load_model(slot, source, key=""):
        """Says what it loads at once (a GGUF file is dequantized first: tens of seconds), then what it loaded;
        a served model (NAME @ URL) is asked of its server with the API key field's key."""
        try:
            chats.resolve(source)  # a path outside the workspace is refused before anything is said
        except PathRefused as e:
            raise user_error(f"refused: {e}") from None
        except ValueError:
            pass  # said by load's refusal below
        gguf = (source or "").strip().endswith(".gguf")
        slow = " (a GGUF file: reading and dequantizing its weights first, tens of seconds)" if gguf else ""
        yield f"slot {slot}: loading **{source}**{slow} …  \n" + chats.describe()
        try:
            msg = chats.load(slot, source, key)
        except PathRefused as e:
            raise user_error(f"refused: {e}") from None
        except Exception as e:  # UserError from training.generation and load failures: show the message
            raise user_error(f"could not load {source}: {e}") from None
        yield msg + "  \n" + chats.describe()

    def chat(
        msg, hist_a, hist_b, system_prompt, temp, p, n, image=None, tools_json="", role="user", seed=None
    ):
        as_tool = role == "tool result"
        yield from chat_turn(
            chats, msg, hist_a, hist_b, system_prompt, temp, p, n, image, tools_json, as_tool, seed
        )

    def picture_offered():  # a picture only for an image-text model (one kept while hidden would go along)
        return gr.update(visible=True) if chats.takes_pictures else gr.update(visible=False, value=None)

    picture = view.inputs[7]
    slot_a, slot_b = gr.State("A"), gr.State("B")
    key = view.api_key
    for event in (
        view.load_a.click(load_model, [slot_a, view.src_a, key], view.chat_status, api_name="load_model"),
        view.load_b.click(load_model, [slot_b, view.src_b, key], view.chat_status, api_visibility="private"),
        view.unload_btn.click(
            lambda: chats.unload() + "  \n" + chats.describe(),
            None,
            view.chat_status,
            api_name="unload_models",
        ),
    ):
        event.then(picture_offered, None, picture, api_visibility="private", show_progress="hidden")
    message, replies = view.inputs[0], [view.inputs[0], view.bot_a, view.bot_b]

    def ready(msg):  # refused here, with no outputs, the panes and the message box show no error badge
        if why := chat_refusal(chats, msg):
            raise user_error(why)

    view.send.click(ready, message, None, api_visibility="private").success(
        chat, view.inputs, replies, api_name="chat"
    )
    message.submit(ready, message, None, api_visibility="private").success(
        chat, view.inputs, replies, api_visibility="private"
    )

    # a page opened while a model is loaded says so (the status was rendered when the app started)
    def status():  # the slots, and the server the app started, if one runs
        return "  \n".join(filter(None, [chats.describe(), serving.describe()]))

    page.demo.load(status, None, view.chat_status, api_visibility="private")
    page.demo.load(picture_offered, None, picture, api_visibility="private", show_progress="hidden")
    view.clear.click(lambda: ([], []), None, [view.bot_a, view.bot_b], api_visibility="private")


def _server_events(ctx: AppContext, page: Page, view: ChatView) -> Serving:
    """The pickers' sources, and the server row: List server models (app/chat_server.py), Serve model A and Stop
    serving (app/serving.py). The server models listed stay in the pickers for this page."""
    chats, serving = ctx.chats, Serving(ctx.ws)
    served, key, pickers = gr.State([]), view.api_key, [view.src_a, view.src_b]

    def refresh_sources(listed=()):  # the workspace's sources, then the server models listed on this page
        s = ctx.ws.chat_sources(ctx.runs.run_dirs()) + list(listed or ())
        return gr.update(choices=s), gr.update(choices=s)

    def list_server_models(url, key):
        """The server's models, added to both pickers as NAME @ URL (A picks the first); kept for this page."""
        try:
            url = server_url(url)
            names = list_models(url, api_key(key))
        except ServerError as e:
            raise user_error(str(e)) from None
        served = [ServedModel(url, name).source for name in names]
        choices = ctx.ws.chat_sources(ctx.runs.run_dirs()) + served
        said = f"the server at {url} serves {', '.join(names)}: pick one in A or B and press Load  \n{chats.describe()}"
        return served, gr.update(choices=choices, value=served[0]), gr.update(choices=choices), said

    def serve(source, key):
        """python -m training.serve on Model A's choice (app/serving.py): its URL into Server URL at once, then,
        once it has loaded, its models into the pickers, as List server models does."""
        if served_source(source):
            raise user_error(f"serve: {source} is served already; pick a run, checkpoint or model")
        try:
            server = serving.start(source.strip(), chats.resolve(source))
            yield server.url, gr.skip(), gr.skip(), gr.skip(), f"{serving.describe()}: starting …"
            serving.wait_listening(server)
        except (PathRefused, ValueError, LaunchRefused) as e:
            raise user_error(f"serve: {e}") from None
        yield server.url, gr.skip(), gr.skip(), gr.skip(), f"{serving.describe()}: loading its model …"
        try:
            yield server.url, *list_server_models(server.url, key)
        except gr.Error:
            if serving.current() is not None:  # it runs: what the listing said stands
                raise
            # it ended while loading: its own words
            raise user_error(f"serve: {serving.ended(source)}") from None

    page.demo.load(refresh_sources, None, pickers, api_visibility="private")
    page.tabs.change(refresh_sources, served, pickers, api_visibility="private")
    view.list_served.click(
        list_server_models,
        [view.server_url, key],
        [served, *pickers, view.chat_status],
        api_name="server_models",
    )
    view.serve_a.click(
        serve, [view.src_a, key], [view.server_url, served, *pickers, view.chat_status], api_name="serve"
    )
    view.stop_serving.click(
        lambda: f"{serving.stop()}  \n{chats.describe()}", None, view.chat_status, api_name="stop_serving"
    )
    return serving


def _chat_layout(sources: list[str], status: str, pictures: bool) -> ChatView:
    """The models to load (A, and B to compare), the two conversations, the generation settings, the message
    (and a picture, `pictures`: while an image-text model is loaded)."""
    with gr.Row():
        src_a = gr.Dropdown(
            sources, value=sources[0] if sources else None, label="Model A", allow_custom_value=True, scale=3
        )
        load_a = gr.Button("Load A", scale=1)
        src_b = gr.Dropdown(
            sources,
            value=None,
            label="Model B (optional: compare side by side)",
            allow_custom_value=True,
            scale=3,
        )
        load_b = gr.Button("Load B", scale=1)
        unload_btn = gr.Button("Unload all", scale=1)
    with gr.Row():  # a model served elsewhere: listed into the pickers above as NAME @ URL
        server_url = gr.Textbox(
            label="Server URL (optional: an OpenAI-compatible server)",
            placeholder="http://127.0.0.1:8000/v1  (python -m training.serve RUN, vllm serve, transformers serve)",
            scale=4,
        )
        api_key = gr.Textbox(value="", label="API key (blank: LLM_FORGE_API_KEY)", type="password", scale=2)
        list_served = gr.Button("List server models", scale=1)
        serve_a = gr.Button("Serve model A", scale=1)
        stop_serving = gr.Button("Stop serving", scale=1)
    chat_status = gr.Markdown(status, label="Chat status", elem_id="chat-status")
    with gr.Row():
        # per message copy buttons only: no share (an upload to the Hub) or copy-all icons over the pane's top
        bot_a = gr.Chatbot(label="A", height=360, buttons=["copy"])
        bot_b = gr.Chatbot(label="B", height=360, buttons=["copy"])
    with gr.Row():
        system = gr.Textbox(label="System prompt", placeholder="You are a helpful assistant.", scale=3)
        temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="Temperature (0 = greedy)")
        top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p")
        max_new = gr.Slider(1, 1024, value=64, step=1, label="Max new tokens")
    with gr.Row():
        tools = gr.Textbox(
            value="",
            label="Tools (optional: a JSON list of tool definitions, passed to the chat template)",
            placeholder='[{"type": "function", "function": {"name": "calculate", "parameters": {...}}}]',
            lines=2,
            scale=4,
        )
        send_as = gr.Radio(
            ["user", "tool result"],
            value="user",
            label="Send as (a tool result answers the model's tool call)",
            scale=2,
        )
        seed = gr.Textbox(value="", label="Seed (blank: none)", placeholder="e.g. 7", scale=1)
    with gr.Row():
        message = gr.Textbox(label="Message", placeholder="Type and press Enter", scale=5)
        picture = gr.Image(
            type="filepath",
            label="Picture (image-text models: goes with the conversation)",
            height=140,
            scale=2,
            visible=pictures,
        )
        send = gr.Button("Send", variant="primary", scale=1)
        clear = gr.Button("Clear", scale=1)
    inputs = [message, bot_a, bot_b, system, temperature, top_p, max_new, picture, tools, send_as, seed]
    server = (server_url, api_key, list_served, serve_a, stop_serving)
    return ChatView(
        src_a, load_a, src_b, load_b, unload_btn, *server, chat_status, bot_a, bot_b, inputs, send, clear
    )


def chat_turn(
    chats: ChatModels,
    msg,
    hist_a,
    hist_b,
    system_prompt,
    temp,
    p,
    n,
    image=None,
    tools_json: str = "",
    as_tool: bool = False,
    seed=None,
):
    """One message to every loaded slot: yields ("", history A, history B) as the replies stream in; `seed`
    (None: none) makes a sampled reply drawable again.
    `image`: a picture that goes with the conversation (before its first user message), for image-text
    models; a text-only model given one is an error naming its slot. `tools_json`: tool definitions for the
    chat template. `as_tool`: the message is the result of the model's pending tool call (a `tool`
    message, shown titled "Tool result: NAME"), refused where the model called no tool."""
    if why := chat_refusal(chats, msg):
        raise user_error(why)
    msg = msg.strip()
    hist_a, hist_b = list(hist_a or []), list(hist_b or [])
    prefix = [{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []
    sampling = {"max_tokens": int(n), "temperature": float(temp), "top_p": float(p), "seed": _seed(seed)}
    for slot, hist in (("A", hist_a), ("B", hist_b)):
        if chats.slots[slot] is None:
            continue
        try:
            tools = chats.tools(slot, tools_json) if (tools_json or "").strip() else None
        except ValueError as e:
            raise user_error(str(e)) from None
        earlier = model_messages(hist)
        if as_tool:
            name = pending_call(earlier)
            if name is None:
                raise user_error(f"send as tool result: model {slot} has no tool call waiting for a result")
            said = {"role": "tool", "name": name, "content": msg}
            shown = {"role": "user", "content": msg, "metadata": {"title": TOOL_RESULT + name}}
        else:
            said = shown = {"role": "user", "content": msg}
        history = prefix + earlier + [said]
        hist.append(shown)
        start = len(hist)  # the reply's messages: its reasoning, tool calls and answer (reply_messages)
        hist.append({"role": "assistant", "content": ""})
        yield "", hist_a, hist_b  # the message shows at once; the reply streams in below it
        reply = {"role": "assistant", "content": ""}
        try:  # a picture for a text-only model, or unreadable; a server that fails: said in the UI
            for reply in chats.replies(slot, history, sampling, image, tools):
                hist[start:] = reply_messages(reply, streaming=True)
                yield "", hist_a, hist_b
        except (ValueError, UserError) as e:
            del hist[start - 1 :]
            raise user_error(str(e)) from None
        hist[start:] = reply_messages(reply, streaming=False)
    yield "", hist_a, hist_b


def _seed(given) -> int | None:
    """The Seed field: a whole number, or None when blank."""
    text = "" if given is None else str(given).strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise user_error(f"Seed {text!r}: give a whole number, or leave it blank for none") from None
