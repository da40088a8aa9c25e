"""`edgetune ui`: serve the app (binds 127.0.0.1 unless told otherwise).

    python -m edgetune.app.main --port 7860 --runs-dir runs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .ui import CSS, build_app


def launch(host: str = "127.0.0.1", port: int = 7860, runs_dir: str = "runs", block: bool = True):
    import gradio as gr

    demo = build_app(runs_dir)
    try:
        demo.launch(server_name=host, server_port=port, css=CSS, theme=gr.themes.Soft(),
                    # Adapter zips are written into the run folder and downloaded from there.
                    allowed_paths=[str(Path(runs_dir).resolve())], prevent_thread_lock=not block,
                    footer_links=[], quiet=True)
    finally:
        if block:
            demo.edgetune_chat.close()
    return demo


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="edgetune-ui")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--runs-dir", default="runs")
    a = p.parse_args(argv)
    launch(a.host, a.port, a.runs_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
