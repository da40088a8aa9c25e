"""4 · Train: Start / Stop / Resume / Add to queue, the live view of the run the page
shows, and the queue (app/queue_section.py).

Everything the view shows about a run is read from the run folder on every timer tick
(events.jsonl, memory.json), so a reloaded page, a second browser tab or a restarted
app re-attaches to the same run and replays its history.
"""

from __future__ import annotations

import hashlib
import json
import time

import gradio as gr

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import api

from . import form, live
from .methods import BY_KEY, MAX_PLOTS, METHODS
from .page import message, number_field, or_skip
from .queue_section import QueueSection
from .tab_model import decided_text, time_text

# While a run trains, its plots are redrawn at most this often (each is a PNG drawn on the
# server: about 100 ms); the progress, logs and runs table follow every event.
PLOT_EVERY_S = 5.0


def _digest(value) -> str:
    """A short fingerprint of what a part of the page shows: sent again only when it changes."""
    return hashlib.blake2b(repr(value).encode(), digest_size=8).hexdigest()


class TrainTab:
    def __init__(self, page):
        self.page = page
        with gr.Row():
            self.start_btn = gr.Button("Start", variant="primary", elem_id="start-btn")
            # the form's run into the queue (below): it starts once the runs before it ended
            self.queue_btn = gr.Button("Add to queue", elem_id="queue-btn")
            self.stop_btn = gr.Button("Stop (saves the adapter)", variant="stop", elem_id="stop-btn", interactive=False)
            self.resume_btn = gr.Button("Resume", elem_id="resume-btn", interactive=False)
            n_gpus = api.gpu_count()  # several visible: the run may train data-parallel on them
            self.gpus = number_field(value=1, minimum=1, maximum=max(n_gpus, 1), precision=0, visible=n_gpus > 1,
                                     label=f"GPUs (of {n_gpus})", elem_id="start-gpus")
        page.form_note = gr.Markdown("", elem_id="form-origin")  # whose settings the form holds
        # Filled when the tab is shown: what Start would decide for the form's `auto` settings.
        self.decided = gr.Markdown("", elem_id="train-decided")
        self.time = gr.Markdown("", elem_id="train-time")  # the run's time on this machine, before Start
        self.msg = gr.Markdown("", elem_id="train-message")
        self.progress = gr.HTML(live.progress_html([], "none"), elem_id="train-progress")
        with gr.Row():
            with gr.Column(scale=3):
                self.plots = [gr.Plot(label=f"plot {i + 1}", show_label=False, elem_id=f"plot-{i}", visible=i == 0,
                                      format="png")
                              for i in range(MAX_PLOTS)]
            with gr.Column(scale=2):
                gr.Markdown("**Memory** (live, from the worker's memory.json)")
                self.memory = gr.HTML(live.memory_html(None, page.host_total, False), elem_id="memory-panel")
                self.samples = gr.Markdown("", elem_id="samples")
        self.logs = gr.Textbox(label="Recent events (newest first)", lines=12, max_lines=12, autoscroll=False,
                               elem_id="log-lines", interactive=False)
        self.queue = QueueSection(page)

    # ------------------------------------------------------------------ live view

    @property
    def live_inputs(self) -> list:
        """draw()'s arguments: the run folder shown, what was last drawn, where the message was made."""
        return [self.page.attached, self.page.seen, self.page.msg_at]

    @property
    def live_outputs(self) -> list:
        """Everything draw() may update."""
        p = self.page
        return [self.progress, *self.plots, self.memory, self.logs, self.samples, self.msg, p.banner, p.seen,
                p.msg_at, p.runs_tab.table, p.chat_tab.info, p.export_tab.info, self.start_btn, self.stop_btn,
                self.resume_btn, *([p.timer] if p.timer is not None else [])]

    def draw(self, path: str, last: dict, msg: dict) -> dict:
        """The Train tab for one run, the banner, and what other tabs show of the run (the
        runs table, the Try-it and Export notes): each part sent only when what it shows
        changed (`last` keeps a digest of what was sent), the plots only when their data
        changed and, while the run trains, at most every PLOT_EVERY_S. A tick on a run that
        wrote nothing new sends the progress line alone while it trains (its clock), and
        nothing once it ended."""
        p = self.page
        run = p.run_of(path)
        if run is None:
            if last.get("path") == path and last.get("status") == "none":
                return {}  # nothing shown, nothing changed: no update goes to the browser
            return {self.progress: live.progress_html([], "none"),
                    self.memory: live.memory_html(None, p.host_total, False),
                    p.banner: p.banner_text(path), p.seen: {"path": path, "status": "none"},
                    **self.buttons("none"), **self.pace("none")}
        events = p.events_of(run)
        status = run.status(events)
        same = last.get("path") == path
        moved = not same or last.get("n") != len(events) or last.get("status") != status
        if not moved and status not in api.ACTIVE and not msg and not last.get("plot_due"):
            return {}  # an ended run, unchanged since the last tick: nothing to redraw
        try:
            mem = json.loads(run.dir.memory_path.read_text())
        except FileNotFoundError:
            mem = None
        except (OSError, ValueError):  # mid-rename on some filesystems: keep the last reading
            mem = last.get("mem")
        now = time.time()
        seen = {"path": path, "n": len(events), "status": status, "mem": mem,
                "sent": dict(last.get("sent") or {}) if same else {},
                "plotted": last.get("plotted", 0.0) if same else 0.0, "plot_due": last.get("plot_due") and same}
        out: dict = {}

        def send(component, name: str, value, digest=None) -> None:
            digest = digest if digest is not None else _digest(value)
            if seen["sent"].get(name) != digest:
                seen["sent"][name] = digest
                out[component] = value

        send(self.progress, "progress", live.progress_html(events, status, p.death(run) if status == "crashed" else "",
                                                           now))
        send(self.memory, "memory", live.memory_html(mem, p.host_total, run.alive()))
        send(p.banner, "banner", f"Showing run **{run.name}** · {status}")
        if moved or seen["plot_due"]:
            started = next((e for e in reversed(events) if e["type"] == "started"), None)
            name = started.get("method") if started else run.summary()["method"]
            method = BY_KEY.get(name, METHODS[0])  # a damaged config.yaml: the first method
            frames = live.plot_frames(events, method)
            stepped = any(e["type"] == "step" for e in events)
            digest = _digest([stepped, method.name, *(f.to_json() for f in frames)])
            if digest != seen["sent"].get("plots"):
                if status not in ("running", "starting") or now - seen["plotted"] >= PLOT_EVERY_S:
                    out.update({plot: gr.Plot(value=live.plot_figure(frames[i], method.plots[i], stepped),
                                              visible=True) if i < len(frames) else gr.Plot(visible=False)
                                for i, plot in enumerate(self.plots)})
                    seen["sent"]["plots"], seen["plotted"], seen["plot_due"] = digest, now, False
                else:
                    seen["plot_due"] = True  # drawn on a later tick, once PLOT_EVERY_S has passed
            else:
                seen["plot_due"] = False
        if moved:
            send(self.logs, "logs", live.log_lines(events))
            shown = [live.eval_samples_markdown(events), live.samples_markdown(events) if method.samples else ""]
            send(self.samples, "samples", "\n\n".join(part for part in shown if part))
            # The runs table follows the run (its step column moves with it).
            table = p.runs_tab.frame()
            send(p.runs_tab.table, "table", table, _digest(table.to_json()))
        if status != last.get("status") or not same:
            # The Try-it / Export notes follow the run's status (an adapter appears when it stops).
            out[p.chat_tab.info] = p.chat_tab.describe(path)
            out[p.export_tab.info] = p.export_tab.describe(path)
            out.update(self.buttons(status))
            out.update(self.pace(status))
        # A message belongs to the action that made it: it stays until the next action, and
        # goes when the page shows another run or that run reaches a new end.
        if msg and (msg.get("path") != path or any(
                e["type"] in ("finished", "stopped", "error") and e["i"] >= int(msg.get("n") or 0) for e in events)):
            out[self.msg] = ""
            out[p.msg_at] = {}
        if out or seen != last:
            out[p.seen] = seen
        return out

    def pace(self, status: str) -> dict:
        """The live view's timer: every second while the run trains, slower otherwise."""
        if self.page.timer is None:
            return {}
        key = "active" if status in api.ACTIVE else "idle"
        return {self.page.timer: gr.Timer(value=self.page.tick_seconds[key])}

    def buttons(self, status: str) -> dict:
        """Start, Stop and Resume enabled only where they apply to the run shown: Stop while
        it trains, Resume once it stopped, failed or crashed (a finished run trains further
        from the Runs tab), Start whenever it is not training."""
        active = status in api.ACTIVE
        return {self.start_btn: gr.Button(interactive=not active),
                self.stop_btn: gr.Button(interactive=active),
                self.resume_btn: gr.Button(interactive=status in ("stopped", "failed", "crashed"))}

    # ------------------------------------------------------------------ actions

    def show_decided(self, values: dict) -> dict:
        try:
            cfg = self.page.config(values)
        except EdgetuneError as e:
            return {self.decided: message(f"Settings problem: {e}", "error"), self.time: ""}
        return {self.decided: decided_text(cfg) + f"\n\nThe same run from a terminal: `{form.cli_command(cfg)}`",
                self.time: time_text(cfg, self.page.report(cfg))}

    def do_start(self, values: dict) -> dict:
        p = self.page
        path = values[p.attached]
        try:
            cfg = p.config(values)
            if p.refused(cfg):  # before any run folder is made
                raise EdgetuneError(p.refused(cfg))
            gpus = values.get(self.gpus)
            run = p.adopt(api.start(cfg, gpus=1 if gpus is None else gpus))
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error"), p.msg_at: p.said(path)}
        return {self.msg: message(f"Started run **{run.name}** (folder `{run.path}`)", "ok"),
                p.attached: str(run.path), p.msg_at: p.said(str(run.path))}

    def do_stop(self, path: str) -> dict:
        p = self.page
        run = p.run_of(path)
        if run is None or run.status() not in ("running", "starting"):
            return {self.msg: message("No run is training.", "error"), p.msg_at: p.said(path)}
        said = p.said(path)
        run.stop()
        return {self.msg: message(f"Stopping **{run.name}** after the current step; the adapter will be saved."),
                p.msg_at: said}

    def do_resume(self, path: str) -> dict:
        p = self.page
        run = p.run_of(path)
        if run is None:
            return {self.msg: message("Open a run first (Runs tab).", "error"), p.msg_at: p.said(path)}
        said = p.said(path)  # before the resume: the run's old end must not take the message away
        try:
            # No code confirmation here: a run whose settings run Python (reward_file,
            # trust_remote_code) is refused with the one line naming the CLI command.
            run = p.adopt(api.resume(run.path))
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error"), p.msg_at: p.said(path)}
        # The worker picks the checkpoint (it skips a damaged newest one): its `started`
        # event in the log below names the step it continues from.
        return {self.msg: message(f"Resuming **{run.name}**: the log below says from which checkpoint.", "ok"),
                p.attached: str(run.path), p.msg_at: said}

    def wire(self, tab: gr.Tab) -> None:
        p = self.page
        tab.select(self.show_decided, p.form_inputs, [self.decided, self.time], show_progress="hidden")
        acted = [self.msg, p.attached, p.msg_at]
        self.start_btn.click(self.do_start, p.form_inputs | {p.attached, self.gpus}, acted) \
            .then(or_skip(self.draw), self.live_inputs, self.live_outputs) \
            .then(p.runs_tab.refresh, p.attached, p.runs_tab.outputs)
        self.stop_btn.click(self.do_stop, p.attached, [self.msg, p.msg_at])
        self.resume_btn.click(self.do_resume, p.attached, acted).then(or_skip(self.draw), self.live_inputs, self.live_outputs)
        self.queue.wire(self.queue_btn)
