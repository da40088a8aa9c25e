"""The page: the tabs laid out in order (each tab's widgets and handlers live in its own
module, app/tab_*.py), the header banner, and the timer that keeps the live view current.

Everything the page shows about a run is read from the run folder on every timer tick
(events.jsonl, memory.json), so a reloaded page, a second browser tab or a restarted
app re-attaches to the same run and replays its history. The browser holds only which
run it looks at (and a fresh page picks the active run, or else the newest).

This process never imports torch: data checks, training, chat and merged exports run in
subprocesses started through edgetune.engine.run.api; the memory planner reads config.json
and nvidia-smi only, so it runs here.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from edgetune.engine.run import api

from .page import QUICKSTART, Page, form_note, or_skip
from .tab_chat import ChatTab
from .tab_data import DataTab
from .tab_eval import EvalTab
from .tab_export import ExportTab
from .tab_method import MethodTab
from .tab_model import ModelTab
from .tab_runs import RunsTab
from .tab_serve import ServeTab
from .tab_train import TrainTab

# The live view's timer: every second while the run shown trains; an idle page (a run that
# ended, or none) looks every IDLE_TICK_SECONDS only, for a run started elsewhere (the CLI).
TICK_SECONDS = 1.0
IDLE_TICK_SECONDS = 3.0

CSS = """
.et-progress { padding: 10px 12px; border: 1px solid var(--border-color-primary); border-radius: 8px; }
.et-progress-head { display: flex; gap: 8px; align-items: baseline; margin-bottom: 6px; }
.et-progress-values { margin-left: auto; font-family: var(--font-mono); font-size: 0.9em; }
.et-bar { flex: 1; height: 14px; background: var(--background-fill-secondary); border-radius: 7px; overflow: hidden;
          border: 1px solid var(--border-color-primary); }
