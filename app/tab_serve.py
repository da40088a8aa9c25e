"""9 · Serve: the base and the runs' adapters behind an OpenAI-compatible API (`edgetune
serve`, engine/run/serve.py), started from the page in a process of its own
(engine/run/serve_process.py): the endpoint, the model names to give a tool, and Stop. A
reloaded page or a restarted app finds the server again; the app stops the one it started
when it quits."""

from __future__ import annotations

import html

import gradio as gr

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import serve_process

from .page import message, number_field, or_skip

TICK_SECONDS = 2.0


def status_text(server) -> str:
    """Where the server stands, with what a tool needs to use it."""
    if not server.alive():
        last = server.last_line()
        return "Not serving." + (f" The last server's last line: `{html.escape(last[-300:])}`" if last else "")
    url, models = server.url(), server.models()
    if models is None:
        return f"Starting at **{url}**: loading the base model ..."
    names = ", ".join(f"`{html.escape(m)}`" for m in models)
    first = html.escape(models[-1])
    return (f"Serving at **{url}** (this machine only) · models: {names}\n\n"
            "Point a tool's OpenAI base URL at it, with any API key and one of the models above; every "
            "finished run of this runs folder trained on this base appears without a restart.\n\n"
            f"```python\nfrom openai import OpenAI\nclient = OpenAI(base_url=\"{url}\", api_key=\"none\")\n"
            f"client.chat.completions.create(model=\"{first}\", messages=[{{\"role\": \"user\", "
            f"\"content\": \"Hello\"}}])\n```\n\n"
            f"```sh\ncurl {url}/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{first}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'\n```")


class ServeTab:
    def __init__(self, page):
        self.page = page
        self.started = None  # the server this app started (stopped when the app quits)
        gr.Markdown("Serve the Model tab's base and every finished run of this runs folder trained on it over an "
                    "OpenAI-compatible API (`edgetune serve`), for an editor's assistant, a chat front end or a "
                    "script. Requests for different adapters decode together in one batch.")
        with gr.Row():
            self.port = number_field(value=8000, label="Port", precision=0, elem_id="serve-port", scale=1)
            self.start_btn = gr.Button("Start serving", variant="primary", elem_id="serve-start-btn", scale=1)
            self.stop_btn = gr.Button("Stop serving", variant="stop", elem_id="serve-stop-btn", scale=1)
        self.msg = gr.Markdown("", elem_id="serve-message")
        self.status = gr.Markdown("Not serving.", elem_id="serve-status")
        self.timer = gr.Timer(TICK_SECONDS)
        self.shown = gr.State("")

    def server(self):
        started = self.started
        if started is not None and started.alive():
            return started
        return serve_process.Server(self.page.runs_dir)

    def draw(self, shown: str) -> dict:
        now = status_text(self.server())
        return {} if now == shown else {self.status: now, self.shown: now}

    def do_start(self, values: dict) -> dict:
        try:
            cfg = self.page.config(values)
            self.started = serve_process.start(self.page.runs_dir, cfg.model.name, cfg.model.quant,
                                               values[self.port])
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error")}
        return {self.msg: message(f"Started the server on port {self.started.port() or values[self.port]}.", "ok")}

    def do_stop(self) -> dict:
        server = self.server()
        if not server.alive():
            return {self.msg: message("No server is running.", "error")}
        server.stop()
        return {self.msg: message("Stopped the server.", "ok")}

    def close(self) -> None:
        if self.started is not None and self.started.alive():
            self.started.stop()

    def wire(self) -> None:
        self.timer.tick(or_skip(self.draw), self.shown, [self.status, self.shown], show_progress="hidden")
        self.start_btn.click(self.do_start, self.page.form_inputs | {self.port}, [self.msg]) \
            .then(or_skip(self.draw), self.shown, [self.status, self.shown])
        self.stop_btn.click(self.do_stop, None, [self.msg]).then(or_skip(self.draw), self.shown,
                                                                  [self.status, self.shown])
