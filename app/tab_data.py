"""2 · Data: the data settings, an upload, and the data check (preview, report, lengths)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gradio as gr

from edgetune.engine.run import api
from edgetune.engine.core.errors import EdgetuneError

from . import panels

NOT_CHECKED = "_Press “Check data” to validate the file with the model's tokenizer._"

# The file types the upload offers; app/guard.py refuses any other upload on the server.
DATA_TYPES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".gz")


class DataTab:
    def __init__(self, page):
        self.page = page
        with gr.Row():
            with gr.Column(scale=3):
                page.group_fields("data")
            with gr.Column(scale=1):
                self.upload = gr.File(label=f"Upload a data file ({', '.join(DATA_TYPES)})",
                                      file_types=list(DATA_TYPES),
                                      type="filepath", elem_id="data-upload")
                self.check_btn = gr.Button("Check data", variant="primary", elem_id="check-data-btn")
        self.report = gr.Markdown(NOT_CHECKED, elem_id="data-report")
        with gr.Row():
            # hidden until a check has rows to show
            self.preview = gr.Dataframe(label="Preview (first rows)", elem_id="data-preview", wrap=True,
                                        max_height=360, scale=3, interactive=False, visible=False)
            self.hist = gr.Plot(panels.histogram_figure({}), show_label=False, elem_id="data-histogram",
                                scale=2, format="png", visible=False)

    def do_check(self, values: dict) -> dict:
        try:
            cfg = self.page.config(values)
        except EdgetuneError as e:
            return {self.report: f"### ✗ {e}"}
        result = api.check_data(cfg)
        rows = panels.preview_frame(result)
        has_lengths = bool(((result.get("report") or {}).get("histogram") or {}).get("counts"))
        return {self.report: panels.data_report_markdown(result),
                self.preview: gr.Dataframe(value=rows, visible=len(rows) > 0),
                self.hist: gr.Plot(value=panels.histogram_figure(result), visible=has_lengths)}

    def take_upload(self, tmp_path) -> dict:
        path_box = self.page.fields["data.path"]
        if not tmp_path:
            return {path_box: gr.skip()}
        self.page.uploads.mkdir(parents=True, exist_ok=True)
        dest = self.page.uploads / Path(tmp_path).name
        shutil.copyfile(tmp_path, dest)  # the worker reads it after Gradio's temp copy is gone
        return {path_box: str(dest)}

    def drop_upload(self, path: str) -> dict:
        """The upload cleared: data.path no longer names its copy, and its report goes."""
        path_box = self.page.fields["data.path"]
        gone = bool(path) and Path(path).parent == self.page.uploads
        return {path_box: "" if gone else gr.skip(),
                self.report: "_The uploaded file was removed: give data.path or upload a file._" if gone else
                gr.skip(),
                self.preview: gr.Dataframe(visible=False) if gone else gr.skip(),
                self.hist: gr.Plot(visible=False) if gone else gr.skip()}

    def wire(self) -> None:
        outputs = [self.report, self.preview, self.hist]
        path_box = self.page.fields["data.path"]
        self.upload.clear(self.drop_upload, path_box, [path_box, *outputs])
        self.check_btn.click(self.do_check, self.page.form_inputs, outputs)
        self.upload.upload(self.take_upload, self.upload, [self.page.fields["data.path"]]) \
            .then(self.do_check, self.page.form_inputs, outputs)
