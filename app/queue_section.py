"""The Train tab's Queue section: the jobs waiting to run one after another (Add to queue
beside Start puts the form's run there), moving one up or down, cancelling one, and the
jobs that ended last. The app's process runs the queue while no other process does
(engine/run/queue.py: `serve`, started by app/main.py); the section is read from the
queue file on every tick of the page's timer, so what `edgetune train --queue` adds shows
too."""

from __future__ import annotations

import time

import gradio as gr
import pandas as pd

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import api, queue

from .page import message

COLUMNS = ["place", "job", "state", "run", "method", "steps", "queued"]
ENDED_SHOWN = 5  # the last jobs that ended, under the table


def frame(jobs: list[dict]) -> pd.DataFrame:
    rows = [{"place": i + 1, "job": j["id"], "state": j.get("state", "queued"), "run": j["folder"],
             "method": j.get("method") or j["kind"], "steps": j.get("steps") or "",
             "queued": time.strftime("%Y-%m-%d %H:%M", time.localtime(j["added"])) if j.get("added") else ""}
            for i, j in enumerate(jobs)]
    return pd.DataFrame(rows, columns=COLUMNS)


def ended_text(ended: list[dict]) -> str:
    if not ended:
        return ""
    lines = [f"- job {h['id']} · **{h['folder']}** {h['status']}" + (f": {h['message']}" if h.get("message")
             and h["status"] not in ("finished", "stopped") else "") for h in reversed(ended[-ENDED_SHOWN:])]
    return "Ended last:\n" + "\n".join(lines)


def label(job: dict) -> str:
    return f"job {job['id']} · {job['folder']}"


