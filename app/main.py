"""`edgetune ui`: serve the app (binds 127.0.0.1 unless told otherwise; another --host
needs --auth user:password or an explicit --insecure-no-auth). Every request passes
app/guard.py first: foreign Host or Origin, uploads that are no data file and repeated
failed logins are refused. Its command-line flags are the CLI's (engine/cli/).
"""

from __future__ import annotations

import ipaddress
import threading
from pathlib import Path

from edgetune.engine.core.errors import ConfigError

from edgetune.engine.run import queue

from .guard import Guard, LoginThrottle
from .tab_data import DATA_TYPES, MAX_UPLOAD_BYTES
from .ui import CSS, build_app


def is_local(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_access(host: str, auth: str | None, insecure_no_auth: bool) -> tuple[str, str] | None:
    """The app starts runs and runs reward_file Python: off this machine only behind a
    password, unless the user explicitly says otherwise. Returns gradio's (user, password)."""
    if auth is not None:
        user, sep, password = auth.partition(":")
        if not sep or not user or not password:
            raise ConfigError("--auth: expected user:password")
        return user, password
    if not is_local(host) and not insecure_no_auth:
        raise ConfigError(f"--host {host} lets other machines start runs (and run reward_file Python): "
                          "add --auth user:password, or --insecure-no-auth if the network is yours alone")
    return None


def check_allow_hosts(names: list[str] | None) -> tuple[str, ...]:
    """--allow-host values: bare host names (no scheme, port or path)."""
    out = []
    for name in names or ():
        if not name or any(c in name for c in "/:@ ") or name.startswith("."):
            raise ConfigError(f"--allow-host {name!r}: expected a host name such as myhost.lan")
        out.append(name.lower())
    return tuple(out)


def launch(host: str = "127.0.0.1", port: int = 7860, runs_dir: str = "runs", block: bool = True,
           auth: str | None = None, insecure_no_auth: bool = False, allow_hosts: list[str] | None = None):
    import gradio as gr
    from starlette.middleware import Middleware

    credentials = check_access(host, auth, insecure_no_auth)
    guard = Middleware(Guard, bound=host, allow=check_allow_hosts(allow_hosts), upload_types=DATA_TYPES,
                       throttle=LoginThrottle() if credentials else None)
    demo = build_app(runs_dir)
    # this process runs the queue whenever it holds jobs and no other process runs it
    threading.Thread(target=queue.serve, args=(Path(runs_dir).resolve(),), name="edgetune-queue",
                     daemon=True).start()
    try:
        demo.launch(server_name=host, server_port=port, css=CSS, theme=gr.themes.Soft(), auth=credentials,
                    # Adapter zips are written into the run folder and downloaded from there.
                    allowed_paths=[str(Path(runs_dir).resolve())], prevent_thread_lock=not block,
                    # Every request passes the guard; no Node server answers in front of it.
                    app_kwargs={"middleware": [guard]}, ssr_mode=False,
                    footer_links=[], quiet=True, max_file_size=MAX_UPLOAD_BYTES)
    finally:
        if block:
            demo.edgetune_chat.close()
    return demo
