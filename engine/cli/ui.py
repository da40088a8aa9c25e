"""`edgetune ui`: serve the browser app until Ctrl-C."""

from __future__ import annotations

import ipaddress
import time


def cmd_ui(a) -> int:
    from edgetune.app.main import launch  # lazy: the app imports gradio, which no other command needs

    print(f"edgetune: starting the app on {a.host}:{a.port} (runs in {a.runs_dir}) ...", flush=True)
    demo = launch(host=a.host, port=a.port, runs_dir=a.runs_dir, block=False, auth=a.auth,
                  insecure_no_auth=a.insecure_no_auth, allow_hosts=a.allow_host)
    try:
        local = a.host in ("localhost",) or ipaddress.ip_address(a.host).is_loopback
    except ValueError:
        local = False
    shown = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    reach = "this machine only" if local else "reachable from the network"
    login = "login required" if getattr(demo, "auth", None) else "no login"
    print(f"edgetune ready: http://{shown}:{a.port}/  ({reach}; {login}; Ctrl-C to quit)", flush=True)
    try:
        while demo.is_running:  # Gradio's block_thread, without its own message at Ctrl-C
            time.sleep(0.1)
    finally:
        demo.close()
        demo.edgetune_chat.close()
    return 0


def add_parser(sub) -> None:
    """`edgetune ui`'s flags."""
    u = sub.add_parser("ui", help="start the browser app")
    u.add_argument("--host", default="127.0.0.1",
                   help="the address to serve on (default 127.0.0.1: this machine only; another needs --auth)")
    u.add_argument("--port", default=7860, help="the port to serve on (default 7860)")
    u.add_argument("--runs-dir", default="runs",
                   help="where the page lists, starts and reads runs (default runs/ in the current folder)")
    u.add_argument("--auth", metavar="USER:PASSWORD",
                   help="require this login (required with a --host other than 127.0.0.1)")
    u.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-local --host without a login: anyone who reaches the port can start runs "
                        "and run reward_file Python as you")
    u.add_argument("--allow-host", action="append", metavar="NAME",
                   help="also answer requests addressed to this host name (a reverse proxy's or a LAN name); "
                        "localhost, the --host and IP addresses always work, any other name is refused "
                        "(a web page could point its own domain at this port). Repeatable")
    u.set_defaults(fn=cmd_ui)
