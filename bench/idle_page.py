#!/usr/bin/env python3
"""What watching costs: `edgetune ui` with the page open in Chromium (Playwright, headless),
nothing clicked. CPU seconds of the app's process (and its children but the worker), of the
browser's processes and of the training worker, sampled from /proc (as `ps` reads them)
over a window, after a settling time. Phases, one after the other:

  idle          the runs folder's one run has ended; the page open
  blank         the same browser on about:blank (what Chromium costs doing nothing)
  closed        a run training (the quick start, fp32), no page open
  watched       the same run, the page open on its Train tab

    python bench/idle_page.py --seconds 60 --out OUT            # OUT/idle_page.json
    python bench/idle_page.py --tiny --seconds 20 --out OUT     # a tiny random model, CPU, quickly

The closed and watched rows also give the run's mean step time in their window. Needs
Chromium (/usr/bin/chromium or $EDGETUNE_CHROMIUM) and Playwright.
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


def cpu_seconds(proc, skip: set[int] = frozenset()) -> float:
    import psutil

    total = 0.0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        if p.pid in skip:
            continue
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def tiny_model(out: Path) -> str:
    """A 2-layer Llama with the embedded model's tokenizer (what the tests train)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

    tok = load_tokenizer(str(embedded_model_dir()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def step_times(events_path: Path, t0: float, t1: float) -> float | None:
    """Mean seconds between the run's step events written in [t0, t1]."""
    times = []
    for line in events_path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("type") == "step" and t0 <= e.get("time", 0) <= t1:
            times.append(e["time"])
    return round((times[-1] - times[0]) / (len(times) - 1), 2) if len(times) >= 2 else None


def main() -> int:
    import psutil
    from playwright.sync_api import sync_playwright

    from edgetune.engine.core.settings import resolve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--settle", type=float, default=15)
    p.add_argument("--tiny", action="store_true", help="train a tiny random model (seconds a step less)")
    p.add_argument("--idle-only", action="store_true", help="the idle and blank rows only (no run trains)")
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
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    app = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", "ui", "--port", str(port), "--runs-dir",
                            str(runs)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp, env=env)
    url = f"http://127.0.0.1:{port}/"
    for _ in range(360):
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    me, app_p = psutil.Process(), psutil.Process(app.pid)
    rows: dict[str, dict] = {}
    worker_pid: set[int] = set()

    def measure(name: str, browsers: list, worker=None) -> None:
        skip = set(worker_pid)
        a0, b0 = cpu_seconds(app_p, skip), sum(cpu_seconds(b) for b in browsers)
        w0, t0 = (cpu_seconds(worker) if worker else 0.0), time.time()
        time.sleep(a.seconds)
        a1, b1 = cpu_seconds(app_p, skip), sum(cpu_seconds(b) for b in browsers)
        w1, t1 = (cpu_seconds(worker) if worker else 0.0), time.time()
        row = {"app_share_of_a_core": round((a1 - a0) / (t1 - t0), 3),
               "browser_share_of_a_core": round((b1 - b0) / (t1 - t0), 3) if browsers else None,
               "worker_share_of_a_core": round((w1 - w0) / (t1 - t0), 3) if worker else None,
               "load_avg": [round(x, 2) for x in os.getloadavg()]}
        if worker:
            row["step_s"] = step_times(runs / "watched" / "events.jsonl", t0, t1)
        rows[name] = row
        print(name, json.dumps(row), flush=True)

    cli = None
    try:
        with sync_playwright() as pw:
            chromium = os.environ.get("EDGETUNE_CHROMIUM") or "/usr/bin/chromium"
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#tabs")
            time.sleep(a.settle)
            browsers = [c for c in me.children(recursive=True) if c.pid != app.pid and "chrom" in c.name().lower()]
            measure("idle", browsers)
            page.goto("about:blank")
            time.sleep(a.settle)
            measure("blank", browsers)
            if not a.idle_only:
                sets = ["model.quant=none", "sft.steps=100000", "sft.eval_every=0", "sft.samples=0"]
                if a.tiny:
                    sets.append(f"model.name={tiny_model(tmp / 'tiny')}")
                cli = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", "train", "--preset",
                                        "sft-quickstart", "--runs-dir", str(runs), "--name", "watched",
                                        *[x for s in sets for x in ("--set", s)]],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp, env=env)
                events = runs / "watched" / "events.jsonl"
                deadline = time.time() + 900
                while time.time() < deadline and not (events.is_file() and '"type": "step"' in events.read_text()):
                    time.sleep(1)
                worker = psutil.Process(int((runs / "watched" / "worker.pid").read_text()))
                worker_pid.update([worker.pid, *(c.pid for c in worker.children(recursive=True))])
                time.sleep(a.settle)
                measure("closed", browsers, worker)
                page.goto(url)
                page.wait_for_selector("#tabs")
                page.get_by_role("tab", name="4 · Train").click()
                time.sleep(a.settle)
                measure("watched", browsers, worker)
            browser.close()
    finally:
        if cli is not None:
            from edgetune.engine.run import api

            busy = api.active_run(runs)
            if busy is not None:
                busy.kill()
            cli.wait(60)
        app.terminate()
        app.wait(20)
    result = {"seconds": a.seconds, "tiny": a.tiny, "rows": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "idle_page.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
