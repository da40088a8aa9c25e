#!/usr/bin/env python3
"""What an open, idle page costs: `edgetune ui` on a runs folder whose one run has ended,
the page open in Chromium (Playwright, headless), nothing clicked. CPU seconds used by the
app's process and by the browser's processes over a window, after a settling time.

    python bench/idle_page.py --seconds 60 --out OUT     # OUT/idle_page.json

Needs Chromium (/usr/bin/chromium or $EDGETUNE_CHROMIUM) and Playwright.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def cpu_seconds(proc) -> float:
    import psutil

    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main() -> int:
    import psutil
    from playwright.sync_api import sync_playwright

    from edgetune.engine.core.settings import resolve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--settle", type=float, default=15)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="edgetune-idle-"))
    runs = tmp / "runs"
    run = runs / "ended"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(resolve(preset="sft-quickstart").to_yaml())
    t = time.time()
    events = [{"i": 0, "time": t, "type": "started", "method": "sft", "config": {}, "device": "cpu"},
              {"i": 1, "time": t + 1, "type": "step", "step": 1, "total": 1, "loss": 1.0},
              {"i": 2, "time": t + 2, "type": "finished", "step": 1, "adapter": None, "metrics": {}}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", "ui", "--port", str(port), "--runs-dir",
                            str(runs)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp,
                           env=dict(os.environ, GRADIO_ANALYTICS_ENABLED="False"))
    url = f"http://127.0.0.1:{port}/"
    for _ in range(360):
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    me = psutil.Process()
    try:
        with sync_playwright() as pw:
            chromium = os.environ.get("EDGETUNE_CHROMIUM") or "/usr/bin/chromium"
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page()
            page.goto(url)
            page.wait_for_selector("#tabs")
            time.sleep(a.settle)
            app_p = psutil.Process(app.pid)
            browsers = [c for c in me.children(recursive=True) if c.pid != app.pid and "chrom" in c.name().lower()]
            a0, b0 = cpu_seconds(app_p), sum(cpu_seconds(b) for b in browsers)
            time.sleep(a.seconds)
            a1, b1 = cpu_seconds(app_p), sum(cpu_seconds(b) for b in browsers)
            browser.close()
    finally:
        app.terminate()
        app.wait(20)
    result = {"seconds": a.seconds, "app_cpu_s": round(a1 - a0, 2), "browser_cpu_s": round(b1 - b0, 2),
              "app_share_of_a_core": round((a1 - a0) / a.seconds, 3),
              "browser_share_of_a_core": round((b1 - b0) / a.seconds, 3), "load_avg": os.getloadavg()}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "idle_page.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
