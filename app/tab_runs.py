"""5 · Runs: the table of runs in the runs folder, opening one in the Train tab, training
one further, renaming it, and deleting it to the trash (<runs_dir>/.trash, restorable)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from edgetune.engine.core.errors import EdgetuneError
from edgetune.engine.core.settings import MORE_STEPS, typed_number

from edgetune.engine.run import api

from . import live, panels
from .methods import COMPARABLE
from .page import message, number_field


class RunsTab:
    def __init__(self, page):
        self.page = page
        self.table = gr.Dataframe(panels.runs_frame([]), label=f"Runs in {page.runs_dir}", interactive=False,
                                  elem_id="runs-table", wrap=True,
                                  # a long metrics text wraps in its column instead of pushing others off
                                  column_widths=["16%", "8%", "7%", "7%", "32%", "18%", "12%"])
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
        with gr.Row():
            self.new_name = gr.Textbox(label="New name", max_lines=1, elem_id="run-new-name", scale=2)
            self.rename_btn = gr.Button("Rename the run", elem_id="rename-run-btn", scale=1)
            self.delete_btn = gr.Button("Delete the run (to the trash)", variant="stop", elem_id="delete-run-btn",
                                        scale=1)
        with gr.Row():
            self.trashed = gr.Dropdown(choices=api.trashed_runs(page.runs_dir), label=f"In {page.runs_dir / api.TRASH}",
                                       elem_id="trash-select", scale=3)
            self.restore_btn = gr.Button("Restore", elem_id="restore-run-btn", scale=1)
        self.msg = gr.Markdown("", elem_id="runs-message")
        gr.Markdown("**Compare runs**: one curve, a line per run")
        with gr.Row():
            self.compare = gr.Dropdown(choices=[], multiselect=True, label="Runs", elem_id="compare-runs", scale=3)
            self.curve = gr.Dropdown(choices=list(COMPARABLE), value="train loss", label="Curve",
                                     elem_id="compare-curve", scale=1)
            self.compare_btn = gr.Button("Compare", elem_id="compare-btn", scale=1)
        self.compare_plot = gr.Plot(show_label=False, elem_id="compare-plot", format="png", visible=False)

    def frame(self):
        # newest first by when each run was created (a renamed run keeps its place)
        runs = sorted(api.summaries(self.page.runs_dir), key=lambda s: s.get("created") or float("inf"), reverse=True)
        return panels.runs_frame(runs)

    def choices(self, selected: str = "") -> gr.Dropdown:
        """The run picker, on `selected` (a run folder) when it is listed, else the newest."""
        names = [r.name for r in api.list_runs(self.page.runs_dir)]
        value = Path(selected).name if selected and Path(selected).name in names else (names[0] if names else None)
        return gr.Dropdown(choices=names, value=value)

    @property
    def outputs(self) -> list:
        return [self.table, self.select, self.compare]

    def refresh(self, selected: str = "") -> dict:
        return {self.table: self.frame(), self.select: self.choices(selected),
                self.compare: gr.Dropdown(choices=[r.name for r in api.list_runs(self.page.runs_dir)])}

    def do_open(self, name: str) -> dict:
        p = self.page
        if not name:
            return {p.train_tab.msg: message("Pick a run.", "error")}
        path = str(p.runs_dir / name)
        board = p.runs_dir / name / "tensorboard"
        said = f"Opened **{name}**" + (f" (TensorBoard: `tensorboard --logdir {board}`)." if board.is_dir() else ".")
        return {p.attached: path, p.train_tab.msg: message(said, "ok"),
                p.tabs: gr.Tabs(selected="train"), p.msg_at: p.said(path), **p.fill_from_run(path)}

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
        said = p.said(path)  # before: the run's old end must not take the message away
        try:
            run = p.adopt(api.resume(path, more=n))
        except EdgetuneError as e:
            return {p.train_tab.msg: message(str(e), "error"), p.attached: path, p.msg_at: p.said(path)}
        return {p.train_tab.msg: message(f"Training **{run.name}** {n} more steps.", "ok"), p.attached: path,
                p.tabs: gr.Tabs(selected="train"), p.msg_at: said}

    def do_compare(self, names: list[str] | None, label: str) -> dict:
        names = [n for n in names or [] if (self.page.runs_dir / n / "config.yaml").is_file()]
        if not names:
            return {self.msg: message("Pick the runs to compare.", "error"),
                    self.compare_plot: gr.Plot(visible=False)}
        runs = [(n, list(api.open_run(self.page.runs_dir / n).events())) for n in names]
        return {self.compare_plot: gr.Plot(value=live.compare_figure(runs, label), visible=True), self.msg: ""}

    def after_change(self, selected: str, said: str, ok: bool = True) -> dict:
        return {**self.refresh(selected),
                self.trashed: gr.Dropdown(choices=api.trashed_runs(self.page.runs_dir), value=None),
                self.msg: message(said, "ok" if ok else "error")}

    def do_delete(self, name: str, attached: str) -> dict:
        """The picked run to <runs_dir>/.trash (never one that trains); the page lets go of it."""
        p = self.page
        if not name:
            return {self.msg: message("Pick a run.", "error")}
        try:
            where = api.trash_run(p.runs_dir / name)
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error")}
        out = self.after_change("", f"Moved **{name}** to `{where}`: Restore brings it back.")
        if attached and Path(attached).name == name:
            out[p.attached] = p.default_run()
        return out

    def do_restore(self, name: str) -> dict:
        if not name:
            return {self.msg: message("Pick a run in the trash.", "error")}
        try:
            where = api.restore_run(self.page.runs_dir, name)
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error")}
        return self.after_change(str(where), f"Restored **{where.name}**.")

    def do_rename(self, name: str, new: str, attached: str) -> dict:
        p = self.page
        if not name:
            return {self.msg: message("Pick a run.", "error")}
        try:
            where = api.rename_run(p.runs_dir / name, (new or "").strip())
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error")}
        out = self.after_change(str(where), f"Renamed **{name}** to **{where.name}**.")
        if attached and Path(attached).name == name:
            out[p.attached] = str(where)
        return out

    def wire(self) -> None:
        p = self.page
        changed = [self.table, self.select, self.compare, self.trashed, self.msg, p.attached]
        self.compare_btn.click(self.do_compare, [self.compare, self.curve], [self.compare_plot, self.msg])
        self.delete_btn.click(self.do_delete, [self.select, p.attached], changed)
        self.restore_btn.click(self.do_restore, self.trashed, changed)
        self.rename_btn.click(self.do_rename, [self.select, self.new_name, p.attached], changed)
        self.refresh_btn.click(self.refresh, p.attached, self.outputs)
        self.open_btn.click(self.do_open, self.select, [p.attached, p.train_tab.msg, p.tabs, p.msg_at,
                                                        *p.form_outputs]) \
            .then(p.train_tab.draw, p.train_tab.live_inputs, p.train_tab.live_outputs)
        self.more_btn.click(self.do_more, [self.select, self.more], [p.attached, p.train_tab.msg, p.tabs, p.msg_at]) \
            .then(p.train_tab.draw, p.train_tab.live_inputs, p.train_tab.live_outputs)