class QueueSection:
    def __init__(self, page):
        self.page = page
        with gr.Accordion("Queue: runs that start one after another", open=True, elem_id="queue-section"):
            self.note = gr.Markdown("", elem_id="queue-note")
            self.table = gr.Dataframe(frame([]), interactive=False, elem_id="queue-table", wrap=True)
            with gr.Row():
                # any value: a job picked a moment ago may have started or gone (the handler says so)
                self.pick = gr.Dropdown(choices=[], label="Job", elem_id="queue-pick", scale=3,
                                        allow_custom_value=True)
                self.up_btn = gr.Button("Move up", elem_id="queue-up-btn", scale=1)
                self.down_btn = gr.Button("Move down", elem_id="queue-down-btn", scale=1)
                self.cancel_btn = gr.Button("Cancel the job", variant="stop", elem_id="queue-cancel-btn", scale=1)
            self.msg = gr.Markdown("", elem_id="queue-message")
            self.ended = gr.Markdown("", elem_id="queue-ended")
        self.seen = gr.State("")  # what the section last showed, to send nothing while it is unchanged

    @property
    def section_outputs(self) -> list:
        """What `section` writes."""
        return [self.note, self.table, self.pick, self.ended, self.seen]

    @property
    def outputs(self) -> list:
        """What `refresh` writes."""
        return [*self.section_outputs, self.page.attached]

    def refresh(self, seen: str = "", attached: str = "") -> dict:
        """The section as the queue file has it now ({} when unchanged), the job picked in it
        left as it is; and when the page shows a queued run that ended while the queue runs
        the next, the page follows it."""
        runs_dir = self.page.runs_dir
        try:
            jobs = queue.jobs(runs_dir)
        except EdgetuneError as e:
            return {self.note: message(str(e), "error"), self.seen: str(e)}
        out: dict = {}
        head = jobs[0] if jobs and jobs[0].get("state") == "started" else None
        running = runs_dir / head["folder"] if head else None
        shown = self.page.run_of(attached)
        if running is not None and (running / "config.yaml").is_file() and str(running) != attached and (
                shown is None or (shown.dir.queue_job() and shown.status() not in api.ACTIVE)):
            out[self.page.attached] = str(running)
        section = self.section(keep_pick=True)
        if section.get(self.seen) == seen and not out:
            return {}
        return {**out, **section}

    def section(self, picked: str | None = None, keep_pick: bool = False) -> dict:
        """The note, the table, the job picker (on `picked`, or as it is with `keep_pick`)
        and the jobs that ended, from the queue file."""
        runs_dir = self.page.runs_dir
        try:
            jobs, ended = queue.jobs(runs_dir), queue.history(runs_dir)
        except EdgetuneError as e:
            return {self.note: message(str(e), "error"), self.seen: str(e)}
        driver = queue.driver_pid(runs_dir)
        if not jobs:
            note = "_The queue is empty: **Add to queue** beside Start puts the form's run here._"
        elif driver is None:
            note = "No process runs the queue now; the app starts it within seconds."
        else:
            note = f"{len(jobs)} job{'s' if len(jobs) != 1 else ''} queued; they train one after another" + \
                (f" (run by `edgetune queue run`, pid {driver})." if driver not in (-1, None) and not self.mine(driver)
                 else ".")
        waiting = [queue.waiting_line(runs_dir, j) for j in jobs if not queue.queued_here(j)]
        note += "".join(f"\n\n{line}" for line in waiting)  # (a copied queue's jobs: none starts unconfirmed)
        choices = [label(j) for j in jobs if j.get("state") == "queued"]
        return {self.note: note, self.table: frame(jobs), self.ended: ended_text(ended),
                self.seen: repr((jobs, ended[-ENDED_SHOWN:], driver)),
                self.pick: gr.Dropdown(choices=choices) if keep_pick else
                gr.Dropdown(choices=choices, value=picked if picked in choices else None)}

    @staticmethod
    def mine(pid: int) -> bool:
        import os

        return pid == os.getpid()

    def _job(self, picked: str | None) -> int | None:
        if not picked:
            return None
        try:
            return int(picked.split(" ")[1])
        except (IndexError, ValueError):
            return None

    def act(self, picked: str | None, how: str) -> dict:
        runs_dir = self.page.runs_dir
        job = self._job(picked)
        if job is None:
            return {self.msg: message("Pick a job that has not started.", "error")}
        try:
            if how == "cancel":
                queue.cancel(runs_dir, job)
                said, picked = f"Took job {job} out of the queue.", None
            else:
                now = queue.position(runs_dir, job)
                at = queue.move(runs_dir, job, now + (-1 if how == "up" else 1))
                said = f"Job {job} is now number {at} in the queue."
        except (EdgetuneError, StopIteration) as e:
            return {self.msg: message(str(e) or f"no job {job} in the queue", "error")}
        return {**self.section(picked), self.msg: message(said, "ok")}

    def add(self, values: dict) -> dict:
        """Add to queue: the form's run, kept as the form has it now. The message goes under
        the Train tab's buttons (where Start's goes) and in the section."""
        p = self.page
        said = p.said(values[p.attached])
        try:
            cfg = p.config(values)
            if p.refused(cfg):  # the Data tab's line, before the queue keeps the run
                raise EdgetuneError(p.refused(cfg))
            gpus = values.get(p.train_tab.gpus)
            job = queue.add_run(cfg, gpus=1 if gpus is None else gpus)
        except EdgetuneError as e:
            text = message(str(e), "error")
            return {self.msg: text, p.train_tab.msg: text, p.msg_at: said}
        place = queue.position(p.runs_dir, job["id"])
        text = message(f"Queued run **{job['folder']}** as job {job['id']} (number {place} in the queue, below).",
                       "ok")
        return {**self.section(), self.msg: text, p.train_tab.msg: text, p.msg_at: said}

    def wire(self, add_btn: gr.Button) -> None:
        p = self.page
        changed = [*self.outputs, self.msg]
        add_btn.click(self.add, p.form_inputs | {p.train_tab.gpus, p.attached},
                      [*changed, p.train_tab.msg, p.msg_at])
        for btn, how in ((self.up_btn, "up"), (self.down_btn, "down"), (self.cancel_btn, "cancel")):
            btn.click(lambda picked, how=how: self.act(picked, how), self.pick, changed)

