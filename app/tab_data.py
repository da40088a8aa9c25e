"""2 · Data: the data settings, an upload, and the data check (preview, report, lengths)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gradio as gr

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.data.files import DOCUMENT_TYPES

from edgetune.engine.run import api

from . import panels

NOT_CHECKED = "_Press “Check data” to validate the file with the model's tokenizer._"

# The file types the upload offers; app/guard.py refuses any other upload on the server.
# Documents (several at once) are kept together in a folder of their own, data.path's folder.
ROW_TYPES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".gz")
DATA_TYPES = ROW_TYPES + DOCUMENT_TYPES
# The largest upload the server takes (Gradio refuses a bigger one before keeping it); a
# bigger data file is named by its path in data.path instead.
MAX_UPLOAD_BYTES = 2 << 30


def keep_upload(src: Path, folder: Path) -> Path:
    """`src` copied into `folder` as a new file (name, name-2, name-3, ... before the
    suffixes), or the file there that already holds the same bytes."""
    import filecmp

    folder.mkdir(parents=True, exist_ok=True)
    stem, suffix = src.name.split(".", 1) if "." in src.name else (src.name, "")
    suffix = f".{suffix}" if suffix else ""
    n = 1
    while True:
        dest = folder / (f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}")
        if dest.is_file() and not dest.is_symlink() and filecmp.cmp(src, dest, shallow=False):
            return dest
        try:
            fout = open(dest, "xb")  # never over an existing file
        except FileExistsError:
            n += 1
            continue
        try:
            with open(src, "rb") as fin, fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        except BaseException:
            dest.unlink(missing_ok=True)  # ours, half written
            raise
        return dest


def keep_documents(srcs: list[Path], uploads: Path) -> Path:
    """Documents uploaded together, copied into a new folder of `uploads` (documents,
    documents-2, ...): a folder of documents for data.path."""
    uploads.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        folder = uploads / ("documents" if n == 1 else f"documents-{n}")
        try:
            folder.mkdir()  # never into an existing folder
            break
        except FileExistsError:
            n += 1
    for src in srcs:
        keep_upload(src, folder)
    return folder


class DataTab:
    def __init__(self, page):
        self.page = page
        with gr.Row():
            with gr.Column(scale=3):
                page.group_fields("data")
            with gr.Column(scale=1):
                self.upload = gr.File(label=f"Upload a data file ({', '.join(ROW_TYPES)}), or documents "
                                            f"({', '.join(DOCUMENT_TYPES)}), several at once",
                                      file_types=list(DATA_TYPES), file_count="multiple",
                                      type="filepath", elem_id="data-upload")
                self.check_btn = gr.Button("Check data", variant="primary", elem_id="check-data-btn")
        self.report = gr.Markdown(NOT_CHECKED, elem_id="data-report")
        with gr.Row():
            # hidden until a check has rows to show
            self.preview = gr.Dataframe(label="Preview (first rows, or a documents folder's first chunks)",
                                        elem_id="data-preview", wrap=True,
                                        max_height=360, scale=3, interactive=False, visible=False)
            self.hist = gr.Plot(panels.histogram_figure({}), show_label=False, elem_id="data-histogram",
                                scale=2, format="png", visible=False)

    def do_check(self, values: dict) -> dict:
        try:
            cfg = self.page.config(values)
        except EdgetuneError as e:
            return {self.report: f"### ✗ {e}"}
        result = api.check_data(cfg)
        self.page.checked(cfg, result)  # Start refuses what this check refused
        rows = panels.preview_frame(result)
        has_lengths = bool(((result.get("report") or {}).get("histogram") or {}).get("counts"))
        return {self.report: panels.data_report_markdown(result),
                self.preview: gr.Dataframe(value=rows, visible=len(rows) > 0),
                self.hist: gr.Plot(value=panels.histogram_figure(result), visible=has_lengths)}

    def take_upload(self, tmp_paths) -> dict:
        """Keep the uploaded file in the runs folder's uploads (the worker reads it after
        Gradio's temporary copy is gone), under a name of its own: an upload never replaces
        an earlier one, which a run may have trained on (the same bytes again are the same
        file). Documents, or several files, go together into a new folder there."""
        path_box = self.page.fields["data.path"]
        paths = [Path(p) for p in ([tmp_paths] if isinstance(tmp_paths, (str, Path)) else tmp_paths or [])]
        if not paths:
            return {path_box: gr.skip()}
        if len(paths) == 1 and not paths[0].name.lower().endswith(DOCUMENT_TYPES):
            return {path_box: str(keep_upload(paths[0], self.page.uploads))}
        return {path_box: str(keep_documents(paths, self.page.uploads))}

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
        kept = self.upload.upload(self.take_upload, self.upload, [self.page.fields["data.path"]])
        kept.then(self.do_check, self.page.form_inputs, outputs)
        kept.then(self.page.remember, self.page.form_inputs | {self.page.form_memory},
                  [self.page.form_memory, self.page.form_note], show_progress="hidden")
