"""`edgetune ui`: serve the app (binds 127.0.0.1 unless told otherwise; another --host
needs --auth user:password or an explicit --insecure-no-auth). Every request passes
app/guard.py first: foreign Host or Origin, uploads that are no data file and repeated
failed logins are refused. Its command-line flags are the CLI's (engine/cli/).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import traceback
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


class EndedStreams(logging.Filter):
    """The event stream of a page that was reloaded or closed outlives its session in
    Gradio, which then raises a 404 after the response started; uvicorn logs that as an
    "Exception in ASGI application" with two tracebacks, though nothing failed. Such a record
    is dropped; any other error is logged as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        cause = getattr(exc, "__cause__", None)
        return not (getattr(cause, "status_code", None) == 404 and cause.__traceback__ is not None
                    and any(f.name == "sse_stream" for f in traceback.extract_tb(cause.__traceback__)))


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
    logging.getLogger("uvicorn.error").addFilter(EndedStreams())
    try:
        demo.launch(server_name=host, server_port=port, css=CSS, theme=gr.themes.Soft(), auth=credentials,
                    # Adapter zips are written into the run folder and downloaded from there.
                    allowed_paths=[str(Path(runs_dir).resolve())], prevent_thread_lock=not block,
                    # Every request passes the guard; no Node server answers in front of it.
                    app_kwargs={"middleware": [guard]}, ssr_mode=False,
                    footer_links=[], quiet=True, max_file_size=MAX_UPLOAD_BYTES,
                    # no self-check of the address: on a loaded machine its 3 s request times
                    # out and Gradio refuses to start; the CLI says when the app answers
                    _frontend=False)
    finally:
        if block:
            demo.edgetune_chat.close()
            demo.edgetune_serve.close()
    return demo
