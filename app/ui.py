"""The page: widgets, their layout, and the handlers that connect them to the engine API.

Everything the page shows about a run is read from the run folder on every timer tick
(events.jsonl, memory.json), so a reloaded page, a second browser tab or a restarted
app re-attaches to the same run and replays its history. The browser holds only which
run it looks at (and a fresh page picks the active run, or else the newest).

This process never imports torch: data checks, training and chat run in subprocesses
started through edgetune.engine.api; the memory planner reads config.json and nvidia-smi
only, so it runs here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import gradio as gr
import psutil

from edgetune.engine import api, phases
from edgetune.engine.errors import EdgetuneError

from . import form, live, panels
from .methods import BY_KEY, BY_LABEL, METHODS, MAX_PLOTS

TICK_SECONDS = 1.0
QUICKSTART = "sft-quickstart"

CSS = """
.et-progress { padding: 10px 12px; border: 1px solid var(--border-color-primary); border-radius: 8px; }
.et-progress-head { display: flex; gap: 8px; align-items: baseline; margin-bottom: 6px; }
.et-progress-values { margin-left: auto; font-family: var(--font-mono); font-size: 0.9em; }
.et-bar { flex: 1; height: 14px; background: var(--background-fill-secondary); border-radius: 7px; overflow: hidden;
          border: 1px solid var(--border-color-primary); }
