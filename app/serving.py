"""The Chat tab's *Serve*: `python -m training.serve SOURCE --port PORT` on 127.0.0.1 and a free port, started as
the app starts every tool (app/runs.py: start_tool: an argv list, from the workspace root, in a session of its
own), its output in runs/.serve.log. One server at a time; Stop sends its group SIGTERM (uvicorn shuts down). What it
serves, where and its process are kept in runs/.app-serve.json, so a restarted app finds a server it started
still running, shows it and stops it."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from dataclasses import asdict, dataclass

from app.runs import LaunchRefused, proc_start_time, process_alive, read_tail, signal_stop, start_tool
from app.workspace import Workspace
from training.core.fs import write_atomic

STATE, LOG = ".app-serve.json", ".serve.log"  # under the workspace's runs/
LISTEN_S = 120.0  # how long a server may take to listen (its imports: seconds)


@dataclass(frozen=True)
class Server:
    source: str  # as the Chat tab names it (workspace-relative, or bundled:NAME)
    url: str  # the API's base URL
    pid: int
    start_time: str | None  # the kernel's start time of pid (a reused pid is not the server)


def serve_argv(source: str, port: int) -> list[str]:
    return [sys.executable, "-m", "training.serve", source, "--host", "127.0.0.1", "--port", str(port)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serving:
    """The one server the app started (see the module doc)."""

    def __init__(self, ws: Workspace):
        self.ws = ws

    def current(self) -> Server | None:
        """The server the app started, while its process lives."""
        try:
            server = Server(**json.loads((self.ws.runs / STATE).read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return server if process_alive(server.pid, server.start_time) else None

    def start(self, source: str, path: str) -> Server:
        """Serve `source` (at `path`, as the Chat tab resolved it: inside the workspace, or bundled);
        LaunchRefused while another server the app started runs."""
        if (running := self.current()) is not None:
            raise LaunchRefused(f"{running.source} is served at {running.url}; stop it first")
        port = free_port()
        self.ws.runs.mkdir(parents=True, exist_ok=True)
        with open(self.ws.runs / LOG, "wb") as log:
            proc = start_tool(self.ws, serve_argv(path, port), log)
        server = Server(source, f"http://127.0.0.1:{port}/v1", proc.pid, proc_start_time(proc.pid))
        write_atomic(self.ws.runs / STATE, json.dumps(asdict(server)))
        return server

    def wait_listening(self, server: Server, timeout_s: float = LISTEN_S) -> None:
        """Returns once the server accepts connections (it listens before it loads its models: a client that
        connects then waits for them); LaunchRefused with its log's last lines if it ends first."""
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        deadline = time.monotonic() + timeout_s
        while process_alive(server.pid, server.start_time):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return
            if time.monotonic() > deadline:
                raise LaunchRefused(f"the server of {server.source} did not listen within {timeout_s:.0f} s")
            time.sleep(0.2)
        raise LaunchRefused(self.ended(server.source))

    def ended(self, source: str) -> str:
        """What a server that ended while starting said last (its log's last lines)."""
        said = (read_tail(self.ws.runs / LOG, 3) or "").strip()
        return f"the server of {source} ended: {said or 'without a word (stopped?)'}"

    def stop(self) -> str:
        """SIGTERM to the server the app started (its own session: its group); what was stopped, in words."""
        server = self.current()
        (self.ws.runs / STATE).unlink(missing_ok=True)
        if server is None:
            return "no server started here is running"
        signal_stop(server.pid)  # its group: the session start_tool gave it
        return f"stopped the server of {server.source} at {server.url}"

    def describe(self) -> str:
        server = self.current()
        if server is None:
            return ""
        log = self.ws.rel(self.ws.runs / LOG)
        return f"serving **{server.source}** at {server.url} (pid {server.pid}; its output in `{log}`)"
