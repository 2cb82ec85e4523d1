"""python -m app [--host 127.0.0.1] [--port 7860] [--workspace DIR] [--auth user:pass] [--allow-module PREFIX ...]"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from app.workspace import REPO_ROOT, Workspace
from training.core.hosts import is_loopback

AUTH_ENV = "LLM_FORGE_AUTH"


def parse_auth(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"--auth / {AUTH_ENV}: expected user:password")
    return user, password


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m app", description="llm-forge: configure, launch and watch runs, chat with results"
    )
    ap.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    ap.add_argument(
        "--workspace",
        default=str(REPO_ROOT),
        help="directory holding runs/, recipes/ and data/; the UI accepts no path outside it (default: the repo)",
    )
    ap.add_argument(
        "--auth", default=None, help=f"user:password required to open the app (or set {AUTH_ENV})"
    )
    ap.add_argument(
        "--allow-module",
        action="append",
        default=[],
        metavar="PREFIX",
        help="a Python module (and its submodules) outside the workspace that recipes may name as code, e.g. "
        "for rl.rewards[].function: package.module:name (repeatable; default: none, only code inside the "
        "workspace and the built-ins)",
    )
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        auth = parse_auth(args.auth or os.environ.get(AUTH_ENV))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workspace = Path(args.workspace).expanduser()
    if not workspace.is_dir():
        print(f"error: --workspace: {workspace} is not a directory", file=sys.stderr)
        return 2
    try:
        ws = Workspace(workspace, tuple(args.allow_module))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and auth is None:
        print(
            f"warning: --host {args.host} makes the app reachable from other machines without a password; "
            f"consider --auth user:password",
            file=sys.stderr,
        )
    # a recipe's relative paths (data, tokenizer, models) are the workspace's: the runs the app starts there read
    # them from it, and so do its own loads (memory plan, data preview, chat), whatever directory it was started in
    os.chdir(ws.root)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # imported after the environment above is set: gradio and the hub client read it on import
    from app.ui import CSS, JS, build_app

    demo = build_app(ws)
    demo.queue(default_concurrency_limit=4)
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        auth=auth,
        share=False,
        inbrowser=False,
        css=CSS,
        js=JS,
        footer_links=["api"],
        quiet=False,
        show_error=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
