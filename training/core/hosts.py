"""Which addresses to bind keep a server on this machine: the app (`--auth`) and the OpenAI-compatible server
(`--api-key`) ask for a password or key before they listen anywhere else."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on this machine only: localhost, 127.0.0.0/8 or ::1. Anything else (0.0.0.0,
    ::, "", a hostname, an interface's address) may be reached from other machines."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False
