"""3 · Method: presets, the method and its settings, LoRA and run settings, saving a preset."""

from __future__ import annotations

import gradio as gr

from edgetune.engine.core.config_files import preset_dir
from edgetune.engine.core.errors import EdgetuneError

from . import form
from .methods import BY_KEY, METHODS
from .page import message
from .tab_model import estimate_text


def _saved_presets() -> list[str]:
    return [n for n, p in form.all_presets().items() if p.parent != preset_dir()]


class MethodTab:
    def __init__(self, page):
        self.page = page
        presets = form.all_presets()
        gr.Markdown("**Presets** fill every field below (and on the Model and Data tabs).")
        with gr.Row():
            self.preset_btns = {name: gr.Button(name, size="sm", elem_id=f"preset-{name}")
                                for name, path in presets.items() if path.parent == preset_dir()}
        with gr.Row():
            self.saved = gr.Dropdown(choices=_saved_presets(), label="Saved presets", elem_id="saved-presets",
                                     scale=2)
            self.load_saved_btn = gr.Button("Load saved preset", size="sm", scale=1)
        self.info = gr.Markdown("", elem_id="preset-info")
        page.method_radio = gr.Radio([m.label for m in METHODS], value=BY_KEY[page.start_cfg.method].label,
                                     label="Method", elem_id="method-radio")
        for m in METHODS:
            with gr.Column(visible=m.name == page.start_cfg.method, elem_id=f"method-{m.name}") as col:
                gr.Markdown(f"**{m.label}**: {m.description}")
                page.group_fields(m.name)
            page.method_cols[m.name] = col
        with gr.Accordion("LoRA adapter", open=True):
            page.group_fields("lora")
        with gr.Accordion("Run", open=False):
            page.group_fields("run")
        with gr.Row():
            self.preset_name = gr.Textbox(label="Save these settings as a preset", placeholder="my-preset",
                                          max_lines=1, elem_id="preset-name", scale=3)
            self.save_btn = gr.Button("Save preset", elem_id="save-preset-btn", scale=1)

    def apply_preset(self, name: str) -> dict:
        if not name:
            return {self.info: gr.skip()}
        try:
            cfg = form.preset_config(name, str(self.page.runs_dir))
        except EdgetuneError as e:
            return {self.info: message(str(e), "error")}
        desc = form.preset_title(form.all_presets()[name])
        return {**self.page.fill_from(cfg, f"preset {name}"), self.info: message(f"Loaded preset **{name}**: {desc}", "ok"),
                self.page.model_tab.estimate: estimate_text(cfg)}

    def show_method(self, label: str) -> dict:
        return {col: gr.Column(visible=BY_KEY[key].label == label) for key, col in self.page.method_cols.items()}

    def save(self, values: dict) -> dict:
        try:
            path = form.save_preset(values[self.preset_name], self.page.config(values))
        except EdgetuneError as e:
            return {self.info: message(str(e), "error")}
        return {self.info: message(f"Saved preset to `{path}`", "ok"), self.saved: gr.Dropdown(choices=_saved_presets())}

    def wire(self) -> None:
        page = self.page
        outputs = page.form_outputs + [self.info, page.model_tab.estimate]
        for name, btn in self.preset_btns.items():
            btn.click(lambda n=name: self.apply_preset(n), None, outputs)
        self.load_saved_btn.click(self.apply_preset, self.saved, outputs)
        page.method_radio.change(self.show_method, page.method_radio, list(page.method_cols.values()))
        self.save_btn.click(self.save, page.form_inputs | {self.preset_name}, [self.info, self.saved])
