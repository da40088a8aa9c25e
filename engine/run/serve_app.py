"""The HTTP side of `edgetune serve` (engine/run/serve.py): the served models (`Service`),
the requests read and checked whole before they reach the model (`parse`), the gate in front
of every request (`Gate`: Host and Origin, the token, the body's size) and the FastAPI app
with OpenAI's endpoints (`build_app`), its errors in OpenAI's shape (`ApiError`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from edgetune.engine.core.errors import EdgetuneError
from edgetune.engine.core.hosts import STATE_CHANGING, HostCheck
from edgetune.engine.core.settings import EMBEDDED_MODEL

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SERVED_STATUSES = ("finished", "stopped")  # runs whose adapter is final
REFRESH_SECONDS = 2.0


@dataclass
class Limits:
    """What one request may ask for; larger is refused in one line."""

    max_tokens: int = 1024  # per choice
    default_max_tokens: int = 256
    max_n: int = 8
    max_prompts: int = 16  # /v1/completions: prompts in one request
    max_stop: int = 4
    max_body: int = 1 << 20  # bytes of a request body
    max_rows: int = 16  # choices decoding together (the batch)
    max_waiting: int = 64  # requests waiting for a place


class ApiError(Exception):
    """A refusal in OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


# --------------------------------------------------------------------------- requests


def _field(req: dict, key: str, kind, default, low=None, high=None):
    """req[key] as `kind` (int, float, bool, str), within [low, high], or the one-line refusal."""
    value = req.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ApiError(400, f"'{key}' must be {({int: 'an integer', float: 'a number', bool: 'true or false', str: 'a string'})[kind]}",
                       param=key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{key}' is {value}; it must be from {low} to {high}", param=key)
    return value


def _text(content, where: str) -> str:
    """A message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are understood",
                               param="messages")
            out.append(part["text"])
        return "".join(out)
    raise ApiError(400, f"{where}: 'content' must be a string or a list of text parts", param="messages")


def parse(body: bytes, chat: bool, limits: Limits) -> dict:
    """A request body, checked whole: {"model", "messages" | "prompts", "n", "max_tokens"
    (None: the default), "temperature", "top_p", "stop", "seed", "stream", "include_usage"}.
    Anything wrong is one ApiError; nothing here touches the model."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(req, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = req.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: the base's name or an adapter's (GET /v1/models lists them)",
                       param="model")
    out = {"model": model}
    if chat:
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"}", param="messages")
        out["messages"] = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ApiError(400, f"{where}: 'role' must be one of {', '.join(ROLES)}", param="messages")
            out["messages"].append({"role": ROLES[m["role"]], "content": _text(m.get("content"), where)})
    else:
        p = req.get("prompt")
        if isinstance(p, str):
            prompts = [p]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            prompts = p
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            prompts = [p]
        elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
            prompts = p
        else:
            raise ApiError(400, "'prompt' must be a string, a list of strings, or token ids", param="prompt")
        if len(prompts) > limits.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts; at most {limits.max_prompts} a request", param="prompt")
        for key in ("echo", "suffix", "best_of"):
            if req.get(key) not in (None, False, 1, ""):
                raise ApiError(400, f"'{key}' is not supported", param=key)
        out["prompts"] = prompts
    if req.get("logprobs") not in (None, False) or req.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "log-probabilities are not returned by this server", param="logprobs")
    out["n"] = _field(req, "n", int, 1, 1, limits.max_n)
    rows = out["n"] * len(out.get("prompts", [0]))
    if rows > limits.max_rows:
        raise ApiError(400, f"n x prompts is {rows}; at most {limits.max_rows} a request (--max-rows)", param="n")
    key = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    out["max_tokens"] = _field(req, key, int, None, 1, limits.max_tokens)
    out["temperature"] = _field(req, "temperature", float, 1.0, 0.0, 2.0)
    out["top_p"] = _field(req, "top_p", float, 1.0, 0.0, 1.0)
    if out["top_p"] == 0:
        raise ApiError(400, "'top_p' must be above 0", param="top_p")
    out["seed"] = _field(req, "seed", int, None, -(2**63), 2**63 - 1)
    out["stream"] = _field(req, "stream", bool, False)
    options = req.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    out["include_usage"] = _field(options, "include_usage", bool, False)
    stop = req.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > limits.max_stop:
        raise ApiError(400, f"'stop' must be a string or a list of at most {limits.max_stop} non-empty strings",
                       param="stop")
    out["stop"] = tuple(stop)
    return out


