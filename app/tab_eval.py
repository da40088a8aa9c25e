"""8 · Evaluate: did it help? The base model and runs' adapters graded on the same tasks (the
held-out split, task files, lm-evaluation-harness tasks), as an evaluation job of its own
process (engine/run/eval_jobs.py) whose folder lies beside the runs: the tab follows its
progress, survives a reload (the newest job is shown again), stops it, and shows its result:
a table of scores with 95% intervals, a bar chart with error bars, each comparison in words,
and the answers per item side by side where the systems differ.

The grading settings (model, data, reward, seed) are those of the first run picked, or the
form's when only the base is picked. This process imports no torch: the job does the work.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import pandas as pd

from edgetune.engine.core import settings as S
from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import api, eval_jobs
from edgetune.engine.run.eval_tasks import LARGE_TASK_PROMPTS, task_list

from .page import message, or_skip

SCORE_COLUMNS = ["task", "system", "metric", "score", "95% interval"]
MAX_DIFFERENCES = 100  # items listed where the systems differ (the JSON result has all)
TICK_SECONDS = 1.0  # the timer's pace while a job runs
IDLE_TICK_SECONDS = 5.0  # and while none does: a job started from the command line shows within it


def _fmt(x: float, share: bool) -> str:
    return f"{100 * x:.1f}%" if share else f"{x:.3f}"


def scores_frame(result: dict | None) -> pd.DataFrame:
    """One row a task, system and metric: the score and its 95% interval."""
    rows = []
    for t in (result or {}).get("tasks", []):
        shares = set(t.get("shares", ()))
        for s in t["systems"]:
            for m in t.get("metrics") or list(s["scores"]):
                if m in s["scores"]:
                    x = s["scores"][m]
                    rows.append({"task": t["task"], "system": s["name"], "metric": m,
                                 "score": _fmt(x["estimate"], m in shares),
                                 "95% interval": f"{_fmt(x['low'], m in shares)} to {_fmt(x['high'], m in shares)}"})
    return pd.DataFrame(rows, columns=SCORE_COLUMNS)


def comparisons_text(result: dict | None) -> str:
    lines = []
    for t in (result or {}).get("tasks", []):
        said = [f"- {c['metric']}: {c['words']}" for c in t.get("comparisons", [])]
        if said:
            lines += [f"**{t['task']}** (paired on the same {t.get('unit', 'items')})", *said, ""]
    return "\n".join(lines)


def score_figure(result: dict | None):
    """A bar a system in each task, on the task's first metric, with its 95% interval as
    error bars. Figure objects, not pyplot: handlers run in several threads."""
    from matplotlib.figure import Figure

    tasks = [t for t in (result or {}).get("tasks", []) if t.get("metrics")]
    fig = Figure(figsize=(max(4.0, 3.2 * len(tasks)), 3.2), dpi=100, layout="constrained")
    for k, t in enumerate(tasks or [None], start=1):
        ax = fig.add_subplot(1, max(1, len(tasks)), k)
        if t is None:
            ax.text(0.5, 0.5, "no result yet", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_axis_off()
            break
        m = t["metrics"][0]
        scale = 100.0 if m in set(t.get("shares", ())) else 1.0
        names = [s["name"] for s in t["systems"]]
        est = [scale * s["scores"][m]["estimate"] for s in t["systems"]]
        err = [[e - scale * s["scores"][m]["low"] for e, s in zip(est, t["systems"])],
               [scale * s["scores"][m]["high"] - e for e, s in zip(est, t["systems"])]]
        ax.bar(range(len(names)), est, yerr=err, capsize=6, color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), [n if len(n) <= 14 else n[:13] + "…" for n in names], fontsize=8)
        ax.set_title(f"{_short(t['task'])}: {m}", fontsize=10)
        ax.set_ylabel(f"{m} (%)" if scale == 100.0 else m)
        ax.grid(axis="y", alpha=0.3)
    return fig


def _short(task: str) -> str:
    """A task as a chart's title: a file's name without its folder."""
    return task if task.startswith("lm:") or "/" not in task else Path(task).name


def _tail(text: str, n: int = 80) -> str:
    text = " / ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return text if len(text) <= n else "…" + text[-(n - 1):]


def differences_frame(result: dict | None) -> pd.DataFrame:
    """The items on which the systems' outcomes (the task's first metric) or answers differ:
    the prompt (its end), the reference, and each system's answer with its outcome."""
    rows, names = [], []
    for t in (result or {}).get("tasks", []):
        items, systems = t.get("items") or [], t["systems"]
        if not items or not all(s.get("answers") for s in systems) or len(systems) < 2:
            continue
        m = t["metrics"][0]
        names += [s["name"] for s in systems if s["name"] not in names]
        for i, item in enumerate(items):
            outcomes = [s["per_prompt"][m][i] for s in systems]
            answers = [str(s["answers"][i]).strip() for s in systems]
            if len(set(outcomes)) == 1 and len(set(answers)) == 1:
                continue
            row = {"task": t["task"], "item": i + 1, "prompt": _tail(item["prompt"]), "reference": item["reference"]}
            for s, o, a in zip(systems, outcomes, answers):
                mark = ("✓ " if o == 1 else "✗ ") if o in (0, 1) else f"{o:.3g} "
                row[s["name"]] = mark + _tail(a, 120)
            rows.append(row)
            if len(rows) >= MAX_DIFFERENCES:
                break
    return pd.DataFrame(rows, columns=["task", "item", "prompt", "reference", *names])


