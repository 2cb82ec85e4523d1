"""Which addresses to bind keep a server on this machine: the app (`--auth`) and the OpenAI-compatible server
(`--api-key`) ask for a password or key before they listen anywhere else; and the environment variable that holds
that server's key, for the server and for its clients (rl.generator: server, the app's Chat tab)."""

from __future__ import annotations

import ipaddress

API_KEY_ENV = "LLM_FORGE_API_KEY"  # the key of python -m training.serve, for it and its clients


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on this machine only: localhost, 127.0.0.0/8 or ::1. Anything else (0.0.0.0,
    ::, "", a hostname, an interface's address) may be reached from other machines."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False
