"""Helpers of the tests that talk to python -m training.serve's app: uvicorn serving it in a thread of the test's
process, on a free port of 127.0.0.1, and a scripted draw in place of the model's."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from training.generation.http_app import listen
from training.generation.served import Choice


@contextlib.contextmanager
def running(app):
    """uvicorn serving `app` on a free port of 127.0.0.1 in a thread; yields the API's base URL."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def scripted(text: str):
    """A draw that 'generates' `text` a few characters at a time, for every choice (monkeypatched over
    training.generation.http_app.draw)."""

    def draw(served, prompt_ids, sampling, on_step=None, cancel=None):
        choices = [Choice(i) for i in range(sampling.n)]
        for k in range(3, len(text), 5):
            for c in choices:
                c.text, c.generated = text[:k], c.generated + 1
            if on_step:
                on_step(choices)
        for c in choices:
            c.text, c.finish_reason = text, "stop"
        return choices

    return draw
