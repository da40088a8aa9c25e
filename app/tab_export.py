"""7 · Export: the run's adapter as a .zip download, or into a folder on disk (optionally
with a merged bf16 model, or GGUF files for llama.cpp and Ollama with llama.cpp's check),
which the page then offers to download too (the folder as a zip, each GGUF file alone).
Every export goes through the engine API; a merge loads torch and the full base model, so
the API does it in its own process."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import api

from .page import message


class ExportTab:
    def __init__(self, page):
        self.page = page
        self.info = gr.Markdown("", elem_id="export-info")
        with gr.Row():
            self.zip_btn = gr.Button("Make adapter .zip", variant="primary", elem_id="export-zip-btn")
            self.download = gr.DownloadButton("Download adapter .zip", visible=False, elem_id="download-btn")
        with gr.Row():
            self.out_dir = gr.Textbox(label="Or export to a folder on disk", placeholder="/path/to/my-adapter",
                                      elem_id="export-path", scale=3)
            self.merged = gr.Checkbox(label="also a merged bf16 model (needs RAM for the full model)",
                                      elem_id="export-merged", scale=1)
            self.gguf = gr.Checkbox(label="GGUF for llama.cpp / Ollama (with merged: F16 and Q8_0 GGUF)",
                                    elem_id="export-gguf", scale=1)
            self.folder_btn = gr.Button("Export to folder", elem_id="export-folder-btn", scale=1)
        self.msg = gr.Markdown("", elem_id="export-message")
        # A folder export's files to download: the folder as a zip, and each GGUF file alone.
        self.files = gr.File(label="Download this export", file_count="multiple", interactive=False,
                             visible=False, elem_id="export-files")

    def describe(self, path: str) -> str:
        run = self.page.run_of(path)
        if run is None:
            return "No run open."
        s = run.summary()
        if not s["has_adapter"]:
            if s["status"] in api.ACTIVE:
                return f"Run **{run.name}** ({s['status']}) has no adapter yet: stop it or let it finish."
            return (f"Run **{run.name}** ({s['status']}) ended without an adapter: Resume it on the Train tab "
                    "(from its last checkpoint), or open another run in the Runs tab.")
        return f"Run **{run.name}** ({s['status']}): adapter in `{run.dir.adapter}` (PEFT format + model card)."

    def do_zip(self, path: str) -> dict:
        run = self.page.run_of(path)
        if run is None:
            return {self.download: gr.DownloadButton(visible=False), self.msg: message("No run open.", "error")}
        try:
            out = api.export(run.path, run.path / "exports" / f"{run.name}-adapter.zip", as_zip=True,
                             force=True)  # replaces only the zip an earlier click made
        except EdgetuneError as e:
            return {self.download: gr.DownloadButton(visible=False), self.msg: message(str(e), "error")}
        return {self.download: gr.DownloadButton(value=str(out), visible=True),
                self.msg: message(f"Adapter zipped: `{out}`", "ok")}

    def downloads(self, run, dest: Path) -> list[str]:
        """A folder export made downloadable from the run folder (the page serves files from
        the runs folder only): the folder as one zip (stored, not compressed: weights barely
        shrink), and each GGUF file alone, linked where the file system allows."""
        import zipfile

        from edgetune.engine.models.export_gguf import link_or_copy

        where = run.path / "exports"
        where.mkdir(exist_ok=True)
        archive = where / f"{dest.name}.zip"
        tmp = archive.with_name(archive.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
            for f in sorted(dest.rglob("*")):
                if f.is_file() and not f.is_symlink():
                    z.write(f, Path(dest.name) / f.relative_to(dest))
        tmp.replace(archive)
        out = [str(archive)]
        ggufs = sorted((dest / "gguf").glob("*.gguf")) if (dest / "gguf").is_dir() else []
        if ggufs:
            folder = where / f"{dest.name}-gguf"
            folder.mkdir(exist_ok=True)
            for f in ggufs:
                (folder / f.name).unlink(missing_ok=True)  # an earlier export's file of that name
                link_or_copy(f, folder / f.name)
                out.append(str(folder / f.name))
        return out

    def do_folder(self, values: dict) -> dict:
        run = self.page.run_of(values[self.page.attached])
        out, with_merged = values[self.out_dir], bool(values[self.merged])
        as_gguf = bool(values.get(self.gguf))
        hidden = gr.File(value=None, visible=False)
        if run is None or not (out or "").strip():
            return {self.msg: message("Open a run and give a folder.", "error"), self.files: hidden}
        dest = Path(out).expanduser()
        try:
            api.export(run.path, dest, merged=with_merged, isolated=with_merged or as_gguf, gguf=as_gguf)
        except EdgetuneError as e:
            return {self.msg: message(str(e), "error"), self.files: hidden}
        try:
            files = gr.File(value=self.downloads(run, dest), visible=True)
        except OSError as e:  # a full disk: the export stands, its download does not
            files = hidden
            return {self.msg: message(f"Exported to `{dest}`; no download: {e.strerror} ({e.filename})", "error"),
                    self.files: files}
        if as_gguf:  # the GGUF files and the line of llama.cpp's check (gguf/gguf-check.json)
            import json

            from edgetune.engine.models.export_gguf import CHECK_FILE, check_line

            line = check_line(json.loads((dest / "gguf" / CHECK_FILE).read_text()))
            return {self.msg: message(f"Exported to `{dest}` (GGUF files in `{dest / 'gguf'}`). {line}",
                                      "error" if "FAILED" in line else "ok"), self.files: files}
        if with_merged:
            return {self.msg: message(f"Exported to `{dest}` (the merged bf16 model is in `{dest / 'merged'}`)", "ok"),
                    self.files: files}
        return {self.msg: message(f"Exported to `{dest}`", "ok"), self.files: files}

    def busy(self, values: dict) -> dict:
        """What the Export tab says while an export runs (a merge or a GGUF conversion takes
        minutes), in place of the last export's message; the buttons wait for it."""
        what = "the merged model and GGUF files" if values.get(self.merged) and values.get(self.gguf) else \
            "GGUF files" if values.get(self.gguf) else "the merged model" if values.get(self.merged) else "the adapter"
        return {self.msg: message(f"Exporting {what}…"), self.zip_btn: gr.Button(interactive=False),
                self.folder_btn: gr.Button(interactive=False)}

    def idle(self) -> dict:
        return {self.zip_btn: gr.Button(interactive=True), self.folder_btn: gr.Button(interactive=True)}

    def wire(self) -> None:
        p = self.page
        busy = [self.msg, self.zip_btn, self.folder_btn]
        self.zip_btn.click(lambda: self.busy({}), None, busy, show_progress="hidden") \
            .then(self.do_zip, p.attached, [self.download, self.msg]) \
            .then(self.idle, None, [self.zip_btn, self.folder_btn], show_progress="hidden")
        self.folder_btn.click(self.busy, {self.merged, self.gguf}, busy, show_progress="hidden") \
            .then(self.do_folder, {p.attached, self.out_dir, self.merged, self.gguf}, [self.msg, self.files]) \
            .then(self.idle, None, [self.zip_btn, self.folder_btn], show_progress="hidden")