def progress_text(job) -> str:
    if job is None:
        return "No evaluation yet: pick the systems and tasks, then Start."
    status, p = job.status(), job.progress()
    head = f"Evaluation **{job.name}** · {status}"
    if status == "running":
        if not p:
            return head + " · starting"
        if p.get("loading"):
            return head + " · loading the model"
        return (head + f" · {p['system']} ({p['index'] + 1}/{p['systems']}) · {p['task']}: "
                f"{p['done']}/{p['total']}")
    if status == "failed":
        return head + " · " + message(job.error(), "error")
    if status == "crashed":
        return head + f" · its process ended without a result (see `{job.path / 'worker.log'}`)"
    return head


class EvalTab:
    def __init__(self, page):
        self.page = page
        gr.Markdown("Grade the base and runs' adapters on the same tasks: each score with its 95% interval, "
                    "each adapter against the base and the others with a paired test. The settings (model, "
                    "data, reward, seed) are the first run's, or the form's when only the base is picked.")
        with gr.Row():
            self.base = gr.Checkbox(value=True, label="the base model (adapter off)", elem_id="eval-base", scale=1)
            self.runs = gr.Dropdown(choices=[], multiselect=True, label="Runs (their adapters)",
                                    elem_id="eval-runs", scale=3)
            self.refresh_btn = gr.Button("Refresh", elem_id="eval-refresh-btn", scale=1)
        with gr.Row():
            self.held_out = gr.Checkbox(value=True, label="held-out split (SFT: its loss; with a reward: graded "
                                                          "completions)", elem_id="eval-held-out", scale=1)
            self.files = gr.Textbox(label="Task files, one path a line (JSONL/CSV/Parquet: prompt + answer, or "
                                          "chat rows)", lines=2, elem_id="eval-files", scale=2)
            self.harness = gr.Textbox(label="Harness tasks (lm-evaluation-harness: names, task YAML files or "
                                            "folders; comma-separated)", elem_id="eval-harness", scale=2)
        with gr.Row():
            self.long_ok = gr.Checkbox(value=False, label=f"Start a long evaluation (a task file of more than "
                                                          f"{LARGE_TASK_PROMPTS:,} prompts: Start says its size first)",
                                       elem_id="eval-long-ok")
            self.start_btn = gr.Button("Start the evaluation", variant="primary", elem_id="eval-start-btn")
            self.stop_btn = gr.Button("Stop", variant="stop", elem_id="eval-stop-btn")
        self.msg = gr.Markdown("", elem_id="eval-message")
        self.status = gr.Markdown("", elem_id="eval-status")
        self.select = gr.Dropdown(choices=[], label="Evaluations (saved beside the runs)", elem_id="eval-select")
        self.table = gr.Dataframe(pd.DataFrame(columns=SCORE_COLUMNS), label="Scores", interactive=False,
                                  elem_id="eval-table", wrap=True)
        self.plot = gr.Plot(show_label=False, elem_id="eval-plot", format="png")
        self.words = gr.Markdown("", elem_id="eval-words")
        self.diffs = gr.Dataframe(pd.DataFrame(), label="Answers where the systems differ", interactive=False,
                                  elem_id="eval-diffs", wrap=True, visible=False)
        self.shown = gr.State("")  # the job folder the tab shows ("" = the newest)
        self.drawn = gr.State("")  # what the tab last drew (its progress line, job and status)
        self.timer = gr.Timer(IDLE_TICK_SECONDS)

    def job_of(self, shown: str):
        if shown and (Path(shown) / "request.json").is_file():
            return eval_jobs.EvalJob(shown)
        jobs = eval_jobs.list_evals(self.page.runs_dir)
        return jobs[0] if jobs else None

    def draw(self, shown: str, drawn) -> dict:
        """The progress line when it changed; the result panels when the job or its status
        changed; the tab's timer every TICK_SECONDS while a job runs, IDLE_TICK_SECONDS
        otherwise. {} when nothing changed: nothing goes to the browser."""
        drawn = drawn if isinstance(drawn, dict) else {}  # "": draw everything again
        job = self.job_of(shown)
        status = job.status() if job is not None else ""
        now = {**drawn, "text": progress_text(job), "key": f"{job.path}:{status}" if job is not None else "",
               "running": status == "running"}
        out = {}
        if now["text"] != drawn.get("text"):
            out[self.status] = now["text"]
        if now["key"] != drawn.get("key") or "key" not in drawn:
            result = job.result() if job is not None else None
            names = [j.name for j in eval_jobs.list_evals(self.page.runs_dir)]
            diffs = differences_frame(result)
            out.update({self.table: scores_frame(result), self.plot: score_figure(result),
                        self.words: comparisons_text(result),
                        # hidden where there is none to list (a loss-only task has no answers)
                        self.diffs: gr.Dataframe(value=diffs, visible=len(diffs) > 0),
                        self.select: gr.Dropdown(choices=names, value=job.name if job is not None else None)})
        if now["running"] != drawn.get("running"):
            out[self.timer] = gr.Timer(value=TICK_SECONDS if now["running"] else IDLE_TICK_SECONDS)
        if now != drawn:
            out[self.drawn] = now
        return out

    def refresh(self) -> dict:
        return {self.runs: gr.Dropdown(choices=[r.name for r in api.list_runs(self.page.runs_dir)])}

    def do_start(self, values: dict) -> dict:
        p = self.page
        names = [n for n in values[self.runs] or [] if (p.runs_dir / n / "config.yaml").is_file()]
        try:
            cfg = S.load_run_config(p.runs_dir / names[0] / "config.yaml") if names else p.config(values)
            tasks = task_list(values[self.held_out], (values[self.files] or "").splitlines(),
                              (values[self.harness] or "").split(","))
            job = p.adopt(eval_jobs.start(cfg, values[self.base], [(n, str(p.runs_dir / n)) for n in names], tasks,
                                          p.runs_dir, run=p.runs_dir / names[0] if names else None,
                                          long_ok=bool(values.get(self.long_ok))))
            # (reaped when it ends, as the runs' workers are)
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error")}
        return {self.msg: message(f"Started evaluation **{job.name}**.", "ok"), self.shown: str(job.path),
                self.drawn: ""}

    def do_stop(self, shown: str) -> dict:
        job = self.job_of(shown)
        if job is None or job.status() != "running":
            return {self.msg: message("No evaluation is running.", "error")}
        job.stop()
        return {self.msg: message(f"Stopping **{job.name}**.", "ok")}

    def do_select(self, name: str) -> dict:
        path = eval_jobs.evals_dir(self.page.runs_dir) / (name or "")
        return {self.shown: str(path) if name and path.is_dir() else "", self.drawn: ""}

    def wire(self) -> None:
        p = self.page
        shown = [self.shown, self.drawn]
        drawn = [self.status, self.drawn, self.table, self.plot, self.words, self.diffs, self.select, self.timer]
        self.timer.tick(or_skip(self.draw), shown, drawn, show_progress="hidden")
        self.refresh_btn.click(self.refresh, None, [self.runs])
        inputs = {self.base, self.runs, self.held_out, self.files, self.harness, self.long_ok} | p.form_inputs
        self.start_btn.click(self.do_start, inputs, [self.msg, self.shown, self.drawn]) \
            .then(or_skip(self.draw), shown, drawn)
        self.stop_btn.click(self.do_stop, self.shown, [self.msg])
        self.select.input(self.do_select, self.select, [self.shown, self.drawn]).then(or_skip(self.draw), shown, drawn)
