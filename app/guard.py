"""What the app lets in, checked on the server for every request: an ASGI middleware that
sits under Gradio's FastAPI app (see main.launch).

- Host and Origin: engine/core/hosts.py (shared with `edgetune serve`).
- Uploads: a file part of any multipart request must carry one of the data file types the
  Data tab offers. The browser's file picker filters by type too, but only this check
  holds against a request sent by hand.
- Logins (--auth): after a few failed logins from one address, its attempts are refused
  for a pause that doubles with each further failure (LoginThrottle).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse

from edgetune.engine.core.hosts import STATE_CHANGING, HostCheck

LOGIN_PATHS = ("/login", "/login/")  # Gradio's login form posts here


@dataclass
class LoginThrottle:
    """Failed logins per client address: the `free_failures`-th failure in a row makes the
    address wait `first_pause` seconds before its next attempt (refused unread until then);
    each further failure doubles the pause, up to `longest_pause`. A login clears it."""
    free_failures: int = 5
    first_pause: float = 30.0
    longest_pause: float = 3600.0
    clock: Callable[[], float] = time.monotonic
    failures: dict[str, tuple[int, float]] = field(default_factory=dict)  # address -> (failures, refused until)

    def wait(self, client: str) -> float:
        """Seconds before this address may try again (0: now)."""
        _, until = self.failures.get(client, (0, 0.0))
        return max(0.0, until - self.clock())

    def failed(self, client: str) -> None:
        now = self.clock()
        if len(self.failures) > 10_000:  # forget addresses whose pause is long over
            self.failures = {c: v for c, v in self.failures.items() if v[1] + self.longest_pause > now}
        n = self.failures.get(client, (0, 0.0))[0] + 1
        pause = 0.0 if n < self.free_failures else \
            min(self.first_pause * 2 ** (n - self.free_failures), self.longest_pause)
        self.failures[client] = (n, now + pause)

    def succeeded(self, client: str) -> None:
        self.failures.pop(client, None)


class RefusedUpload(Exception):
    pass


def _file_part_checker(content_type: str, suffixes: tuple[str, ...]) -> MultipartParser:
    """A multipart parser that raises RefusedUpload at the headers of a file part whose
    name does not end in one of `suffixes`. It reads the parts as Gradio's upload parser
    does (the last Content-Disposition of a part, a part is a file when it has `filename`),
    so the two agree on which parts are files and what they are called."""
    _, params = parse_options_header(content_type)
    if b"boundary" not in params:
        raise RefusedUpload("a multipart request without a boundary")
    part = {"field": b"", "value": b"", "disposition": b""}

    def on_header_field(data, start, end):
        part["field"] += data[start:end]

    def on_header_value(data, start, end):
        part["value"] += data[start:end]

    def on_header_end():
        if part["field"].lower() == b"content-disposition":
            part["disposition"] = part["value"]
        part["field"] = part["value"] = b""

    def on_headers_finished():
        _, options = parse_options_header(part["disposition"])
        part["disposition"] = b""
        if b"filename" in options:
            name = options[b"filename"].decode("latin-1")  # the suffixes are ASCII: any charset ends the same
            if not name.lower().endswith(suffixes):
                raise RefusedUpload(f"'{name}' is not a data file (the app takes {' '.join(suffixes)})")

    return MultipartParser(params[b"boundary"], {"on_header_field": on_header_field,
                                                  "on_header_value": on_header_value,
                                                  "on_header_end": on_header_end,
                                                  "on_headers_finished": on_headers_finished})


class Guard:
    """The ASGI middleware. `bound`: the host the app binds; `allow`: the names given with
    --allow-host; `upload_types`: the file suffixes an upload may have; `throttle`: a
    LoginThrottle when the app has a login."""

    def __init__(self, app, bound: str, allow: tuple[str, ...], upload_types: tuple[str, ...],
                 throttle: LoginThrottle | None = None):
        self.app = app
        self.check = HostCheck(bound, allow)
        self.upload_types = tuple(t.lower() for t in upload_types)
        self.throttle = throttle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self.foreign(scope, headers)
        if refusal is not None:
            await self.refuse(scope, receive, send, 403, refusal)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
        elif self.throttle is not None and scope["method"] == "POST" and scope["path"] in LOGIN_PATHS:
            await self.login(scope, receive, send)
        elif parse_options_header(headers.get("content-type", ""))[0] == b"multipart/form-data":
            await self.upload(scope, receive, send, headers["content-type"])
        else:
            await self.app(scope, receive, send)

    def foreign(self, scope, headers: Headers) -> str | None:
        """Why a request comes from elsewhere, or None."""
        changes = scope["type"] == "websocket" or scope["method"] in STATE_CHANGING
        return self.check.foreign(headers.get("host", ""), headers.get("origin"), changes)

    @staticmethod
    async def refuse(scope, receive, send, status: int, text: str, headers: dict | None = None) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": text[:120]})
            return
        await PlainTextResponse(text + "\n", status_code=status, headers=headers)(scope, receive, send)

    async def login(self, scope, receive, send) -> None:
        client = (scope.get("client") or ("?",))[0]
        wait = self.throttle.wait(client)
        if wait > 0:
            await self.refuse(scope, receive, send, 429,
                              f"refused: too many failed logins from {client}: try again in {wait:.0f} s",
                              {"Retry-After": str(int(wait) + 1)})
            return
        status = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, send_status)
        if status and status[0] == 200:
            self.throttle.succeeded(client)
        elif status and status[0] in (400, 401, 403):
            self.throttle.failed(client)

    async def upload(self, scope, receive, send, content_type: str) -> None:
        """Each body chunk is parsed here before the app downstream sees it, so a refused
        file part never reaches Gradio's parser: no file of it is written."""
        try:
            checker = _file_part_checker(content_type, self.upload_types)
        except RefusedUpload as e:
            await self.refuse(scope, receive, send, 400, f"upload refused: {e}")
            return
        started = []

        async def checked_receive():
            message = await receive()
            if message["type"] == "http.request":
                try:
                    checker.write(message.get("body", b""))
                except MultipartParseError as e:
                    raise RefusedUpload(f"a malformed multipart body ({e})") from None
            return message

        async def send_started(message):
            if message["type"] == "http.response.start":
                started.append(True)
            await send(message)

        try:
            await self.app(scope, checked_receive, send_started)
        except RefusedUpload as e:
            if started:
                raise
            await self.refuse(scope, receive, send, 415, f"upload refused: {e}")
