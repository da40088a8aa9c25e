"""6 · Try it: the same prompt to the base model and to the base with the run's adapter,
side by side, each side continuing its own conversation (one chat worker process), both
after the run's data.system_prompt as its training data had it (or a system prompt typed
here); greedy, or sampled at a temperature and top-p; the replies stream in token by token."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import gradio as gr

from edgetune.engine.core import settings as S
from edgetune.engine.core.errors import EdgetuneError

from . import panels
from .page import message, slider_field

ANSWERING = "Answering: the adapter's side first, then the base's…"
LOADING = "Answering: the chat worker loads the model first (the first reply waits for it)…"
# The chat worker holds the model in memory: it ends after this long without a question
# (the next question starts it again, as the first did).
IDLE_SECONDS = 600.0


def _close_when_idle(tab: "ChatTab", every: float = 30.0) -> None:
    while True:
        time.sleep(every)
        chat = tab.page.chat
        if chat.proc is None or time.time() - tab.used < IDLE_SECONDS:
            continue
        if chat.lock.acquire(blocking=False):  # never under a reply being streamed
            try:
                chat.close()
                tab.loaded = None
            finally:
                chat.lock.release()


class ChatTab:
    def __init__(self, page):
        self.page = page
        self.used = time.time()  # the last question's time
        self.loaded = None  # the model and adapter the chat worker holds (None: it holds none)
        threading.Thread(target=_close_when_idle, args=(self,), name="edgetune-chat-idle", daemon=True).start()
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
            self.temperature = gr.Slider(0, 1.5, value=0, step=0.05, label="temperature (0 = greedy)", scale=1,
                                         elem_id="chat-temperature")
            self.top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top-p (when sampling)", scale=1,
                                   elem_id="chat-top-p")
            self.system = gr.Textbox(label="System prompt (empty: the run's data.system_prompt)", max_lines=3,
                                     elem_id="chat-system", scale=3)
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

    def do_chat(self, values: dict):
        """Send the prompt to both sides: the question shows at once, then each reply as
        its tokens come (the adapter's side first), then the final texts."""
        p = self.page
        text, path = values[self.prompt], values[p.attached]
        hist_base, hist_tuned = list(values[self.base] or []), list(values[self.tuned] or [])
        if not (text or "").strip():
            yield {self.info: self.describe(path)}
            return
        run, adapter = self.target(path)
        try:
            max_new = S.typed_number("max new tokens", values[self.max_new], S.CHAT_TOKENS)
            # the run's own settings (those of the form while no run is open): the model as
            # it was trained, and its data.system_prompt, put first as training put it
            cfg = S.from_dict(run.config()) if run else p.config(values)
        except EdgetuneError as e:
            yield {self.info: message(str(e), "error")}
            return
        if run is not None and cfg.model.trust_remote_code:  # a run folder may come from anyone
            yield {self.info: message(f"{run.dir.config_path}: model.trust_remote_code would run the Python code "
                                      f"that model {cfg.model.name} ships; the app does not run it for a run "
                                      "folder", "error")}
            return
        user = {"role": "user", "content": text}
        # Each side continues its own conversation: the adapter's earlier replies are
        # part of what the adapter answers next.
        hist_base, hist_tuned = panels.chat_messages(hist_base), panels.chat_messages(hist_tuned)
        shown = {"base": "…", "tuned": "…" if adapter else "(no adapter saved yet)"}

        def view(extra: dict | None = None) -> dict:
            return {self.base: hist_base + [user, {"role": "assistant", "content": shown["base"]}],
                    self.tuned: hist_tuned + [user, {"role": "assistant", "content": shown["tuned"]}], **(extra or {})}

        # the question at once, the prompt box ready for the next; the wait for a model to load said
        self.used = time.time()
        wanted = (repr(dataclasses.asdict(cfg.model)), adapter)
        alive = p.chat.proc is not None and p.chat.proc.poll() is None
        yield view({self.prompt: "", self.info: LOADING if not alive or self.loaded != wanted else
                    ANSWERING if adapter else "Answering: the base model…"})
        system = (values.get(self.system) or "").strip() or cfg.data.system_prompt
        req = {"model": dataclasses.asdict(cfg.model), "adapter": adapter, "messages": hist_base + [user],
               "tuned_messages": hist_tuned + [user], "max_new_tokens": max_new,
               "system_prompt": system, "temperature": float(values.get(self.temperature) or 0),
               "top_p": float(values.get(self.top_p) or 1),
               "seed": random.randrange(2**31)}  # a new sample each time; both sides draw from the same seed
        reply = {}
        for reply in p.chat.stream(req):
            if "partial" in reply:
                shown[reply["partial"]] = reply["text"] or "…"
                loading, self.loaded = self.loaded != wanted, wanted
                yield view({self.info: ANSWERING if adapter else "Answering: the base model…"} if loading else None)
        if not reply.get("ok"):
            yield {self.base: hist_base, self.tuned: hist_tuned, self.prompt: text,
                   self.info: message(reply.get("error", "chat failed"), "error")}
            return
        self.loaded, self.used = wanted, time.time()
        shown["base"] = reply["base"]
        if reply.get("tuned") is not None:
            shown["tuned"] = reply["tuned"]
        yield view({self.info: self.describe(path)})

    def wire(self) -> None:
        p = self.page
        inputs = p.form_inputs | {self.prompt, self.base, self.tuned, self.max_new, self.temperature, self.top_p,
                                  self.system, p.attached}
        outputs = [self.base, self.tuned, self.prompt, self.info]
        self.send_btn.click(self.do_chat, inputs, outputs)
        self.prompt.submit(self.do_chat, inputs, outputs)
        self.clear_btn.click(lambda: {self.base: [], self.tuned: []}, None, [self.base, self.tuned])
