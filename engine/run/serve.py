"""`edgetune serve`: the base model and its adapters behind an OpenAI-compatible HTTP API.

    edgetune serve                                 # the embedded model + every finished run in runs/
    edgetune serve --adapter my-run --port 8000    # and this run (or adapter folder) by name
    edgetune serve --auth "$TOKEN"                 # requests must send Authorization: Bearer $TOKEN

    GET  /v1/models             the base (by its model name) and each adapter (by its run's name)
    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        a prompt as written
         model, max_tokens (max_completion_tokens), temperature (default 1; 0 = greedy),
         top_p, n, stop, seed, stream (+ stream_options.include_usage)
    /api/...                    the training API on --runs-dir (engine/run/train_api.py)
    /openapi.json               the description of it all

The base loads once (4-bit unless --quant says otherwise); requests for different adapters
decode together in one batch, a row per choice (engine/generation/batcher.py). Every
finished or stopped run of --runs-dir trained on the same base is served by its name and
followed while serving: a run that finishes appears, a deleted one goes, a resumed one is
reloaded when its adapter changes. A run whose settings load the model's own Python
(model.trust_remote_code) is served only with --allow-code naming that model.

Safe by default: bound to 127.0.0.1; the Host and Origin checks of the app
(engine/core/hosts.py); --auth requires the token on every request; the request body,
max_tokens, n and the waiting requests are bounded, and every refusal is one line in
OpenAI's error shape {"error": {"message", "type", "code", "param"}}, checked before the
request reaches the model. A streaming client that disconnects frees its rows at the next
step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from edgetune.engine.core.errors import RunError
from edgetune.engine.core.settings import EMBEDDED_MODEL


def resolve_adapter(arg: str, runs_dir: str) -> tuple[str, Path, Path | None]:
    """(name, adapter folder, run folder or None) of an --adapter value: a run name of
    --runs-dir, a run folder, or an adapter folder."""
    for p in ([Path(runs_dir) / arg] if runs_dir and "/" not in arg else []) + [Path(arg).expanduser()]:
        if (p / "adapter" / "adapter_config.json").is_file():
            return p.name, p / "adapter", p
        if (p / "adapter_config.json").is_file():
            run = p.parent if p.name == "adapter" and (p.parent / "config.yaml").is_file() else None
            return (run.name if run else p.name), p, run
    raise RunError(f"--adapter {arg}: no adapter there (a run name of {runs_dir or 'the runs folder'}, a run "
                   "folder with adapter/, or a folder with adapter_config.json)")


# --------------------------------------------------------------------------- the command


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve the base and adapters over an OpenAI-compatible API, and the training "
                                     "API",
                       description=__doc__.split("\n\n")[0])
    s.add_argument("--base", metavar="MODEL", help="the base model (default: the first --adapter's run's, else the "
                                                   f"{EMBEDDED_MODEL}, the embedded model)")
    s.add_argument("--quant", choices=("nf4", "int8", "none"),
                   help="how the base sits in memory (default: the first --adapter's run's, else nf4)")
    s.add_argument("--adapter", action="append", default=[], metavar="RUN_OR_FOLDER",
                   help="also serve this run (a name of --runs-dir, a run folder) or adapter folder, by its name "
                        "(repeatable)")
    s.add_argument("--runs-dir", default="runs",
                   help="serve every finished run here trained on the base, following the folder while serving; "
                        "the training API (/api) starts and reads runs here (default runs/; '' = neither)")
    s.add_argument("--host", default="127.0.0.1", help="the address to serve on (default 127.0.0.1: this machine "
                                                       "only; another needs --auth)")
    s.add_argument("--port", default=8000, help="the port (default 8000)")
    s.add_argument("--auth", metavar="TOKEN", help="require 'Authorization: Bearer TOKEN' (an OpenAI client's "
                                                   "api_key); required with a --host other than 127.0.0.1")
    s.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests addressed to this host name (localhost, the --host and IP addresses "
                        "always work)")
    s.add_argument("--allow-code", action="append", default=[], metavar="MODEL_OR_FILE",
                   help="a model whose own Python may run (model.trust_remote_code), or a reward file that runs "
                        "started through the training API may run, as their config.yaml names it (repeatable)")
    s.add_argument("--max-rows", default=16, help="choices decoding together in one batch (default 16)")
    s.add_argument("--max-tokens", default=1024, help="the largest max_tokens a request may ask for "
                                                                "(default 1024)")
    s.set_defaults(fn=run)
    return s


def _local(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def base_settings(a, adapters: list[tuple[str, Path, Path | None]]):
    """The base's ModelSettings: --base / --quant, else the first adapter's run's model."""
    from edgetune.engine.core.settings import ModelSettings

    from edgetune.engine.run.serve_app import allowed, run_model

    first = next((run_model(run) for _, _, run in adapters if run is not None), {})
    fields = {k: first[k] for k in ("name", "quant", "dtype", "device", "trust_remote_code") if k in first} \
        if not a.base or a.base == first.get("name") else {}
    if a.base:
        fields["name"] = a.base
    if a.quant:
        fields["quant"] = a.quant
    name = fields.get("name", EMBEDDED_MODEL)
    allowed = allowed(name, a.allow_code)
    if fields.get("trust_remote_code") and not allowed:
        raise RunError(f"model {name} runs the Python it ships (model.trust_remote_code); if you trust it: "
                       f"edgetune serve ... --allow-code {name}")
    fields["trust_remote_code"] = bool(fields.get("trust_remote_code") or allowed)
    return ModelSettings(**fields)


