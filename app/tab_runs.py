"""5 · Runs: the table of runs in the runs folder, and opening one in the Train tab."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from edgetune.engine.core.errors import EdgetuneError
from edgetune.engine.core.settings import MORE_STEPS, typed_number
from edgetune.engine.run import api

from . import panels
from .page import message, number_field


class RunsTab:
    def __init__(self, page):
        self.page = page
        self.table = gr.Dataframe(panels.runs_frame([]), label=f"Runs in {page.runs_dir}", interactive=False,
                                  elem_id="runs-table", wrap=True)
        # Each run's curves are also TensorBoard event files (run.report_to, engine/run/tracking.py).
        gr.Markdown(f"Compare runs in TensorBoard: `tensorboard --logdir {page.runs_dir}` (one run's curves: "
                    f"`{page.runs_dir}/<run>/tensorboard`)", elem_id="runs-tensorboard")
        with gr.Row():
            self.select = gr.Dropdown(choices=[], label="Run", elem_id="run-select", scale=3)
            self.open_btn = gr.Button("Open in the Train tab", elem_id="open-run-btn", scale=1)
            self.refresh_btn = gr.Button("Refresh", elem_id="refresh-runs-btn", scale=1)
        # `edgetune resume --more-steps`: a finished or stopped run trains further from its last
        # checkpoint, optimizer state included, at the learning-rate schedule's final value.
        with gr.Row():
            self.more = number_field(value=20, minimum=1, precision=0, label="More steps", elem_id="more-steps",
                                     scale=1)
            self.more_btn = gr.Button("Train the run N more steps", elem_id="more-steps-btn", scale=1)

    def frame(self):
        return panels.runs_frame(api.summaries(self.page.runs_dir))

    def choices(self, selected: str = "") -> gr.Dropdown:
        """The run picker, on `selected` (a run folder) when it is listed, else the newest."""
        names = [r.name for r in api.list_runs(self.page.runs_dir)]
        value = Path(selected).name if selected and Path(selected).name in names else (names[0] if names else None)
        return gr.Dropdown(choices=names, value=value)

    @property
    def outputs(self) -> list:
        return [self.table, self.select]

    def refresh(self, selected: str = "") -> dict:
        return {self.table: self.frame(), self.select: self.choices(selected)}

    def do_open(self, name: str) -> dict:
        p = self.page
        if not name:
            return {p.train_tab.msg: message("Pick a run.", "error")}
        path = str(p.runs_dir / name)
        board = p.runs_dir / name / "tensorboard"
        said = f"Opened **{name}**" + (f" (TensorBoard: `tensorboard --logdir {board}`)." if board.is_dir() else ".")
        return {p.attached: path, p.train_tab.msg: message(said, "ok"),
                p.tabs: gr.Tabs(selected="train"), p.msg_at: p.said(path)}

    def do_more(self, name: str, n) -> dict:
        """Train the picked run `n` steps further (api.resume with more), shown in the Train tab."""
        p = self.page
        try:
            n = typed_number("--more-steps", n, MORE_STEPS)  # the command line's one line
        except EdgetuneError as e:
            return {p.train_tab.msg: message(str(e), "error")}
        if not name:
            return {p.train_tab.msg: message("Pick a run.", "error")}
        path = str(p.runs_dir / name)
        try:
            run = p.adopt(api.resume(path, more=n))
        except EdgetuneError as e:
            return {p.train_tab.msg: message(str(e), "error"), p.attached: path, p.msg_at: p.said(path)}
        return {p.train_tab.msg: message(f"Training **{run.name}** {n} more steps.", "ok"), p.attached: path,
                p.tabs: gr.Tabs(selected="train"), p.msg_at: {"path": path, "status": "starting"}}

    def wire(self) -> None:
        p = self.page
        self.refresh_btn.click(self.refresh, p.attached, self.outputs)
        self.open_btn.click(self.do_open, self.select, [p.attached, p.train_tab.msg, p.tabs, p.msg_at]) \
            .then(p.train_tab.draw, p.train_tab.live_inputs, p.train_tab.live_outputs)
        self.more_btn.click(self.do_more, [self.select, self.more], [p.attached, p.train_tab.msg, p.tabs, p.msg_at]) \
            .then(p.train_tab.draw, p.train_tab.live_inputs, p.train_tab.live_outputs)
