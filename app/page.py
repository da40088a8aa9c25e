"""What every tab of the page shares: the settings form (one widget per setting, spread
over the Model, Data and Method tabs), the run the page shows, and the engine handles
(the chat worker, the workers this app started).

Handlers take their inputs as a set of components (Gradio then hands them one dict
keyed by component) and return dicts keyed by component, so no handler depends on the
order in which widgets were listed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import gradio as gr
import psutil

from edgetune.engine.core import settings as S
from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import api

from . import form
from .methods import BY_KEY, BY_LABEL

QUICKSTART = "sft-quickstart"


def _as_sent(payload):
    return payload


def or_skip(handler):
    """A handler whose "nothing changed" is an empty dict, as Gradio takes it: Gradio reads
    an empty dict as too few outputs, and a single gr.skip() as no update to any of them."""
    def answer(*args):
        return handler(*args) or gr.skip()
    answer.__name__ = handler.__name__
    return answer


def number_field(**kwargs) -> gr.Number:
    """A number field whose value reaches its handler as it was sent. The handler reads it
    with the engine's own checks (the settings' ranges, settings.typed_number), so a value
    out of range, NaN or text sent to the app's HTTP API is answered with the same one line
    as on the command line, not with an error (and a traceback) of Gradio's. (A subclass
    would do the same, but Gradio writes a stub file beside every module that defines one.)"""
    field = gr.Number(**kwargs)
    field.preprocess = _as_sent
    return field


def slider_field(*args, **kwargs) -> gr.Slider:
    """A slider whose value reaches its handler as it was sent, as number_field's does."""
    field = gr.Slider(*args, **kwargs)
    field.preprocess = _as_sent
    return field


def message(text: str, kind: str = "info") -> str:
    mark = {"info": "", "ok": "✓ ", "error": "✗ "}[kind]
    return f"{mark}{text}"


def form_note(origin: str) -> str:
    """The line above Start saying whose settings the form holds."""
    return f"The form holds **{origin}**: Start and Add to queue make a new run from it."


def _reaper(workers: list, exits: dict, lock: threading.Lock, every: float = 2.0) -> None:
    """Collect the exit status of the workers this app started, so a finished worker
    does not stay behind as a defunct process until the app exits; `exits` keeps it by
    run folder (a crashed run's message names it)."""
    while True:
        time.sleep(every)
        with lock:
            for r in workers:
                if r.process is not None and r.process.poll() is not None:
                    exits[str(r.path)] = r.process.returncode
            workers[:] = [r for r in workers if r.process is not None and r.process.poll() is None]