.et-bar-fill { height: 100%; background: var(--color-accent); }  /* no transition: nothing moves between updates */
.et-bar-fill.et-finished { background: #16a34a; } .et-bar-fill.et-failed, .et-bar-fill.et-crashed { background: #dc2626; }
.et-bar-fill.et-stopped { background: #d97706; }
.et-progress-text { margin-top: 6px; font-family: var(--font-mono); font-size: 0.9em; }
.et-memory { padding: 8px 10px; border: 1px solid var(--border-color-primary); border-radius: 8px; }
.et-mem-row { display: flex; align-items: center; gap: 8px; margin: 4px 0; }
.et-mem-label { width: 128px; font-size: 0.9em; }
.et-mem-num { width: 150px; text-align: right; font-family: var(--font-mono); font-size: 0.85em; }
.et-mem-note { font-size: 0.85em; color: var(--body-text-color-subdued); margin-top: 4px; }
#run-banner { font-size: 0.95em; }
#samples pre, #samples code { white-space: pre-wrap; word-break: break-word; }
#samples th, #samples td { word-break: normal; overflow-wrap: normal; min-width: 6em; }
.et-setting .info-text { display: -webkit-box; -webkit-line-clamp: 3; -webkit-box-orient: vertical;
                         overflow: hidden; }
.et-setting:hover .info-text, .et-setting:focus-within .info-text { display: block; overflow: visible; }
"""


def fresh_page(page: Page, memory: dict | None = None) -> dict:
    """A page (re)loaded: attach to the active (or newest) run, draw it, and open the Train
    tab while that run trains. The form shows what the browser kept of it (the user's own
    choice, unsubmitted or not), else the settings of the run shown (a new Start from them
    gets a fresh name), and the line above Start says which."""
    path = page.default_run()
    out = {page.attached: path, **page.train_tab.draw(path, {}, {}), **page.train_tab.queue.section(),
           **page.runs_tab.refresh(path)}
    out.update(page.restore(memory) or page.fill_from_run(path)
               or {page.form_note: form_note(f"preset {QUICKSTART}")})
    run = page.run_of(path)
    if run is not None and run.status() in api.ACTIVE:
        out[page.tabs] = gr.Tabs(selected="train")
    return out


def tick(page: Page, attached: str, seen: dict, msg_at: dict, queue_seen: str) -> dict:
    """One tick of the page's timer: the queue section, then the run to show (the page
    follows a run that started anywhere: the queue, the command line, another page, unless
    it shows one that trains), then that run's view (TrainTab.draw: only what changed)."""
    out = page.train_tab.queue.refresh(queue_seen, attached)
    path = out.get(page.attached, attached)
    seen = dict(seen or {})
    before = seen.get("followed")
    if seen.get("path") == path and seen.get("status") in api.ACTIVE:
        seen["followed"] = path  # a run this page has shown training is never followed again
    elif path == attached:
        live = page.live_run()
        if live and live != path and live != seen.get("followed"):
            path = out[page.attached] = live
            seen["followed"] = live
    drawn = page.train_tab.draw(path, seen, msg_at)
    if page.seen in drawn:
        drawn[page.seen]["followed"] = seen.get("followed")
    elif seen.get("followed") != before:
        drawn[page.seen] = seen
    return {**out, **drawn}


def build_app(runs_dir: str | Path = "runs") -> gr.Blocks:
    runs_dir = Path(runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    page = Page(runs_dir)

    with gr.Blocks(title="edgetune") as demo:
        page.attached = gr.State("")  # the run folder this page shows
        page.seen = gr.State({})  # what the page last drew, to skip redrawing unchanged plots
        page.msg_at = gr.State({})  # the run and event count at which the Train tab's message was made
        page.timer = gr.Timer(IDLE_TICK_SECONDS)  # draw() sets its pace from the run's state
        page.tick_seconds = {"active": TICK_SECONDS, "idle": IDLE_TICK_SECONDS}
        # the form as the user left it, kept in the browser's localStorage (Page.remember)
        page.form_memory = gr.BrowserState({}, storage_key="edgetune-form")

        with gr.Row():
            gr.Markdown("## edgetune · LoRA fine-tuning on one GPU")
            page.banner = gr.Markdown("", elem_id="run-banner")

        with gr.Tabs(elem_id="tabs") as page.tabs:
            with gr.Tab("1 · Model", id="model", elem_id="tab-model"):
                page.model_tab = ModelTab(page)
            with gr.Tab("2 · Data", id="data", elem_id="tab-data"):
                page.data_tab = DataTab(page)
            with gr.Tab("3 · Method", id="method", elem_id="tab-method"):
                page.method_tab = MethodTab(page)
            with gr.Tab("4 · Train", id="train", elem_id="tab-train") as train_tab:
                page.train_tab = TrainTab(page)
            with gr.Tab("5 · Runs", id="runs", elem_id="tab-runs"):
                page.runs_tab = RunsTab(page)
            with gr.Tab("6 · Try it", id="chat", elem_id="tab-chat"):
                page.chat_tab = ChatTab(page)
            with gr.Tab("7 · Export", id="export", elem_id="tab-export"):
                page.export_tab = ExportTab(page)
            with gr.Tab("8 · Evaluate", id="evaluate", elem_id="tab-evaluate"):
                page.eval_tab = EvalTab(page)
            with gr.Tab("9 · Serve", id="serve", elem_id="tab-serve"):
                page.serve_tab = ServeTab(page)

        for tab in (page.model_tab, page.data_tab, page.method_tab, page.runs_tab, page.chat_tab, page.export_tab,
                    page.eval_tab, page.serve_tab):
            tab.wire()
        page.train_tab.wire(train_tab)

        train, queue = page.train_tab, page.train_tab.queue
        # one request a tick for the Train tab and its queue section; nothing sent while nothing changed
        page.timer.tick(or_skip(lambda *a: tick(page, *a)), [*train.live_inputs, queue.seen],
                        list(dict.fromkeys([*train.live_outputs, *queue.outputs])), show_progress="hidden")
        # a field the user changes: the form kept in the browser, so that a reload restores it
        gr.on([w.input for w in [page.method_radio, *page.fields.values()]], page.remember,
              page.form_inputs | {page.form_memory}, [page.form_memory, page.form_note], show_progress="hidden")

        demo.load(page.eval_tab.refresh, None, [page.eval_tab.runs])  # the runs to pick, as they are now
        demo.load(lambda memory: fresh_page(page, memory), page.form_memory,
                  list(dict.fromkeys([page.attached, *train.live_outputs, page.runs_tab.select, page.runs_tab.compare,
                                      *queue.section_outputs, *page.form_outputs, page.tabs])))

    demo.edgetune_chat = page.chat  # so launch() can stop the chat worker on exit
    demo.edgetune_serve = page.serve_tab  # and the server this app started
    demo.edgetune_page = page
    return demo