# --------------------------------------------------------------------------- the models


def allowed(model: str, allow_code: list[str] | tuple[str, ...]) -> bool:
    """Whether --allow-code names `model` (as written, or the same path)."""
    for a in allow_code:
        if a == model:
            return True
        try:
            if Path(a).expanduser().resolve() == Path(model).expanduser().resolve():
                return True
        except (OSError, RuntimeError):
            pass
    return False


def run_model(folder: Path) -> dict:
    """A run folder's model settings and system prompt as its config.yaml holds them ({} without one)."""
    from edgetune.engine.core.config_files import read_run_yaml

    if not (folder / "config.yaml").is_file():
        return {}
    cfg = read_run_yaml(folder / "config.yaml")
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    data = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
    return {**model, "system_prompt": data.get("system_prompt") or ""}


class Service:
    """The served models: the base, the adapters named on the command line, and the finished
    runs of `runs_dir` on the same base, kept in step with the folder by `refresh`."""

    def __init__(self, batcher, tok, base: str, fixed: dict[str, tuple[Path, str]], runs_dir: str,
                 allow_code: tuple[str, ...] = (), limits: Limits | None = None):
        self.batcher, self.tok, self.base = batcher, tok, base
        self.fixed = fixed  # name -> (adapter folder, system prompt)
        self.runs_dir, self.allow_code = runs_dir, tuple(allow_code)
        self.limits = limits or Limits()
        self.stamps: dict[str, tuple] = {}  # name -> (folder, its weights' time) as loaded
        self.system: dict[str, str] = {}  # name -> the run's data.system_prompt
        self.said: set = set()  # refusals already printed
        self.created = int(time.time())
        self.lock = threading.Lock()

    def wanted(self) -> dict[str, tuple[Path, str]]:
        """name -> (adapter folder, system prompt) of every adapter that should be served now."""
        out = dict(self.fixed)
        if not self.runs_dir or not Path(self.runs_dir).is_dir():
            return out
        from edgetune.engine.run import api

        for s in api.summaries(self.runs_dir):
            if s["status"] not in SERVED_STATUSES or not s["has_adapter"] or s["name"] in out:
                continue
            folder = Path(s["path"])
            try:
                model = run_model(folder)
            except EdgetuneError:
                continue
            if model.get("name", EMBEDDED_MODEL) != self.base:
                continue  # trained on another base
            if model.get("trust_remote_code") and not allowed(self.base, self.allow_code):
                self._say(("code", s["name"]), f"serve: run '{s['name']}' is not served: its model.trust_remote_code "
                                               f"runs the Python that {self.base} ships; --allow-code {self.base} "
                                               "allows it")
                continue
            out[s["name"]] = (folder / "adapter", model.get("system_prompt") or "")
        return out

    def refresh(self, strict: bool = False) -> None:
        """Load what appeared or changed, drop what went (on the decode loop's thread).
        `strict`: an adapter named on the command line that cannot be served is an error
        (else its one line is printed once)."""
        with self.lock:
            want = self.wanted()
            for name in [n for n in self.stamps if n not in want]:
                self.batcher.remove_adapter(name)
                del self.stamps[name]
                print(f"serve: {name} removed", file=sys.stderr, flush=True)
            for name, (folder, system) in want.items():
                stamp = _stamp(folder)
                if self.stamps.get(name) == stamp:
                    continue
                try:
                    self.batcher.add_adapter(name, folder)
                except EdgetuneError as e:
                    if strict and name in self.fixed:
                        raise
                    self._say((name, stamp), f"serve: {name} is not served: {e}")
                    continue
                self.stamps[name], self.system[name] = stamp, system
                print(f"serve: {name} added ({folder})", file=sys.stderr, flush=True)

    def _say(self, key, line: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(line, file=sys.stderr, flush=True)

    def models(self) -> list[str]:
        return [self.base, *sorted(self.batcher.adapters())]

    def adapter_of(self, model: str) -> str:
        """The batcher's adapter name for a request's `model` ("" for the base)."""
        if model in (self.base, "base"):
            return ""
        if model in self.batcher.adapters():
            return model
        raise ApiError(404, f"the model '{model}' is not served here (GET /v1/models lists them)",
                       code="model_not_found", param="model")

    def prompt_ids(self, req: dict, adapter: str) -> list[list[int]]:
        from edgetune.engine.data.prompts import prompt_ids

        if "messages" in req:
            try:
                return [prompt_ids(self.tok, [req["messages"]], self.system.get(adapter, ""))[0]]
            except Exception as e:  # the model's chat template refused the conversation
                raise ApiError(400, f"the chat template cannot render these messages ({str(e)[:200]})",
                               param="messages") from None
        vocab = len(self.tok)
        out = []
        for p in req["prompts"]:
            ids = list(p) if isinstance(p, list) else self.tok(p)["input_ids"]
            if not ids or any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, "a prompt is empty or holds token ids outside the vocabulary", param="prompt")
            out.append(ids)
        return out

    def job(self, req: dict, emit):
        """The batcher's Job for a parsed request, its tokens checked against the context."""
        from edgetune.engine.generation.batcher import Job

        adapter = self.adapter_of(req["model"])
        prompts = self.prompt_ids(req, adapter)
        context = self.batcher.context
        longest = max(len(p) for p in prompts)
        max_tokens = req["max_tokens"]
        if max_tokens is None:
            max_tokens = min(self.limits.default_max_tokens, context - longest)
        if longest + max_tokens > context:
            raise ApiError(400, f"the prompt is {longest} tokens and max_tokens {max_tokens}: more than the model's "
                                f"context of {context}", code="context_length_exceeded", param="messages")
        return Job(adapter, prompts, emit, n=req["n"], max_tokens=max_tokens, stop=req["stop"],
                   temperature=req["temperature"], top_p=req["top_p"], seed=req["seed"])