class Page:
    """Built once per app; the tabs add their widgets to it while the page is laid out."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir
        self.uploads = runs_dir / api.UPLOADS
        self.specs = form.field_specs()
        self.spec_of = {s.key: s for s in self.specs}
        self.chat = api.chat_session(log_path=runs_dir / ".chat-worker.log")
        self.host_total = psutil.virtual_memory().total
        self.start_cfg = form.preset_config(QUICKSTART, str(runs_dir))
        self.start_values = dict(zip([s.key for s in self.specs],
                                     form.values_from_config(self.start_cfg, self.specs)))
        self.fields: dict[str, gr.components.Component] = {}  # setting key -> its widget
        # Settings whose widget offers what this machine has (the model: embedded and cached ones).
        self.suggest = {"model.name": api.known_models}
        self._workers: list = []  # runs this app started: reaped when they end
        self._exits: dict[str, int] = {}  # run folder -> its last worker's exit status, once reaped
        self._workers_lock = threading.Lock()
        self._events: dict[str, tuple] = {}  # run folder -> (events.jsonl's size and time, its events)
        self._events_lock = threading.Lock()
        self._refused: dict[str, str] = {}  # data_key -> the line of the Data tab's check that refused it
        self._reports: dict[str, dict] = {}  # data_key -> the report of the Data tab's check that passed it
        threading.Thread(target=_reaper, args=(self._workers, self._exits, self._workers_lock),
                         name="edgetune-reaper", daemon=True).start()
        # Laid out by ui.build_app and the tabs:
        self.attached = self.seen = self.msg_at = None  # gr.State: run folder shown, last drawing, message origin
        self.timer, self.tick_seconds = None, {}  # the live view's gr.Timer and its paces (ui.py)
        self.banner = self.tabs = self.method_radio = None
        self.form_memory = self.form_note = None  # gr.BrowserState: the form kept in the browser; its origin line
        self.method_cols: dict[str, gr.Column] = {}
        self.model_tab = self.data_tab = self.method_tab = None
        self.train_tab = self.runs_tab = self.chat_tab = self.export_tab = None

    # ------------------------------------------------------------------ settings widgets

    def widget(self, spec: form.FieldSpec, value):
        # the whole help; a long one folded to a few lines until the pointer or the focus is on it (ui.CSS)
        common = dict(label=spec.name, info=spec.help or None, elem_id=spec.elem_id, elem_classes=["et-setting"],
                      scale=2 if spec.name in ("path", "name") else 1)
        if spec.choices:
            return gr.Dropdown(choices=list(spec.choices), value=value, **common)
        if spec.key in self.suggest:  # a list to pick from, and any other value typed in
            options = list(dict.fromkeys([*self.suggest[spec.key](), value]))
            return gr.Dropdown(choices=options, value=value, allow_custom_value=True, **common)
        if spec.kind == "bool":
            return gr.Checkbox(value=bool(value), **common)
        if spec.kind == "int":
            return number_field(value=value, precision=0, **common)
        if spec.kind == "float":
            return number_field(value=value, **common)
        return gr.Textbox(value=value, max_lines=1, **common)

    def group_fields(self, group: str, skip=(), basic_cols: int = 4) -> None:
        """A settings group's basic fields in rows, the rest folded in an 'Advanced' accordion."""
        mine = [s for s in self.specs if s.group == group and s.name not in skip]
        basic = [s for s in mine if s.basic]
        for i in range(0, len(basic), basic_cols):
            with gr.Row():
                for s in basic[i:i + basic_cols]:
                    self.fields[s.key] = self.widget(s, self.start_values[s.key])
        advanced = [s for s in mine if not s.basic]
        if advanced:
            with gr.Accordion(f"Advanced {group} settings", open=False, elem_id=f"advanced-{group}"):
                for i in range(0, len(advanced), 3):
                    with gr.Row():
                        for s in advanced[i:i + 3]:
                            self.fields[s.key] = self.widget(s, self.start_values[s.key])

    @property
    def form_inputs(self) -> set:
        """The method and every setting's widget: a handler given these (as a set) reads
        them with `config()`."""
        return {self.method_radio, *self.fields.values()}

    @property
    def form_outputs(self) -> list:
        """What `fill_from()` writes."""
        return [self.method_radio, *self.fields.values(), *self.method_cols.values(), self.form_memory,
                self.form_note]

    def config(self, values: dict):
        """The form's widget values ({component: value}) -> a validated Config (raises
        ConfigError with a one-line message)."""
        keys = list(self.fields)
        return form.config_from_values(BY_LABEL[values[self.method_radio]].name,
                                       [values[self.fields[k]] for k in keys],
                                       [self.spec_of[k] for k in keys], str(self.runs_dir))

    def fill_from(self, cfg, origin: str = "") -> dict:
        """Every setting's widget (and the method's column) showing `cfg`; with `origin` (a
        preset, a run), the form kept in the browser as that and the line above Start saying so."""
        keys = list(self.fields)
        values = form.values_from_config(cfg, [self.spec_of[k] for k in keys])
        out = {self.method_radio: BY_KEY[cfg.method].label}
        out.update({self.fields[k]: v for k, v in zip(keys, values)})
        out.update({col: gr.Column(visible=key == cfg.method) for key, col in self.method_cols.items()})
        if origin:
            out.update(self.remember(out, origin))
        return out

    # ------------------------------------------------------------------ what the form holds

    def remember(self, values: dict, origin: str | None = None) -> dict:
        """The form as it stands kept in the browser (page.form_memory, its localStorage), with
        where it came from: a reload restores the user's own choice, not a run's. `origin`:
        a preset or run that just filled the form; None: the user changed a field."""
        memory = values.get(self.form_memory) or {}
        if origin is None:
            was = memory.get("origin") or "the form"
            origin = was if was.endswith("changed by you") else f"{was}, changed by you"
        kept = {"method": values[self.method_radio], "origin": origin,
                "values": {k: values[w] for k, w in self.fields.items()}}
        return {self.form_memory: kept, self.form_note: form_note(origin)}

    def restore(self, memory: dict) -> dict:
        """The form as the browser kept it ({} when it kept none that fits this page)."""
        values = (memory or {}).get("values") or {}
        label = (memory or {}).get("method")
        if label not in BY_LABEL or not values:
            return {}
        out = {self.method_radio: label}
        out.update({w: values[k] for k, w in self.fields.items() if k in values})
        out.update({col: gr.Column(visible=BY_LABEL[label].name == key) for key, col in self.method_cols.items()})
        out[self.form_note] = form_note(f"{memory.get('origin') or 'your settings'} (kept across the reload)")
        return out

    def fill_from_run(self, path: str) -> dict:
        """The form showing the settings of the run in `path` (a new Start from them gets a
        fresh name); {} when it has none that read (no run, a damaged config.yaml)."""
        run = self.run_of(path)
        if run is None:
            return {}
        try:
            cfg = S.from_dict(run.config())
        except EdgetuneError:
            return {}
        cfg.run.name = ""
        cfg.run.runs_dir = str(self.runs_dir)
        return self.fill_from(cfg, f"the settings of run {run.name}")

    # ------------------------------------------------------------------ the data check

    def data_key(self, cfg) -> str:
        """What the data check of `cfg` depends on: the method, the data settings, the
        model (its tokenizer), the seed, and the size and time of each file they name."""
        data = cfg.to_dict()["data"]
        files = []
        for value in data.values():
            if isinstance(value, str) and value and not value.startswith("embedded:"):
                try:
                    st = Path(value).expanduser().stat()
                except OSError:
                    continue
                files.append((value, st.st_size, st.st_mtime_ns))
        return repr((cfg.method, data, cfg.model.name, cfg.run.seed, files))

    def checked(self, cfg, result: dict) -> None:
        """The Data tab's check of `cfg`: a refusal is kept, so that Start and Add to queue
        refuse the same data with the same line (refused())."""
        with self._workers_lock:
            if result.get("ok"):
                self._refused.pop(self.data_key(cfg), None)
                self._reports[self.data_key(cfg)] = result.get("report") or {}
            else:
                self._refused[self.data_key(cfg)] = result.get("error") or "unknown problem"
                self._reports.pop(self.data_key(cfg), None)

    def report(self, cfg) -> dict | None:
        """The Data tab's report on this very data (its rows and lengths), None when unchecked."""
        with self._workers_lock:
            return self._reports.get(self.data_key(cfg))

    def refused(self, cfg) -> str:
        """The Data tab's line on this very data ("" when it did not refuse it)."""
        with self._workers_lock:
            why = self._refused.get(self.data_key(cfg))
        return f"This data cannot be used yet (Data tab): {why}" if why else ""

    # ------------------------------------------------------------------ runs

    def adopt(self, run):
        """A run this app started: reaped when its worker ends."""
        with self._workers_lock:
            self._exits.pop(str(run.path), None)
            self._workers.append(run)
        return run

    def death(self, run) -> str:
        """Why a crashed run's worker ended (with its exit status when this app started it)."""
        with self._workers_lock:
            mine = next((r for r in self._workers if str(r.path) == str(run.path)), None)
            code = self._exits.get(str(run.path))
        return mine.death() if mine is not None else run.death(code)

    def run_of(self, path: str):
        return api.open_run(path) if path and Path(path).is_dir() else None

    def events_of(self, run) -> list[dict]:
        """The run's events, read again only when events.jsonl changed (its size and time):
        a timer tick on a run that wrote nothing new parses nothing."""
        try:
            st = run.dir.events_path.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        except OSError:
            return []
        with self._events_lock:
            kept = self._events.get(str(run.path))
        if kept is not None and kept[0] == stamp:
            return kept[1]
        events = list(run.events())
        with self._events_lock:
            self._events[str(run.path)] = (stamp, events)
        return events

    def live_run(self) -> str:
        """The folder of a run whose worker lives (the newest such), "" when none: a run
        started by the queue, the command line or another page (one file read a run)."""
        alive = [r for r in api.list_runs(self.runs_dir) if r.dir.pid_path.exists() and r.alive()]
        return str(alive[0].path) if alive else ""

    def default_run(self) -> str:
        """The run a fresh page attaches to: the one training, else the newest."""
        active = api.active_run(self.runs_dir)
        if active is not None:
            return str(active.path)
        runs = api.list_runs(self.runs_dir)
        return str(runs[0].path) if runs else ""

    def said(self, path: str) -> dict:
        """Where a message was made: the run and how many events it had. The Train tab's
        message stays until the next action, the page showing another run, or that run
        reaching a new end (finished, stopped, failed) after it."""
        run = self.run_of(path)
        events = list(run.events()) if run is not None and run.dir.events_path.is_file() else []
        return {"path": path, "n": events[-1]["i"] + 1 if events else 0}

    def banner_text(self, path: str) -> str:
        run = self.run_of(path)
        if run is None:
            return "_No run yet: pick a preset on the Method tab, then Start on the Train tab._"
        return f"Showing run **{run.name}** · {run.status()}"

