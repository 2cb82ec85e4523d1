"""Models loaded for the Chat tab: two slots (A, and B for side-by-side comparison).

Loading goes through `training.generation.load_for_chat`, which resolves a run directory, final/, a
checkpoint, an adapter (base + adapter) or a model directory; generation streams through
`training.generation.stream`, with the run's own data.chat_template_kwargs (e.g. enable_thinking=false) as the
chat CLI uses them. An image-text model (a model.vision run's) is loaded with its processor and takes a
picture with the conversation (training.generation.with_image). A slot may instead hold a model an
OpenAI-compatible server serves (`NAME @ URL`, app/chat_server.py): nothing loads here, the replies stream from the
server. The slots live in the app process (one user, one machine), so a model loaded once serves every page
reload; Unload drops it and frees the memory.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass

import torch

from app.chat_server import ServedModel, api_key, connect, served_source, stream_reply
from app.workspace import BUNDLED_MODELS, Workspace


@dataclass
class Loaded:
    source: str
    model: object
    tokenizer: object
    params: int
    template_kwargs: dict  # the run's data.chat_template_kwargs ({} for a model that is not a run's)
    processor: object | None = None  # an image-text model's (pixels and image tokens); None: text only


class ChatModels:
    def __init__(self, ws: Workspace):
        self.ws = ws
        self.slots: dict[str, Loaded | ServedModel | None] = {"A": None, "B": None}
        self._lock = threading.Lock()

    def resolve(self, source: str) -> str:
        """A chat source from the UI -> what load_for_chat accepts; paths must stay in the workspace."""
        source = (source or "").strip()
        if not source:
            raise ValueError("model: pick a run's final/, a checkpoint, a model directory or a bundled model")
        if source in BUNDLED_MODELS or served_source(source):
            return source
        return str(self.ws.inside(source, "model"))

    def load(self, slot: str, source: str, key: str | None = None) -> str:
        """Load `source` into `slot`; a served model (NAME @ URL) is asked of its server (`key`: the API key
        field) instead."""
        if served := served_source(source):
            name, url = served
            model = connect(url, name, api_key(key))
            with self._lock:
                self.slots[slot] = model
            return f"slot {slot}: **{name}**, served at {url} (its replies stream from the server)"
        path = self.resolve(source)  # a path outside the workspace is refused before anything loads
        # training.generation imports transformers (seconds): loaded on first use, not at app start
        from training.generation import load_for_chat, load_processor, run_template_kwargs, takes_images

        with self._lock:
            self.slots[slot] = None  # drop the old model before loading the new one
            gc.collect()
            model, tokenizer = load_for_chat(path)
            params = sum(p.numel() for p in model.parameters())
            kwargs = run_template_kwargs(path)
            processor = load_processor(path, model) if takes_images(model) else None
            self.slots[slot] = Loaded(source, model, tokenizer, params, kwargs, processor)
        said = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        return (
            f"slot {slot}: loaded **{source}** ({params / 1e6:.1f}M parameters"
            + (", image-text: give it a picture" if processor is not None else "")
            + ")"
            + (f"; chat template variables from its recipe: {said}" if said else "")
        )

    def unload(self, slot: str | None = None) -> str:
        with self._lock:
            names = [slot] if slot else list(self.slots)
            freed = [n for n in names if self.slots.get(n) is not None]
            for n in names:
                self.slots[n] = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return f"unloaded {', '.join(freed)}" if freed else "nothing was loaded"

    @property
    def takes_pictures(self) -> bool:
        """Whether a loaded model is an image-text one (the Chat tab offers a picture only then)."""
        return any(isinstance(s, Loaded) and s.processor is not None for s in self.slots.values())

    def describe(self) -> str:
        parts = [f"{n}: {s.source}" if s else f"{n}: (empty)" for n, s in self.slots.items()]
        return " · ".join(parts)

    def parse(self, slot: str, text: str, messages: list[dict]) -> dict:
        """A reply of the model in `slot` (to `messages`) as an assistant message: its answer, reasoning and
        tool calls (training.generation.parse_reply; the rendered prompt is read only by a response template)."""
        from training.generation import parse_reply, rendered_prompt  # see load()

        loaded = self.slots[slot]
        tok = loaded.tokenizer
        if getattr(tok, "response_template", None):
            prefix = rendered_prompt(tok, messages, template_kwargs=loaded.template_kwargs)
            return parse_reply(text, tok, prefix)
        return parse_reply(text, tok)

    def tools(self, slot: str, text: str) -> list[dict] | None:
        """The Tools field (a JSON list of tool definitions; empty: none) for the model in `slot`: malformed
        definitions, or a chat template that cannot render tools, are refused (ValueError) with the reason."""
        from training.generation import parse_tools, probe_tools  # see load()

        if not (text or "").strip():
            return None
        tools, problem = parse_tools(text, "Tools")
        if problem:
            raise ValueError(problem)
        loaded = self.slots[slot]
        if isinstance(loaded, ServedModel):  # its server renders them, or refuses (said as its 400)
            return tools
        if why := probe_tools(loaded.tokenizer, loaded.template_kwargs):
            raise ValueError(
                f"Tools: the chat template of {loaded.source} cannot render tools ({why}); chat with a model "
                "whose template does, or train one with data.chat_template"
            )
        return tools

    def replies(
        self,
        slot: str,
        messages: list[dict],
        sampling: dict,
        image: str | None = None,
        tools: list[dict] | None = None,
    ):
        """The reply of the model in `slot` as it grows, each time as an assistant message (content, reasoning,
        tool calls). `sampling`: max_tokens, temperature, top_p, seed (None: none), as OpenAI's API names them."""
        served = self.slots.get(slot)
        if not isinstance(served, ServedModel):
            if sampling.get("seed") is not None:
                torch.manual_seed(int(sampling["seed"]))
            texts = self.stream(
                slot,
                messages,
                sampling["max_tokens"],
                sampling["temperature"],
                sampling["top_p"],
                image,
                tools,
            )
            return (self.parse(slot, text, messages) for text in texts)
        if image:
            raise ValueError(
                f"slot {slot}: {served.source} is served; the Chat tab sends a server no picture"
            )
        return stream_reply(served, messages, sampling, tools)

    def stream(
        self,
        slot: str,
        messages: list[dict],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        image: str | None = None,
        tools: list[dict] | None = None,
    ):
        """The reply as it grows (an iterator); `image`: a picture file for the conversation (image-text
        models only). A missing model, or a picture it cannot take, is refused here, before any reply."""
        from training.generation import ChatOptions, read_image, stream, with_image  # see load()

        loaded = self.slots.get(slot)
        if loaded is None:
            raise ValueError(f"slot {slot}: no model loaded; pick one and press Load")
        images = None
        if image:
            if loaded.processor is None:
                raise ValueError(f"slot {slot}: {loaded.source} is a text-only model; it takes no picture")
            images = (loaded.processor, [read_image(image)])
            messages = with_image(messages, loaded.processor)
        options = ChatOptions(
            max_new_tokens=int(max_new_tokens),
            temperature=float(temperature),
            top_p=float(top_p),
            tools=tools,
            template_kwargs=loaded.template_kwargs,
            images=images,
        )
        return stream(loaded.model, loaded.tokenizer, messages, options)