def start(a) -> tuple:
    """(service, app with its gate) for parsed arguments: the base loaded, the adapters in place."""
    from edgetune.engine.core.hosts import HostCheck
    from edgetune.engine.core.settings import Range, typed_number
    from edgetune.engine.core.threads import torch_threads

    from edgetune.engine.models.model import load_base

    from edgetune.engine.generation.batcher import Batcher

    from edgetune.engine.run.serve_app import Gate, Limits, Service, allowed, build_app, run_model

    a.max_rows = typed_number("--max-rows", a.max_rows, Range(1, 1024))
    a.max_tokens = typed_number("--max-tokens", a.max_tokens, Range(1, 2**20))
    if not _local(a.host) and not a.auth:
        raise RunError(f"--host {a.host} is reachable from the network: give --auth TOKEN")
    limits = Limits(max_tokens=a.max_tokens, max_rows=a.max_rows,
                    default_max_tokens=min(Limits.default_max_tokens, a.max_tokens))
    adapters = [resolve_adapter(x, a.runs_dir) for x in a.adapter]
    names = [n for n, _, _ in adapters]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise RunError(f"--adapter: two adapters named '{dup}'")
    ms = base_settings(a, adapters)
    fixed = {}
    for name, folder, run in adapters:
        model = run_model(run) if run is not None else {}
        if model.get("trust_remote_code") and not allowed(model.get("name", ""), a.allow_code):
            raise RunError(f"--adapter {name}: its run sets model.trust_remote_code (the Python that "
                           f"{model.get('name')} ships); if you trust it: --allow-code {model.get('name')}")
        fixed[name] = (folder, model.get("system_prompt", ""))
    if not os.environ.get("OMP_NUM_THREADS"):  # the threads edgetune's workers take (engine/core/threads.py)
        import torch

        torch.set_num_threads(torch_threads())
    print(f"serve: loading {ms.name} ({ms.quant}) ...", file=sys.stderr, flush=True)
    model, tok, _ = load_base(ms)
    model.eval()
    batcher = Batcher(model, tok, max_rows=limits.max_rows, max_waiting=limits.max_waiting)
    service = Service(batcher, tok, ms.name, fixed, a.runs_dir, tuple(a.allow_code), limits)
    service.refresh(strict=True)
    app = build_app(service, a.runs_dir, tuple(a.allow_code))
    gate = Gate(app, HostCheck(a.host, a.allow_host, command="edgetune serve", what="this server"), a.auth,
                limits.max_body)
    return service, gate


def run(a) -> int:
    import uvicorn

    service, gate = start(a)
    shown = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    print(f"edgetune serve: http://{shown}:{a.port}/v1  models: {', '.join(service.models())}  "
          f"({'this machine only' if _local(a.host) else 'reachable from the network'}; "
          f"{'token required' if a.auth else 'no token'}; Ctrl-C to quit)", flush=True)
    try:
        uvicorn.run(gate, host=a.host, port=a.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        service.batcher.close()
    return 0