.et-bar-fill { height: 100%; background: var(--color-accent); transition: width 0.5s; }
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
"""


def _default_run(runs_dir: Path) -> str:
    """The run a fresh page attaches to: the one training, else the newest."""
    active = api.active_run(runs_dir)
    if active is not None:
        return str(active.path)
    runs = api.list_runs(runs_dir)
    return str(runs[0].path) if runs else ""


def _reaper(workers: list, lock: threading.Lock, every: float = 2.0) -> None:
    """Collect the exit status of the workers this app started, so a finished worker
    does not stay behind as a defunct process until the app exits."""
    import time

    while True:
        time.sleep(every)
        with lock:
            workers[:] = [r for r in workers if r.process is not None and r.process.poll() is None]


def _message(text: str, kind: str = "info") -> str:
    mark = {"info": "", "ok": "✓ ", "error": "✗ "}[kind]
    return f"{mark}{text}"


def build_app(runs_dir: str | Path = "runs") -> gr.Blocks:
    runs_dir = Path(runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    uploads = runs_dir / ".uploads"
    specs = form.field_specs()
    chat = api.chat_session(log_path=runs_dir / ".chat-worker.log")
    host_total = psutil.virtual_memory().total
    fields: dict[str, gr.components.Component] = {}
    workers: list = []  # runs this app started: reaped when they end
    workers_lock = threading.Lock()
    threading.Thread(target=_reaper, args=(workers, workers_lock), name="edgetune-reaper", daemon=True).start()

    def adopt(run):
        with workers_lock:
            workers.append(run)
        return run

    def widget(spec: form.FieldSpec, value):
        common = dict(label=spec.name, info=spec.help[:180] or None, elem_id=spec.elem_id,
                      scale=2 if spec.name in ("path", "name") else 1)
        if spec.choices:
            return gr.Dropdown(choices=list(spec.choices), value=value, **common)
        if spec.kind == "bool":
            return gr.Checkbox(value=bool(value), **common)
        if spec.kind == "int":
            return gr.Number(value=value, precision=0, **common)
        if spec.kind == "float":
            return gr.Number(value=value, **common)
        return gr.Textbox(value=value, max_lines=1, **common)

    start_cfg = form.preset_config(QUICKSTART, str(runs_dir))
    start_values = dict(zip([s.key for s in specs], form.values_from_config(start_cfg, specs)))

    def group_fields(group: str, skip=(), basic_cols: int = 4):
        """Basic fields in rows, the rest folded in an 'Advanced' accordion."""
        mine = [s for s in specs if s.group == group and s.name not in skip]
        basic = [s for s in mine if s.basic]
        for i in range(0, len(basic), basic_cols):
            with gr.Row():
                for s in basic[i:i + basic_cols]:
                    fields[s.key] = widget(s, start_values[s.key])
        advanced = [s for s in mine if not s.basic]
        if advanced:
            with gr.Accordion(f"Advanced {group} settings", open=False, elem_id=f"advanced-{group}"):
                for i in range(0, len(advanced), 3):
                    with gr.Row():
                        for s in advanced[i:i + 3]:
                            fields[s.key] = widget(s, start_values[s.key])

    with gr.Blocks(title="edgetune") as demo:
        attached = gr.State("")  # the run folder this page shows
        seen = gr.State({})  # what the page last drew, to skip redrawing unchanged plots
        msg_at = gr.State({})  # the run and status at which the Train tab's message was made

        with gr.Row():
            gr.Markdown("## edgetune · LoRA fine-tuning on one GPU")
            banner = gr.Markdown("", elem_id="run-banner")

        with gr.Tabs(elem_id="tabs") as tabs:
            # ------------------------------------------------------------------ 1 model
            with gr.Tab("1 · Model", id="model", elem_id="tab-model"):
                gr.Markdown("The embedded default is SmolLM2-135M-Instruct (works offline). Or give a local "
                            "Hugging Face folder, a hub id, or a `.gguf` file.")
                group_fields("model", basic_cols=2)
                estimate_btn = gr.Button("Estimate memory", elem_id="estimate-btn")
                estimate_md = gr.Markdown("_Press “Estimate memory” for the predicted peak of these settings "
                                          "(weights, LoRA, optimizer, activations, rollout KV cache)._",
                                          elem_id="estimate")

            # ------------------------------------------------------------------ 2 data
            with gr.Tab("2 · Data", id="data", elem_id="tab-data"):
                with gr.Row():
                    with gr.Column(scale=3):
                        group_fields("data")
                    with gr.Column(scale=1):
                        upload = gr.File(label="Upload a data file (.jsonl, .json, .csv, .parquet)",
                                         file_types=[".jsonl", ".json", ".csv", ".tsv", ".parquet", ".gz"],
                                         type="filepath", elem_id="data-upload")
                        check_btn = gr.Button("Check data", variant="primary", elem_id="check-data-btn")
                data_md = gr.Markdown("_Press “Check data” to validate the file with the model's tokenizer._",
                                      elem_id="data-report")
                with gr.Row():
                    # hidden until a check has rows to show
                    preview = gr.Dataframe(label="Preview (first rows)", elem_id="data-preview", wrap=True,
                                           max_height=360, scale=3, interactive=False, visible=False)
                    hist = gr.Plot(panels.histogram_figure({}), show_label=False, elem_id="data-histogram",
                                   scale=2, format="png", visible=False)

            # ------------------------------------------------------------------ 3 method
            with gr.Tab("3 · Method", id="method", elem_id="tab-method"):
                presets = form.all_presets()
                gr.Markdown("**Presets** fill every field below (and on the Model and Data tabs).")
                with gr.Row():
                    preset_btns = {name: gr.Button(name, size="sm", elem_id=f"preset-{name}")
                                   for name, path in presets.items() if path.parent == form.S.preset_dir()}
                with gr.Row():
                    saved_dd = gr.Dropdown(choices=[n for n, p in presets.items() if p.parent != form.S.preset_dir()],
                                           label="Saved presets", elem_id="saved-presets", scale=2)
                    load_saved_btn = gr.Button("Load saved preset", size="sm", scale=1)
                preset_md = gr.Markdown("", elem_id="preset-info")
                method_radio = gr.Radio([m.label for m in METHODS], value=BY_KEY[start_cfg.method].label,
                                        label="Method", elem_id="method-radio")
                method_cols = {}
                for m in METHODS:
                    with gr.Column(visible=m.key == start_cfg.method, elem_id=f"method-{m.key}") as col:
                        gr.Markdown(f"**{m.label}**: {m.blurb}")
                        group_fields(m.key)
                    method_cols[m.key] = col
                with gr.Accordion("LoRA adapter", open=True):
                    group_fields("lora")
                with gr.Accordion("Run", open=False):
                    group_fields("run")
                with gr.Row():
                    preset_name = gr.Textbox(label="Save these settings as a preset", placeholder="my-preset",
                                             max_lines=1, elem_id="preset-name", scale=3)
                    save_btn = gr.Button("Save preset", elem_id="save-preset-btn", scale=1)

            # ------------------------------------------------------------------ 4 train
            with gr.Tab("4 · Train", id="train", elem_id="tab-train"):
                with gr.Row():
                    start_btn = gr.Button("Start", variant="primary", elem_id="start-btn")
                    stop_btn = gr.Button("Stop (saves the adapter)", variant="stop", elem_id="stop-btn")
                    resume_btn = gr.Button("Resume", elem_id="resume-btn")
                train_msg = gr.Markdown("", elem_id="train-message")
                progress = gr.HTML(live.progress_html([], "none"), elem_id="train-progress")
                with gr.Row():
                    with gr.Column(scale=3):
                        plots = [gr.Plot(label=f"plot {i + 1}", show_label=False, elem_id=f"plot-{i}", visible=i == 0,
                                         format="png")
                                 for i in range(MAX_PLOTS)]
                    with gr.Column(scale=2):
                        gr.Markdown("**Memory** (live, from the worker's memory.json)")
                        memory = gr.HTML(live.memory_html(None, host_total, False), elem_id="memory-panel")
                        samples = gr.Markdown("", elem_id="samples")
                logs = gr.Textbox(label="Recent events (newest first)", lines=12, max_lines=12, autoscroll=False,
                                  elem_id="log-lines", interactive=False)

            # ------------------------------------------------------------------ 5 runs
            with gr.Tab("5 · Runs", id="runs", elem_id="tab-runs"):
                runs_table = gr.Dataframe(panels.runs_frame([]), label=f"Runs in {runs_dir}", interactive=False,
                                          elem_id="runs-table", wrap=True)
                with gr.Row():
                    run_dd = gr.Dropdown(choices=[], label="Run", elem_id="run-select", scale=3)
                    open_btn = gr.Button("Open in the Train tab", elem_id="open-run-btn", scale=1)
                    refresh_btn = gr.Button("Refresh", elem_id="refresh-runs-btn", scale=1)

            # ------------------------------------------------------------------ 6 try it
            with gr.Tab("6 · Try it", id="chat", elem_id="tab-chat"):
                chat_info = gr.Markdown("", elem_id="chat-info")
                with gr.Row():
                    base_chat = gr.Chatbot(label="Base model", height=360, elem_id="chat-base")
                    tuned_chat = gr.Chatbot(label="Base + adapter", height=360, elem_id="chat-tuned")
                with gr.Row():
                    prompt = gr.Textbox(label="Prompt (sent to both)", placeholder="What is 3 plus 4?",
                                        elem_id="chat-prompt", scale=4)
                    max_new = gr.Slider(8, 512, value=96, step=8, label="max new tokens", scale=1,
                                        elem_id="chat-max-new")
                with gr.Row():
                    send_btn = gr.Button("Send to both", variant="primary", elem_id="chat-send")
                    clear_btn = gr.Button("Clear", elem_id="chat-clear")

            # ------------------------------------------------------------------ 7 export
            with gr.Tab("7 · Export", id="export", elem_id="tab-export"):
                export_info = gr.Markdown("", elem_id="export-info")
                with gr.Row():
                    zip_btn = gr.Button("Make adapter .zip", variant="primary", elem_id="export-zip-btn")
                    download = gr.DownloadButton("Download adapter .zip", visible=False, elem_id="download-btn")
                with gr.Row():
                    out_dir = gr.Textbox(label="Or export to a folder on disk", placeholder="/path/to/my-adapter",
                                         elem_id="export-path", scale=3)
                    merged = gr.Checkbox(label="also a merged bf16 model (needs RAM for the full model)",
                                         elem_id="export-merged", scale=1)
                    folder_btn = gr.Button("Export to folder", elem_id="export-folder-btn", scale=1)
                export_msg = gr.Markdown("", elem_id="export-message")

        timer = gr.Timer(TICK_SECONDS)
        field_list = list(fields.values())
        # `fields` was filled in page order; values travel in that order.
        specs_in_order = [next(s for s in specs if s.key == k) for k in fields]

        # -------------------------------------------------------------- helpers

        def current_config(method_label: str, *values):
            return form.config_from_values(BY_LABEL[method_label].key, list(values), specs_in_order, str(runs_dir))

        def fill_from(cfg):
            return [BY_KEY[cfg.method].label] + form.values_from_config(cfg, specs_in_order) + \
                   [gr.Column(visible=m.key == cfg.method) for m in METHODS]

        def run_of(path: str):
            return api.open_run(path) if path and Path(path).is_dir() else None

        def banner_text(path: str) -> str:
            run = run_of(path)
            if run is None:
                return "_No run yet: pick a preset on the Method tab, then Start on the Train tab._"
            return f"Showing run **{run.name}** · {run.status()}"

        def runs_outputs(selected: str = ""):
            runs = api.list_runs(runs_dir)
            names = [r.name for r in runs]
            value = Path(selected).name if selected and Path(selected).name in names else (names[0] if names else None)
            return panels.runs_frame([r.summary() for r in runs]), gr.Dropdown(choices=names, value=value)

        # -------------------------------------------------------------- live view

        def draw(path: str, last: dict, msg: dict):
            """Everything of the Train tab for one run; plots only when events changed."""
            run = run_of(path)
            if run is None:
                return [live.progress_html([], "none")] + [gr.skip()] * MAX_PLOTS + \
                       [live.memory_html(None, host_total, False), gr.skip(), gr.skip(), banner_text(path), last] + \
                       [gr.skip()] * 5
            events = list(run.events())
            status = run.status()
            try:
                mem = json.loads(run.dir.memory_path.read_text())
            except FileNotFoundError:
                mem = None
            except (OSError, ValueError):  # mid-rename on some filesystems: keep the last reading
                mem = last.get("mem")
            memory_panel = live.memory_html(mem, host_total, run.alive())
            key = {"path": path, "n": len(events), "status": status}
            changed = {k: last.get(k) for k in key} != key
            cfg = run.config()
            method = BY_KEY.get(cfg.get("method"), METHODS[0])
            if changed:
                frames = live.plot_frames(events, method)
                plot_updates = [gr.Plot(value=live.plot_figure(frames[i], method.plots[i]), visible=True)
                                if i < len(frames) else gr.Plot(visible=False) for i in range(MAX_PLOTS)]
                log_update = live.log_lines(events)
                samples_update = live.samples_markdown(events) if method.samples else ""
            else:
                plot_updates = [gr.skip()] * MAX_PLOTS
                log_update = samples_update = gr.skip()
            # The runs table follows every event (its step column moves with the run); the
            # Try-it / Export notes follow the run's status (an adapter appears when it stops).
            new_status = status != last.get("status") or path != last.get("path")
            follow = [runs_outputs(path)[0] if changed else gr.skip()]
            follow += [describe_chat(path), describe_export(path)] if new_status else [gr.skip()] * 2
            # A message belongs to the action that made it: it goes when the page shows another
            # run or that run's state moves on (starting -> running is still the same state).
            moved_on = bool(msg) and (msg.get("path") != path or (
                msg.get("status") != status and (msg.get("status"), status) != ("starting", "running")))
            return [live.progress_html(events, status)] + plot_updates + \
                   [memory_panel, log_update, samples_update, f"Showing run **{run.name}** · {status}",
                    {**key, "mem": mem}] + follow + (["", {}] if moved_on else [gr.skip()] * 2)

        live_inputs = [attached, seen, msg_at]
        live_outputs = [progress] + plots + [memory, logs, samples, banner, seen, runs_table, chat_info, export_info,
                                             train_msg, msg_at]

        timer.tick(draw, live_inputs, live_outputs, show_progress="hidden")

        def on_load():
            path = _default_run(runs_dir)
            run = run_of(path)
            filled = [gr.skip()] * (1 + len(field_list) + len(METHODS))
            if run is not None:
                try:
                    cfg = form.S.from_dict(run.config())
                    cfg.run.name = ""  # a new Start from these settings gets a fresh name
                    filled = fill_from(cfg)
                except EdgetuneError:
                    pass
            return [path] + draw(path, {}, {}) + [runs_outputs(path)[1]] + filled

        form_outputs = [method_radio] + field_list + [method_cols[m.key] for m in METHODS]
        demo.load(on_load, None, [attached] + live_outputs + [run_dd] + form_outputs)

        # -------------------------------------------------------------- presets and method

        def apply_preset(name: str):
            try:
                cfg = form.preset_config(name, str(runs_dir))
            except EdgetuneError as e:
                return [gr.skip()] * len(form_outputs) + [_message(str(e), "error"), gr.skip()]
            desc = form.preset_title(form.all_presets()[name])
            return fill_from(cfg) + [_message(f"Loaded preset **{name}**: {desc}", "ok"), estimate_text(cfg)]

        for name, btn in preset_btns.items():
            btn.click(lambda n=name: apply_preset(n), None, form_outputs + [preset_md, estimate_md])
        load_saved_btn.click(lambda n: apply_preset(n) if n else [gr.skip()] * (len(form_outputs) + 2),
                             saved_dd, form_outputs + [preset_md, estimate_md])

        method_radio.change(lambda label: [gr.Column(visible=m.label == label) for m in METHODS],
                            method_radio, [method_cols[m.key] for m in METHODS])

        def save(name, method_label, *values):
            try:
                path = form.save_preset(name, current_config(method_label, *values))
            except EdgetuneError as e:
                return _message(str(e), "error"), gr.skip()
            saved = [n for n, p in form.all_presets().items() if p.parent != form.S.preset_dir()]
            return _message(f"Saved preset to `{path}`", "ok"), gr.Dropdown(choices=saved)

        save_btn.click(save, [preset_name, method_radio] + field_list, [preset_md, saved_dd])

        # -------------------------------------------------------------- model estimate

        def estimate_text(cfg) -> str:
            # The planner reads config.json and asks nvidia-smi: no torch, so it runs here.
            try:
                return panels.estimate_markdown({"ok": True, "estimate": api.estimate(cfg)})
            except ImportError:
                return panels.estimate_markdown({"ok": False, "error": "the memory planner is not installed"})
            except EdgetuneError as e:
                return panels.estimate_markdown({"ok": False, "error": str(e)})

        def do_estimate(method_label, *values):
            try:
                cfg = current_config(method_label, *values)
            except EdgetuneError as e:
                return f"**Settings problem:** {e}"
            return estimate_text(cfg)

        estimate_btn.click(do_estimate, [method_radio] + field_list, estimate_md)

        # -------------------------------------------------------------- data

        def do_check(method_label, *values):
            try:
                cfg = current_config(method_label, *values)
            except EdgetuneError as e:
                return f"### ✗ {e}", gr.skip(), gr.skip()
            result = api.check_data(cfg)
            rows = panels.preview_frame(result)
            has_lengths = bool(((result.get("report") or {}).get("histogram") or {}).get("counts"))
            return (panels.data_report_markdown(result), gr.Dataframe(value=rows, visible=len(rows) > 0),
                    gr.Plot(value=panels.histogram_figure(result), visible=has_lengths))

        check_inputs = [method_radio] + field_list
        check_outputs = [data_md, preview, hist]
        check_btn.click(do_check, check_inputs, check_outputs)

        def take_upload(tmp_path):
            if not tmp_path:
                return gr.skip()
            uploads.mkdir(parents=True, exist_ok=True)
            dest = uploads / Path(tmp_path).name
            shutil.copyfile(tmp_path, dest)  # the worker reads it after Gradio's temp copy is gone
            return str(dest)

        upload.upload(take_upload, upload, fields["data.path"]).then(do_check, check_inputs, check_outputs)

        # -------------------------------------------------------------- train

        def said(path: str):
            """Where a message was made: draw() clears it when that run's state moves on."""
            run = run_of(path)
            return {"path": path, "status": run.status() if run else "none"}

        def do_start(method_label, path, *values):
            try:
                cfg = current_config(method_label, *values)
                run = adopt(api.start(cfg))
            except EdgetuneError as e:
                return _message(str(e), "error"), gr.skip(), said(path)
            return (_message(f"Started run **{run.name}** (folder `{run.path}`)", "ok"), str(run.path),
                    {"path": str(run.path), "status": "starting"})

        def do_stop(path):
            run = run_of(path)
            if run is None or run.status() not in ("running", "starting"):
                return _message("No run is training.", "error"), said(path)
            run.stop()
            return _message(f"Stopping **{run.name}** after the current step; the adapter will be saved."), \
                said(path)

        def do_resume(path):
            run = run_of(path)
            if run is None:
                return _message("Open a run first (Runs tab).", "error"), gr.skip(), said(path)
            last = run.dir.last_checkpoint()
            try:
                run = adopt(api.resume(run.path))
            except EdgetuneError as e:
                return _message(str(e), "error"), gr.skip(), said(path)
            return (_message(phases.resume_words(f"**{run.name}**", last), "ok"), str(run.path),
                    {"path": str(run.path), "status": "starting"})

        start_btn.click(do_start, [method_radio, attached] + field_list, [train_msg, attached, msg_at]) \
            .then(draw, live_inputs, live_outputs).then(runs_outputs, attached, [runs_table, run_dd])
        stop_btn.click(do_stop, attached, [train_msg, msg_at])
        resume_btn.click(do_resume, attached, [train_msg, attached, msg_at]).then(draw, live_inputs, live_outputs)

        # -------------------------------------------------------------- runs

        refresh_btn.click(runs_outputs, attached, [runs_table, run_dd])

        def do_open(name):
            if not name:
                return gr.skip(), _message("Pick a run.", "error"), gr.skip(), gr.skip()
            path = str(runs_dir / name)
            return path, _message(f"Opened **{name}**.", "ok"), gr.Tabs(selected="train"), said(path)

        open_btn.click(do_open, run_dd, [attached, train_msg, tabs, msg_at]).then(draw, live_inputs, live_outputs)

        # -------------------------------------------------------------- try it

        def chat_target(path: str):
            run = run_of(path)
            has = run is not None and (run.dir.adapter / "adapter_config.json").is_file()
            return run, (str(run.dir.adapter) if has else "")

        def describe_chat(path: str) -> str:
            run, adapter = chat_target(path)
            if run is None:
                return "No run open: answers come from the base model of the Model tab only."
            if not adapter:
                return f"Run **{run.name}** has no saved adapter yet: only the base model answers."
            return f"Left: the base of run **{run.name}**; right: the same base with its adapter (`{adapter}`)."

        def do_chat(text, hist_base, hist_tuned, n, path, method_label, *values):
            hist_base, hist_tuned = list(hist_base or []), list(hist_tuned or [])
            if not (text or "").strip():
                return hist_base, hist_tuned, gr.skip(), describe_chat(path)
            run, adapter = chat_target(path)
            try:
                model = (form.S.from_dict(run.config()) if run else current_config(method_label, *values)).model
            except EdgetuneError as e:
                return hist_base, hist_tuned, gr.skip(), _message(str(e), "error")
            import dataclasses

            user = {"role": "user", "content": text}
            # Each side continues its own conversation: the adapter's earlier replies are
            # part of what the adapter answers next.
            hist_base, hist_tuned = panels.chat_messages(hist_base), panels.chat_messages(hist_tuned)
            reply = chat.ask(dataclasses.asdict(model), hist_base + [user], adapter, int(n),
                             tuned_messages=hist_tuned + [user])
            if not reply.get("ok"):
                return hist_base, hist_tuned, gr.skip(), _message(reply.get("error", "chat failed"), "error")
            hist_base += [user, {"role": "assistant", "content": reply["base"]}]
            tuned = reply["tuned"] if reply.get("tuned") is not None else "(no adapter saved yet)"
            hist_tuned += [user, {"role": "assistant", "content": tuned}]
            return hist_base, hist_tuned, "", describe_chat(path)

        send_btn.click(do_chat, [prompt, base_chat, tuned_chat, max_new, attached, method_radio] + field_list,
                       [base_chat, tuned_chat, prompt, chat_info])
        prompt.submit(do_chat, [prompt, base_chat, tuned_chat, max_new, attached, method_radio] + field_list,
                      [base_chat, tuned_chat, prompt, chat_info])
        clear_btn.click(lambda: ([], []), None, [base_chat, tuned_chat])

        # -------------------------------------------------------------- export

        def describe_export(path: str) -> str:
            run = run_of(path)
            if run is None:
                return "No run open."
            s = run.summary()
            if not s["has_adapter"]:
                return f"Run **{run.name}** ({s['status']}) has no adapter yet: stop it or let it finish."
            return f"Run **{run.name}** ({s['status']}): adapter in `{run.dir.adapter}` (PEFT format + model card)."

        def do_zip(path):
            run = run_of(path)
            if run is None:
                return gr.DownloadButton(visible=False), _message("No run open.", "error")
            try:
                out = api.export(run.path, run.path / "exports" / f"{run.name}-adapter.zip", as_zip=True,
                                 force=True)  # replaces only the zip an earlier click made
            except EdgetuneError as e:
                return gr.DownloadButton(visible=False), _message(str(e), "error")
            return gr.DownloadButton(value=str(out), visible=True), _message(f"Adapter zipped: `{out}`", "ok")

        def do_folder(path, out, with_merged):
            run = run_of(path)
            if run is None or not (out or "").strip():
                return _message("Open a run and give a folder.", "error")
            dest = Path(out).expanduser()
            if not with_merged:
                try:
                    api.export(run.path, dest)
                except EdgetuneError as e:
                    return _message(str(e), "error")
                return _message(f"Exported to `{dest}`", "ok")
            # Merging loads the base with torch: the CLI does it in its own process.
            done = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "export", str(run.path), "--out",
                                   str(dest), "--merged"], capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["export failed"])[-1]
                return _message(last.removeprefix("error: "), "error")
            return _message(f"Exported to `{dest}` (the merged bf16 model is in `{dest / 'merged'}`)", "ok")

        zip_btn.click(do_zip, attached, [download, export_msg])
        folder_btn.click(do_folder, [attached, out_dir, merged], export_msg)


    demo.edgetune_chat = chat  # so launch() can stop the chat worker on exit
    return demo