def _stamp(folder: Path) -> tuple:
    times = []
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        try:
            times.append((folder / name).stat().st_mtime_ns)
        except OSError:
            times.append(None)
    return (str(folder), *times)


# --------------------------------------------------------------------------- HTTP


class Gate:
    """The ASGI middleware in front of everything: Host and Origin (engine/core/hosts.py),
    the --auth token, and the body's size, read whole before the app sees it."""

    def __init__(self, app, check: HostCheck, token: str | None, max_body: int):
        self.app, self.check, self.token, self.max_body = app, check, token, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        why = self.check.foreign(headers.get("host", ""), headers.get("origin"), scope["method"] in STATE_CHANGING)
        if why:
            await _refuse(send, ApiError(403, why, code="forbidden_host_or_origin", type="permission_error"))
            return
        if self.token is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                await _refuse(send, ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <the token "
                                                  "given to edgetune serve --auth>'", code="invalid_api_key"))
                return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await _refuse(send, ApiError(413, f"the request body is over {self.max_body} bytes",
                                             code="request_too_large"))
                return
        replayed = []

        async def replay():
            if not replayed:
                replayed.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(send, e: ApiError) -> None:
    data = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def build_app(service: Service, runs_dir: str = "", allow_code: tuple[str, ...] = ()):
    """The FastAPI app (without the Gate: `serve` puts it in front); with `runs_dir`, the
    training API on that folder under /api (engine/run/train_api.py)."""
    from contextlib import asynccontextmanager

    from edgetune.engine.generation.batcher import Busy

    @asynccontextmanager
    async def lifespan(app):
        async def follow_runs():
            while True:
                await asyncio.sleep(REFRESH_SECONDS)
                try:
                    await asyncio.to_thread(service.refresh)
                except Exception as e:  # noqa: BLE001 - a bad folder must not stop serving
                    print(f"serve: following {service.runs_dir}: {type(e).__name__}: {e}", file=sys.stderr)

        task = asyncio.create_task(follow_runs())
        yield
        task.cancel()

    app = FastAPI(title="edgetune", lifespan=lifespan,
                  description="The base model and its LoRA adapters behind an OpenAI-compatible API (/v1), "
                              "and the training API (/api): docs/usage.md.")

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EdgetuneError)
    async def refused(request, e: EdgetuneError):
        from edgetune.engine.run.api import RunsFolderBusy

        status = getattr(e, "status", 409 if isinstance(e, RunsFolderBusy) else 400)
        return JSONResponse(ApiError(status, str(e), getattr(e, "code", None)).body(), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return JSONResponse(ApiError(400, f"{where}: {first.get('msg', 'invalid')}", param=where or None).body(),
                            status_code=400)

    @app.get("/v1/models", tags=["inference"])
    def list_models() -> dict:
        """The base and each adapter, by name."""
        return {"object": "list", "data": [_model_card(service, m) for m in service.models()]}

    @app.get("/v1/models/{model:path}", tags=["inference"])
    def get_model(model: str) -> dict:
        service.adapter_of(model)
        return _model_card(service, model)

    async def complete(request: Request, chat: bool):
        req = parse(await request.body(), chat, service.limits)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event: dict) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutting down)
                pass

        job = service.job(req, emit)
        try:
            service.batcher.submit(job)
        except Busy as e:
            raise ApiError(429, f"the server is busy ({e}): try again shortly", code="server_busy",
                           type="rate_limit_error") from None
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": req["model"]}
        choices = job.n * len(job.prompts)
        if req["stream"]:
            return StreamingResponse(_stream(queue, job, head, chat, choices, req["include_usage"]),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(request, queue, job, head, chat, choices)

    @app.post("/v1/chat/completions", tags=["inference"])
    async def chat_completions(request: Request):
        """OpenAI's chat completions: messages through the model's chat template."""
        return await complete(request, chat=True)

    @app.post("/v1/completions", tags=["inference"])
    async def completions(request: Request):
        """OpenAI's (legacy) completions: the prompt as written."""
        return await complete(request, chat=False)

    if runs_dir:
        from edgetune.engine.run.train_api import router

        app.include_router(router(runs_dir, allow_code), prefix="/api")
    return app


def _model_card(service: Service, model: str) -> dict:
    return {"id": model, "object": "model", "created": service.created, "owned_by": "edgetune",
            "root": service.base, "parent": None if model == service.base else service.base}


def _choice(chat: bool, index: int, text: str | None, finish: str | None, first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}


async def _stream(queue, job, head: dict, chat: bool, choices: int, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice_list, usage=None) -> str:
        body = {**head, "object": kind, "choices": choice_list}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk([_choice(True, i, None, None, first=True) for i in range(choices)])
        while True:
            ev = await queue.get()
            if ev["type"] == "text":
                yield chunk([_choice(chat, ev["choice"], ev["text"], None)])
            elif ev["type"] == "end":
                yield chunk([_choice(chat, ev["choice"], None, ev["finish_reason"])])
            elif ev["type"] == "done":
                if include_usage:
                    yield chunk([], ev["usage"])
                break
            else:
                yield f"data: {json.dumps(ApiError(500, ev['message'], type='server_error').body())}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # a client that left mid-stream: its rows leave the batch (a no-op once done)


async def _whole(request, queue, job, head: dict, chat: bool, choices: int):
    texts, finish = [""] * choices, [None] * choices
    try:
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), 1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return JSONResponse({}, status_code=499)
                continue
            if ev["type"] == "text":
                texts[ev["choice"]] += ev["text"]
            elif ev["type"] == "end":
                finish[ev["choice"]] = ev["finish_reason"]
            elif ev["type"] == "done":
                usage = ev["usage"]
                break
            else:
                raise ApiError(500, ev["message"], type="server_error")
    finally:
        job.cancelled = True
    if chat:
        out = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finish))]
    else:
        out = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
               for i, (t, f) in enumerate(zip(texts, finish))]
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": out, "usage": usage}
