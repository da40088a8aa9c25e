"""6 · Try it: the same prompt to the base model and to the base with the run's adapter,
side by side, each side continuing its own conversation (one chat worker process), both
after the run's data.system_prompt as its training data had it."""

from __future__ import annotations

import dataclasses

import gradio as gr

from edgetune.engine.core import settings as S
from edgetune.engine.core.errors import EdgetuneError

from . import panels
from .page import message, slider_field


class ChatTab:
    def __init__(self, page):
        self.page = page
        self.info = gr.Markdown("", elem_id="chat-info")
        with gr.Row():
            self.base = gr.Chatbot(label="Base model", height=360, elem_id="chat-base")
            self.tuned = gr.Chatbot(label="Base + adapter", height=360, elem_id="chat-tuned")
        with gr.Row():
            self.prompt = gr.Textbox(label="Prompt (sent to both)", placeholder="What is 3 plus 4?",
                                     elem_id="chat-prompt", scale=4)
            self.max_new = slider_field(S.CHAT_TOKENS.low, S.CHAT_TOKENS.high, value=96, step=8,
                                        label="max new tokens", scale=1, elem_id="chat-max-new")
        with gr.Row():
            self.send_btn = gr.Button("Send to both", variant="primary", elem_id="chat-send")
            self.clear_btn = gr.Button("Clear", elem_id="chat-clear")

    def target(self, path: str):
        """The run shown and its saved adapter folder ("" while it has none)."""
        run = self.page.run_of(path)
        has = run is not None and (run.dir.adapter / "adapter_config.json").is_file()
        return run, (str(run.dir.adapter) if has else "")

    def describe(self, path: str) -> str:
        run, adapter = self.target(path)
        if run is None:
            return "No run open: answers come from the base model of the Model tab only."
        if not adapter:
            return f"Run **{run.name}** has no saved adapter yet: only the base model answers."
        return f"Left: the base of run **{run.name}**; right: the same base with its adapter (`{adapter}`)."

    def do_chat(self, values: dict) -> dict:
        p = self.page
        text, path = values[self.prompt], values[p.attached]
        hist_base, hist_tuned = list(values[self.base] or []), list(values[self.tuned] or [])
        if not (text or "").strip():
            return {self.info: self.describe(path)}
        run, adapter = self.target(path)
        try:
            max_new = S.typed_number("max new tokens", values[self.max_new], S.CHAT_TOKENS)
            # the run's own settings (those of the form while no run is open): the model as
            # it was trained, and its data.system_prompt, put first as training put it
            cfg = S.from_dict(run.config()) if run else p.config(values)
        except EdgetuneError as e:
            return {self.info: message(str(e), "error")}
        if run is not None and cfg.model.trust_remote_code:  # a run folder may come from anyone
            return {self.info: message(f"{run.dir.config_path}: model.trust_remote_code would run the Python code "
                                       f"that model {cfg.model.name} ships; the app does not run it for a run "
                                       "folder", "error")}
        user = {"role": "user", "content": text}
        # Each side continues its own conversation: the adapter's earlier replies are
        # part of what the adapter answers next.
        hist_base, hist_tuned = panels.chat_messages(hist_base), panels.chat_messages(hist_tuned)
        reply = p.chat.ask(dataclasses.asdict(cfg.model), hist_base + [user], adapter, max_new,
                           tuned_messages=hist_tuned + [user], system_prompt=cfg.data.system_prompt)
        if not reply.get("ok"):
            return {self.base: hist_base, self.tuned: hist_tuned,
                    self.info: message(reply.get("error", "chat failed"), "error")}
        hist_base += [user, {"role": "assistant", "content": reply["base"]}]
        tuned = reply["tuned"] if reply.get("tuned") is not None else "(no adapter saved yet)"
        hist_tuned += [user, {"role": "assistant", "content": tuned}]
        return {self.base: hist_base, self.tuned: hist_tuned, self.prompt: "", self.info: self.describe(path)}

    def wire(self) -> None:
        p = self.page
        inputs = p.form_inputs | {self.prompt, self.base, self.tuned, self.max_new, p.attached}
        outputs = [self.base, self.tuned, self.prompt, self.info]
        self.send_btn.click(self.do_chat, inputs, outputs)
        self.prompt.submit(self.do_chat, inputs, outputs)
        self.clear_btn.click(lambda: {self.base: [], self.tuned: []}, None, [self.base, self.tuned])
