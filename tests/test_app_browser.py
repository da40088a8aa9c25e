"""The app in a real Chromium (Playwright): preset -> start -> a status line per phase that
matches the worker's events -> live progress and memory, elapsed ticking -> the buttons
follow the run's state -> reload lands on the Train tab, re-attached with the history ->
the Runs table follows the run without Refresh -> stop (the stale message goes) -> the
run's curve in the Runs tab's comparison -> download the adapter zip (loaded with PEFT at
the end) and a folder export's zip -> a three-turn chat, the question shown at once, base
and adapter side by side; a malformed data file shows its row number; the run deleted to
the trash and restored. No finished worker stays behind as a defunct process of the app.
The Evaluate tab: the base against a run, as a job that survives a reload and can be stopped.

Trains the embedded SmolLM2-135M (fp32) on the CPU for a few steps (a minute or two).
Screenshots of each stage go to artifacts/screenshots/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-gpu", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
# The run's steps: more than it trains while the page is driven from its start to the Stop
# click (10 to 14 of them measured, the machine idle or loaded), so that the stop lands mid-run.
STEPS = 40


def _chromium() -> str | None:
    for p in (os.environ.get("EDGETUNE_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser"),
              "/usr/bin/chromium"):
        if p and Path(p).exists():
            return p
    return None  # Playwright's own browser, if installed


# A traceback, or an exception's `SomethingError: ...` line, in the app's output
SERVER_ERROR = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(Error|Exception)\b:")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def app_server(tmp_path):
    runs = tmp_path / "runs"
    port = _free_port()
    env = dict(os.environ, EDGETUNE_PRESETS=str(tmp_path / "presets"), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", GRADIO_ANALYTICS_ENABLED="False")
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", "ui", "--port", str(port),
                             "--runs-dir", str(runs)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"the app exited: {(tmp_path / 'app.log').read_text()[-2000:]}")
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the app did not answer within 180 s")
    yield url, runs, proc
    from edgetune.engine.run import api

    busy = api.active_run(runs)
    if busy is not None:
        busy.kill()
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    # What the app's process printed while the page was driven: a handler that breaks
    # shows nothing wrong on the page, only a traceback here.
    broken = [line for line in (tmp_path / "app.log").read_text(errors="replace").splitlines()
              if SERVER_ERROR.search(line)]
    assert not broken, "the app's process printed:\n" + "\n".join(broken[:20])


def _progress(page) -> dict:
    el = page.locator("#train-progress .et-progress")
    return {"step": int(el.get_attribute("data-step") or 0), "status": el.get_attribute("data-status")}


def _wait(cond, timeout: float, what: str, poll: float = 0.5, seen=None):
    """`seen`: what to add to the failure's message (called when the wait timed out)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f"\n{seen()}" if seen else ""))


def _run_said(page, run_dir: Path, events: int = 8, lines: int = 20) -> str:
    """For a wait on a run that timed out: the status the page shows, the run's last events
    (each cut short: `started` holds the whole config) and the end of its worker.log."""
    from edgetune.engine.core.events import read_events

    try:
        shown = _progress(page)
    except Exception as e:  # the page itself may be what broke
        shown = f"unreadable ({type(e).__name__}: {e})"
    try:
        last = [json.dumps(e)[:300] for e in read_events(run_dir / "events.jsonl")[-events:]]
    except OSError as e:
        last = [f"unreadable ({e})"]
    try:
        log = (run_dir / "worker.log").read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        log = [f"unreadable ({e})"]
    return "\n".join([f"the page shows {shown}", f"the last events of {run_dir / 'events.jsonl'}:", *last,
                      f"the end of {run_dir / 'worker.log'}:", *log])


def _preset(page, preset: str, method: str, fields) -> None:
    """On the Method tab: the preset picked, then some of its method's advanced settings set."""
    _tab(page, "3 · Method")
    page.click(f"#preset-{preset}")
    page.wait_for_selector(f"#preset-info:has-text('{preset}')")
    page.locator(f"#advanced-{method}").get_by_text(f"Advanced {method} settings").click()
    for field, value in fields:
        box = page.locator(f"#field-{method}-{field} input")
        box.fill(str(value))
        box.press("Tab")


def _model(page, model_dir=None) -> None:
    """On the Model tab: the model folder (if given) and its weights unquantised (model.quant none)."""
    _tab(page, "1 · Model")
    if model_dir is not None:
        model = page.locator("#field-model-name input")
        model.fill(str(model_dir))
        model.press("Enter")
    page.locator("#field-model-quant input").click()
    page.get_by_role("option", name="none", exact=True).click()
    _wait(lambda: page.locator("#field-model-quant input").input_value() == "none", 30, "model.quant none")


def _enabled(page) -> dict:
    return {name: page.locator(f"#{name}-btn").is_enabled() for name in ("start", "stop", "resume")}


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def test_train_reload_stop_download_and_bad_data(app_server, tmp_path, embedded_dir):
    sync_api = pytest.importorskip("playwright.sync_api")
    import psutil

    from edgetune.engine.core import phases
    from edgetune.engine.core.events import read_events

    url, runs, app_proc = app_server
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")
        # before any run the status says so (it used to say "waiting for the worker")
        _tab(page, "4 · Train")
        assert "no run yet" in page.locator("#train-progress").inner_text()
        assert not page.locator("#data-preview").is_visible()  # nothing to preview before a check

        # -- the quick-start preset fills the form; fewer steps keep the test short
        _tab(page, "3 · Method")
        page.click("#preset-sft-quickstart")
        page.wait_for_selector("#preset-info:has-text('sft-quickstart')")
        # the preset's own values (its sft.steps, lr 1e-3) replaced the defaults (60, 2e-4)
        from edgetune.engine.core.settings import SFTSettings, resolve

        steps = str(resolve(preset="sft-quickstart").sft.steps)
        assert steps != str(SFTSettings().steps)  # else the fill would not show
        _wait(lambda: page.locator("#field-sft-steps input").input_value() == steps, 30, "the preset's steps")
        assert float(page.locator("#field-sft-lr input").input_value()) == 1e-3
        # The CPU is shared in CI: a step's cost follows its rows, so two rows a step and a
        # one-batch eval (its line still shows, as "initial eval 0/1 batches").
        page.locator("#advanced-sft").get_by_text("Advanced sft settings").click()
        # a long setting help is whole, folded to a few lines until the pointer is on it
        from edgetune.app.form import field_specs

        longest = max((s for s in field_specs() if s.group == "sft"), key=lambda s: len(s.help))
        info = page.locator(f"#{longest.elem_id} .info-text")
        assert info.text_content().strip() == longest.help.strip()
        folded = info.evaluate("e => [e.clientHeight, e.scrollHeight]")
        assert folded[0] < folded[1], (longest.key, folded)
        page.locator(f"#{longest.elem_id}").hover()
        page.wait_for_timeout(300)
        assert info.evaluate("e => e.clientHeight") >= folded[1]
        for field, value in (("sft-steps", STEPS), ("sft-eval_every", 8), ("sft-batch_size", 2),
                             ("sft-eval_batches", 1)):
            box = page.locator(f"#field-{field} input")
            box.fill(str(value))
            box.press("Tab")
        page.screenshot(path=str(SHOTS / "01-method-preset.png"), full_page=True)
        # fp32 weights: bitsandbytes' NF4 path costs more CPU (measured single-threaded: a step
        # x1.2, a decoded token x1.7); NF4 training is tested on the tiny model in test_sft
        _model(page)

        # -- start: the progress bar and the memory panel move
        _tab(page, "4 · Train")
        # before Start, the tab says what the run would decide for its `auto` settings
        page.wait_for_selector("#train-decided:has-text('Start would use')")
        assert "device cpu" in page.locator("#train-decided").inner_text()
        # and how long it would take on this machine, phase by phase (it used to say nothing
        # before the first steps): the base's evaluation before training, once, and the final one
        page.wait_for_selector("#train-time:has-text('Time on this machine')", timeout=120_000)
        said_time = page.locator("#train-time").inner_text()
        for phase in ("initial eval", "training", "final eval"):
            assert phase in said_time, said_time
        page.click("#start-btn")
        page.mouse.move(5, 5)  # no hover colour on the buttons in the screenshots
        page.wait_for_selector("#train-message:has-text('Started run')")
        # -- every status line the page shows is one the worker's phase events support
        shown, shots = [], set()

        def phase_line():
            if _progress(page)["status"] == "none":  # the tick that draws the new run is still to come
                return False
            text = page.locator("#train-progress .et-progress").get_attribute("data-phase") or ""
            if text and (not shown or shown[-1] != text):
                shown.append(text)
                key = text.split(" ")[0]
                if key not in shots and _progress(page)["step"] == 0:  # one screenshot per phase
                    shots.add(key)
                    page.screenshot(path=str(SHOTS / f"02-phase-{len(shots)}-{key}.png"), full_page=True)
            return _progress(page)["step"] >= 1

        _wait(phase_line, 420, "the first training step", poll=0.25)
        run_dir = next(p for p in runs.iterdir() if (p / "events.jsonl").is_file())
        said = {phases.describe(e) for e in read_events(run_dir / "events.jsonl") if e["type"] == "phase"}
        allowed = said | {"starting", "starting the worker", "training · first step", "training"}
        assert set(shown) <= allowed, (shown, said)
        assert any(s.startswith(("checking the data", "loading the model", "initial eval")) for s in shown), shown
        _wait(lambda: page.locator("#memory-panel .et-memory").get_attribute("data-time") not in (None, "0"),
              240, "a first memory reading")
        t1 = float(page.locator("#memory-panel .et-memory").get_attribute("data-time"))
        _wait(lambda: float(page.locator("#memory-panel .et-memory").get_attribute("data-time")) > t1, 30,
              "the memory panel to update")
        _wait(lambda: _progress(page)["step"] >= 2, 420, "two training steps")
        first = _progress(page)
        assert first["status"] == "running"
        assert f"/ {STEPS}" in page.locator("#train-progress").inner_text()
        _wait(lambda: _progress(page)["step"] > first["step"], 240, "the progress bar to advance")
        page.wait_for_timeout(1500)  # let the plot redraw
        page.screenshot(path=str(SHOTS / "02-train-running.png"), full_page=True)
        # the README's picture, taken here so that it shows the page as it is: the live view,
        # from the progress bar to the recent events (no temporary folder of the test's in it)
        top, bottom = page.locator("#train-progress").bounding_box(), page.locator("#log-lines").bounding_box()
        page.screenshot(path=str(ROOT / "app" / "screenshot.png"), full_page=True,
                        clip={"x": 0, "y": top["y"] - 12, "width": 1400,
                              "height": bottom["y"] + bottom["height"] - top["y"] + 24})

        # while it trains, Stop is the one button that applies
        _wait(lambda: _enabled(page) == {"start": False, "stop": True, "resume": False}, 30, "buttons of a running run")
        # elapsed moves between steps (it used to freeze until the next step event)
        ticks = set()
        for _ in range(4):
            ticks.add(page.locator("#train-progress .et-progress-text").inner_text().split(" elapsed")[0]
                      .split("· ")[-1])
            page.wait_for_timeout(1100)
        assert len(ticks) >= 2 and "–" not in ticks, ticks

        # -- reload mid-run: the page lands on the run's Train tab, re-attached, with its history
        page.reload()
        page.wait_for_selector("#tabs")
        _wait(lambda: page.locator("#train-progress").is_visible(), 60, "the Train tab after the reload")
        assert page.get_by_role("tab", name="4 · Train").get_attribute("aria-selected") == "true"
        _wait(lambda: _progress(page)["step"] >= first["step"] and _progress(page)["status"] == "running", 60,
              "the re-attached progress")
        logs = _wait(lambda: page.locator("#log-lines textarea").input_value(), 30, "replayed log lines")
        assert "started sft" in logs and "step 1/" in logs
        assert "running" in page.locator("#run-banner").inner_text()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SHOTS / "03-train-after-reload.png"), full_page=True)

        # -- the Runs tab follows the run live (no Refresh click)
        _tab(page, "5 · Runs")

        def table_step() -> int:
            import re

            m = re.search(rf"(\d+)/{STEPS}", page.locator("#runs-table").inner_text())
            return int(m.group(1)) if m else -1

        _wait(lambda: table_step() >= 0, 30, "the run in the table")
        before = table_step()
        _wait(lambda: table_step() > before, 240, "the Runs table to move with the run")
        _tab(page, "4 · Train")

        # -- a second start cannot be clicked while the run trains
        assert _enabled(page)["start"] is False

        # -- stop: the worker finishes its step and saves the adapter
        page.click("#stop-btn")
        page.mouse.move(5, 5)
        page.wait_for_selector("#train-message:has-text('Stopping')")
        _wait(lambda: _progress(page)["status"] == "stopped", 420, "the run to stop",
              seen=lambda: _run_said(page, run_dir))
        stopped_at = _progress(page)["step"]
        # A page slower still may let the run reach its last step before the click: a stop in
        # its final evaluation ends it `stopped` too. Either way the stop is prompt: at most
        # the step under way when it came (the STOP file holds its time) ended after it.
        asked = float((run_dir / "STOP").read_text())
        after = [e["step"] for e in read_events(run_dir / "events.jsonl") if e["type"] == "step" and e["time"] > asked]
        assert len(after) <= 1 and 2 <= stopped_at <= STEPS, (stopped_at, after)
        # the stop's message went when the run reached its end; Resume and Start apply now
        _wait(lambda: page.locator("#train-message").inner_text().strip() == "", 30, "the stale message to go")
        _wait(lambda: _enabled(page) == {"start": True, "stop": False, "resume": True}, 30, "buttons of a stopped run")
        page.screenshot(path=str(SHOTS / "04-train-stopped.png"), full_page=True)

        # -- the Runs tab lists it with its status and final metrics
        _tab(page, "5 · Runs")
        page.click("#refresh-runs-btn")
        _wait(lambda: "stopped" in page.locator("#runs-table").inner_text(), 30, "the stopped run in the table")
        assert "sft" in page.locator("#runs-table").inner_text() and "loss" in page.locator("#runs-table").inner_text()
        # -- its curve, plotted from the Runs tab's comparison
        page.locator("#compare-runs input").click()
        page.get_by_role("option", name=run_dir.name, exact=True).click()
        page.keyboard.press("Escape")
        page.click("#compare-btn")
        page.wait_for_selector("#compare-plot img", timeout=60_000)

        # -- export: download the zip and load it with PEFT on the embedded base
        _tab(page, "7 · Export")
        page.click("#export-zip-btn")
        page.wait_for_selector("#download-btn", state="visible")
        with page.expect_download() as dl:
            page.click("#download-btn")
        zip_path = tmp_path / "adapter.zip"
        dl.value.save_as(zip_path)
        # -- a folder export: "Exporting …" while it runs, then the folder to download as a zip
        page.locator("#export-path input, #export-path textarea").first.fill(str(tmp_path / "exported"))
        page.click("#export-folder-btn")
        page.wait_for_selector("#export-files a", timeout=120_000)
        assert "Exported to" in page.locator("#export-message").inner_text()
        with page.expect_download() as folder_dl:
            page.locator("#export-files a").first.click()
        folder_zip = tmp_path / "exported.zip"
        folder_dl.value.save_as(folder_zip)
        with zipfile.ZipFile(folder_zip) as z:
            assert "exported/adapter_config.json" in z.namelist()
        page.screenshot(path=str(SHOTS / "05-export.png"), full_page=True)

        # -- try it: a three-turn conversation, base and base + adapter side by side (one chat
        # worker process); the second turn used to fail on Gradio 6's history format
        _tab(page, "6 · Try it")
        page.wait_for_selector("#chat-info:has-text('with its adapter')")
        tokens = page.locator("#chat-max-new input[type=number]")
        tokens.fill("4")  # a reply is a reply: short ones keep the CPU's three turns x two sides quick
        tokens.press("Enter")
        for turn, text in enumerate(("What is 3 plus 4?", "And 5 plus 2?", "Thanks! What is 1 plus 1?"), 1):
            page.locator("#chat-prompt textarea").fill(text)
            page.click("#chat-send")
            page.mouse.move(5, 5)
            # the question shows at once on both sides and the box is ready for the next one
            for side in ("#chat-base", "#chat-tuned"):
                _wait(lambda side=side: page.locator(f'{side} [data-testid="user"]').count() >= turn, 10,
                      f"question {turn} in {side}")
            assert page.locator("#chat-prompt textarea").input_value() == ""
            _wait(lambda: "Answering" not in page.locator("#chat-info").inner_text(), 300, f"reply {turn} to end")
            for side in ("#chat-base", "#chat-tuned"):
                bot = page.locator(f'{side} [data-testid="bot"]')
                _wait(lambda bot=bot: bot.count() >= turn or "error" in page.locator("#chat-info").inner_text(),
                      300, f"reply {turn} in {side}")
                assert "error" not in page.locator("#chat-info").inner_text(), page.locator("#chat-info").inner_text()
                assert bot.nth(turn - 1).inner_text().strip() not in ("", "…")
        page.screenshot(path=str(SHOTS / "06-try-it.png"), full_page=True)

        # -- a malformed data file: the report names the row, no traceback
        bad = tmp_path / "broken.jsonl"
        bad.write_text('{"prompt": "1+1?", "completion": "2"}\n{"prompt": "2+2?", "completion": "4"}\n'
                       '{"prompt": "3+3?", "completion": \n')
        _tab(page, "2 · Data")
        page.locator("#data-upload input[type=file]").set_input_files(str(bad))
        page.wait_for_selector("#data-report:has-text('row 3')", timeout=180_000)
        report = page.locator("#data-report").inner_text()
        assert "broken.jsonl" in report and "Traceback" not in report
        page.screenshot(path=str(SHOTS / "07-data-bad-file.png"), full_page=True)

        # -- delete the run to the trash, then restore it
        _tab(page, "5 · Runs")
        page.click("#delete-run-btn")
        page.wait_for_selector("#runs-message:has-text('Moved')")
        assert not run_dir.exists() and (runs / ".trash" / run_dir.name / "adapter").is_dir()
        page.locator("#trash-select input").click()
        page.get_by_role("option", name=run_dir.name, exact=True).click()
        page.click("#restore-run-btn")
        page.wait_for_selector("#runs-message:has-text('Restored')")
        assert (run_dir / "adapter" / "adapter_config.json").is_file()
        assert run_dir.name in page.locator("#runs-table").inner_text()
        browser.close()

    # finished workers are reaped by the app (they used to stay <defunct> until it exited)
    def zombies():
        return [c for c in psutil.Process(app_proc.pid).children(recursive=True)
                if c.status() == psutil.STATUS_ZOMBIE]

    _wait(lambda: not zombies(), 15, "no defunct worker under the app")

    with zipfile.ZipFile(zip_path) as z:
        names = set(z.namelist())
        assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= names
        z.extractall(tmp_path / "adapter")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(embedded_dir)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(float(p.abs().max()) > 0 for p in lora_b), "the downloaded adapter is untrained"


def test_a_dpo_quick_start_runs_from_the_page(app_server):
    """The preference method from the page: its preset fills the DPO fields, Start trains it,
    and the run ends with its preference metrics in the run's events and, in words, in the
    Runs table."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from edgetune.engine.core.events import read_events

    url, runs, _ = app_server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")
        _tab(page, "3 · Method")
        page.click("#preset-dpo-quickstart")
        page.wait_for_selector("#preset-info:has-text('dpo-quickstart')")
        _wait(lambda: page.locator("#field-dpo-loss_type input").input_value() == "sigmoid", 30, "the DPO fields")
        page.locator("#advanced-dpo").get_by_text("Advanced dpo settings").click()
        for field, value in (("dpo-steps", 2), ("dpo-eval_every", 0), ("dpo-batch_size", 2), ("dpo-samples", 0)):
            box = page.locator(f"#field-{field} input")
            box.fill(str(value))
            box.press("Tab")
        _model(page)
        _tab(page, "4 · Train")
        page.click("#start-btn")
        page.wait_for_selector("#train-message:has-text('Started run')")
        _wait(lambda: _progress(page)["status"] == "finished", 600, "the DPO run to finish")
        # its figures in the Runs table named for what they count (a bare "accuracy" beside
        # "prefers chosen" used to contradict itself), as the CLI and the docs name them
        _tab(page, "5 · Runs")
        page.click("#refresh-runs-btn")
        _wait(lambda: "finished" in page.locator("#runs-table").inner_text(), 30, "the finished run in the table")
        table = page.locator("#runs-table").inner_text()
        assert re.search(r"reward accuracy [\d.]+", table) and "reward margin" in table, table
        browser.close()
    run = next(p for p in runs.iterdir() if (p / "events.jsonl").is_file())
    events = read_events(run / "events.jsonl")
    assert next(e for e in events if e["type"] == "started")["method"] == "dpo"
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2] and all("accuracy" in e and "margin" in e for e in steps)
    assert events[-1]["type"] == "finished"


def test_runs_added_to_the_queue_run_one_after_another(app_server, tiny_model_dir):
    """Add to queue, three times, while nothing trains: the Queue section lists the jobs,
    one is cancelled from the page before its turn, and the app runs the other two one
    after another, each to its end (the tiny model, two steps: seconds each)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from edgetune.engine.core.events import read_events

    from edgetune.engine.run import queue

    url, runs, _ = app_server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")
        _preset(page, "sft-quickstart", "sft", (("steps", 2), ("eval_every", 0), ("batch_size", 2), ("samples", 0)))
        _model(page, tiny_model_dir)
        _tab(page, "4 · Train")
        page.wait_for_selector("#queue-note:has-text('The queue is empty')")
        for n in (1, 2, 3):
            page.click("#queue-btn")
            page.wait_for_selector(f"#queue-message:has-text('as job {n}')")
        # the third waits its turn: cancelled from the page before it starts
        page.locator("#queue-pick input").click()
        page.get_by_role("option", name=next(f"job 3 · {j['folder']}" for j in queue.jobs(runs) if j["id"] == 3),
                       exact=True).click()
        page.click("#queue-cancel-btn")
        page.wait_for_selector("#queue-message:has-text('Took job 3 out of the queue')")
        page.wait_for_timeout(2500)  # a tick of the page's timer since: the queue changed under the pick
        page.screenshot(path=str(SHOTS / "09-queue.png"), full_page=True)
        assert page.locator(".toast-body.error").count() == 0  # no Gradio error of a pick the queue changed under
        ended = page.locator("#queue-ended")
        _wait(lambda: ended.inner_text().count("finished") == 2, 300, "both queued runs to finish")
        assert "cancelled" in ended.inner_text()
        page.wait_for_selector("#queue-note:has-text('The queue is empty')")
        assert page.locator(".toast-body.error").count() == 0
        # the page followed the queue to its last run
        _wait(lambda: _progress(page)["status"] == "finished", 60, "the last queued run shown as finished")
        browser.close()
    history = queue.history(runs)
    assert [h["status"] for h in history] == ["cancelled", "finished", "finished"]
    done = [runs / h["folder"] for h in history[1:]]
    assert sorted(r.name for r in runs.iterdir() if (r / "config.yaml").is_file()) == sorted(d.name for d in done)
    # one after another: the second started once the first had ended
    first, second = (read_events(d / "events.jsonl") for d in done)
    assert first[-1]["type"] == second[-1]["type"] == "finished"
    assert first[-1]["time"] <= next(e for e in second if e["type"] == "started")["time"]


def test_the_evaluate_tab_compares_a_run_with_the_base_across_a_reload_and_stops(app_server, tiny_model_dir,
                                                                                tmp_path):
    """The Evaluate tab: the base and a run picked from the runs list, its held-out split (an
    SFT run: the loss) and a task file, run as a job of its own process; a reload finds the
    same job and then its result (the table with intervals, the bar chart, the comparison in
    words, the answers side by side); a second job is stopped; the result stays on disk and
    shows again when picked."""
    sync_api = pytest.importorskip("playwright.sync_api")
    import psutil

    url, runs, app_proc = app_server
    train = subprocess.run(
        [sys.executable, "-m", "edgetune.engine.cli", "train", "--preset", "sft-quickstart", "--runs-dir", str(runs),
         "--name", "tiny", "--set", f"model.name={tiny_model_dir}", "--set", "model.quant=none",
         "--set", "sft.steps=2", "--set", "sft.eval_every=0", "--set", "sft.samples=0", "--set", "sft.lr=0.01",
         "--set", "fgrpo.max_new_tokens=6", "--set", "fgrpo.eval_k=0"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert train.returncode == 0, train.stderr[-2000:]
    sums = tmp_path / "sums.jsonl"
    sums.write_text("".join(f'{{"prompt": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(1, 6)))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")

        def msg() -> str:
            return page.locator("#eval-message").inner_text()

        _tab(page, "8 · Evaluate")
        _wait(lambda: "No evaluation yet" in page.locator("#eval-status").inner_text(), 30, "the tab's first draw")
        page.locator("#eval-runs input").click()
        page.get_by_role("option", name="tiny", exact=True).click()
        page.locator("#eval-files textarea").fill(str(sums))
        page.click("#eval-start-btn")
        _wait(lambda: "Started evaluation" in msg() or "✗" in msg(), 60, "the start's message")
        assert "Started evaluation" in msg(), msg()
        job = page.locator("#eval-status strong").inner_text()
        page.reload()  # the job goes on in its own process; the page finds it again
        page.wait_for_selector("#tabs")
        _tab(page, "8 · Evaluate")
        _wait(lambda: job in page.locator("#eval-status").inner_text(), 30, "the same job after the reload")
        _wait(lambda: "finished" in page.locator("#eval-status").inner_text(), 300, "the evaluation to finish")
        _wait(lambda: "tiny" in page.locator("#eval-table").inner_text(), 30, "the scores table")
        table = page.locator("#eval-table").inner_text()
        for needle in ("held-out", "loss", str(sums), "success_rate", "the base", "tiny", "%"):
            assert needle in table, (needle, table)
        assert page.locator("#eval-plot img").count() == 1
        assert "better than" in page.locator("#eval-words").inner_text() or \
            "no detectable difference" in page.locator("#eval-words").inner_text()
        page.screenshot(path=str(SHOTS / "08-evaluate.png"), full_page=True)
        done = runs / ".evaluations" / job
        result = json.loads((done / "result.json").read_text())
        assert [t["task"] for t in result["tasks"]] == ["held-out", str(sums)]
        shown = page.locator("#eval-diffs").inner_text()
        gen = result["tasks"][1]
        differ = [i for i in range(5) if len({s["answers"][i].strip() for s in gen["systems"]}) > 1]
        for i in differ[:3]:  # the answers where they differ, side by side
            # the table shows an answer's end, its lines joined with " / "
            answer = " / ".join(part.strip() for part in gen["systems"][0]["answers"][i].splitlines() if part.strip())
            assert answer[-20:] in shown, (answer, shown)

        # a second job, on a task of many prompts (minutes, so that it is still running when the
        # Stop comes, however fast the machine), stopped while it runs: it ends without a result
        many = tmp_path / "many.jsonl"
        many.write_text("".join(f'{{"prompt": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(1, 900)))
        page.locator("#eval-files textarea").fill(str(many))
        page.click("#eval-start-btn")
        _wait(lambda: "Started evaluation" in msg() or "✗" in msg(), 60, "the start's message")
        assert "Started evaluation" in msg(), msg()
        second = page.locator("#eval-message strong").inner_text()
        _wait(lambda: second in page.locator("#eval-status").inner_text()
              and "running" in page.locator("#eval-status").inner_text(), 60, "the second job to start")
        page.click("#eval-stop-btn")
        _wait(lambda: "Stopping" in msg(), 30, "the stop's message")
        _wait(lambda: "stopped" in page.locator("#eval-status").inner_text(), 60, "the stop")
        assert not (runs / ".evaluations" / second / "result.json").exists()
        # the first result, picked again from the saved evaluations
        page.locator("#eval-select input").click()
        page.get_by_role("option", name=job, exact=True).click()
        _wait(lambda: "finished" in page.locator("#eval-status").inner_text()
              and "tiny" in page.locator("#eval-table").inner_text(), 30, "the saved result shown again")
        browser.close()
    _wait(lambda: not [c for c in psutil.Process(app_proc.pid).children(recursive=True)
                       if c.status() == psutil.STATUS_ZOMBIE], 15, "no defunct evaluation job under the app")


def test_the_page_follows_the_runs_folder_and_start_refuses_refused_data(app_server, tiny_model_dir, tmp_path):
    """The page shows a stopped run. A data file the Data tab refused: Start answers with the
    check's own line and makes no run folder. A run added to the queue starts: the open page
    shows it within seconds, with Stop the one button that applies, and stops it. A preset picked and then a reload:
    the form is the user's pick, not the newest run's settings, and says so. Screenshots of
    the queue followed without a reload go to artifacts/screenshots/ (app/walkthrough/)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from edgetune.engine.core.settings import resolve

    url, runs, _ = app_server
    old = runs / "old-stopped"
    old.mkdir(parents=True)
    (old / "config.yaml").write_text(resolve(preset="sft-quickstart", overrides=[f"run.runs_dir={runs}"]).to_yaml())
    t0 = time.time() - 600
    (old / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"i": 0, "time": t0, "type": "started", "method": "sft", "config": {}, "device": "cpu"},
        {"i": 1, "time": t0 + 1, "type": "step", "step": 1, "total": 4, "loss": 2.0},
        {"i": 2, "time": t0 + 2, "type": "stopped", "step": 1, "adapter": None, "metrics": {}}]))

    def folders() -> set:
        return {p.name for p in runs.iterdir() if (p / "config.yaml").is_file()}

    def banner() -> str:
        return page.locator("#run-banner").inner_text()

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")
        _wait(lambda: "old-stopped" in banner(), 30, "the stopped run in the banner")
        _tab(page, "4 · Train")
        assert "the settings of run old-stopped" in page.locator("#form-origin").inner_text()

        # -- a file the Data tab refused: Start says the same line and makes no run folder
        bad = tmp_path / "broken.jsonl"
        bad.write_text('{"prompt": "1+1?", "completion": "2"}\n{"prompt": "2+2?", "completion": \n')
        _tab(page, "2 · Data")
        page.locator("#data-upload input[type=file]").set_input_files(str(bad))
        page.wait_for_selector("#data-report:has-text('cannot be used')", timeout=180_000)
        line = page.locator("#data-report strong").first.inner_text().strip()
        _tab(page, "4 · Train")
        page.click("#start-btn")
        page.wait_for_selector("#train-message:has-text('✗')")
        assert line in page.locator("#train-message").inner_text()
        assert folders() == {"old-stopped"}
        page.screenshot(path=str(SHOTS / "10-start-refuses-refused-data.png"), full_page=True)

        # -- a run added to the queue: the open page follows it without a reload
        _preset(page, "sft-quickstart", "sft", (("steps", 2000), ("eval_every", 0), ("batch_size", 2), ("samples", 0)))
        _model(page, tiny_model_dir)
        _tab(page, "4 · Train")
        page.click("#queue-btn")
        page.wait_for_selector("#queue-message:has-text('as job 1')")
        page.mouse.move(5, 5)
        page.screenshot(path=str(SHOTS / "11-queue-1-added.png"), full_page=True)
        # the queue's runner makes the run's folder as it starts the job
        queued = _wait(lambda: next(iter(folders() - {"old-stopped"}), None), 120, "the queued run's folder")
        _wait(lambda: queued in banner() and "running" in banner(), 240, "the page to show the queued run")
        _wait(lambda: _enabled(page) == {"start": False, "stop": True, "resume": False}, 30, "Stop alone")
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SHOTS / "11-queue-2-followed.png"), full_page=True)
        page.click("#stop-btn")
        _wait(lambda: _progress(page)["status"] == "stopped", 240, "the queued run to stop")
        _wait(lambda: _enabled(page) == {"start": True, "stop": False, "resume": True}, 30, "the stopped run's buttons")
        page.screenshot(path=str(SHOTS / "11-queue-3-stopped.png"), full_page=True)

        # -- a preset picked, then a reload: the form is the user's pick, and says so
        _tab(page, "3 · Method")
        page.click("#preset-dpo-quickstart")
        page.wait_for_selector("#preset-info:has-text('dpo-quickstart')")
        _tab(page, "4 · Train")
        _wait(lambda: "preset dpo-quickstart" in page.locator("#form-origin").inner_text(), 30, "the form's origin")
        page.wait_for_timeout(1000)  # the browser keeps the form
        page.reload()
        page.wait_for_selector("#tabs")
        _tab(page, "4 · Train")
        _wait(lambda: "kept across the reload" in page.locator("#form-origin").inner_text(), 30, "the kept form")
        assert "preset dpo-quickstart" in page.locator("#form-origin").inner_text()
        _tab(page, "3 · Method")
        _wait(lambda: page.locator("#method-dpo").is_visible(), 30, "the DPO settings after the reload")
        assert not page.locator("#method-sft").is_visible()
        assert page.locator("#field-dpo-loss_type input").input_value() == "sigmoid"
        browser.close()


def test_the_data_tab_takes_a_folders_documents_and_shows_each_file(app_server, tmp_path):
    """A folder's documents (a PDF, a scanned PDF with no text, a .docx, an HTML page) picked
    together on the Data tab: they are kept together in a new folder of the runs folder's
    uploads, data.path names it, and the report lists each file (the scan named as needing
    OCR) with a preview of the chunks and the file each came from."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from test_documents import uploaded_documents

    url, runs, _ = app_server
    src = uploaded_documents(tmp_path / "manuals")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")
        _tab(page, "2 · Data")
        page.locator("#data-upload input[type=file]").set_input_files(sorted(str(f) for f in src.iterdir()))
        page.wait_for_selector("#data-report:has-text('chunks kept')", timeout=180_000)
        report = page.locator("#data-report").inner_text()
        for needle in ("format documents", "manual.pdf", "guide.docx", "page.html", "scan.pdf", "no text layer"):
            assert needle in report, (needle, report)
        preview = page.locator("#data-preview").inner_text()
        assert "guide.docx" in preview and "Installing the pump" in preview
        page.screenshot(path=str(SHOTS / "02-data-documents.png"), full_page=True)
        kept = runs / ".uploads" / "documents"
        _wait(lambda: page.locator("#field-data-path input, #field-data-path textarea").first.input_value()
              == str(kept), 30, "data.path naming the kept folder")
        browser.close()
    assert sorted(f.name for f in kept.iterdir()) == sorted(f.name for f in src.iterdir())
    assert all((kept / f.name).read_bytes() == f.read_bytes() for f in src.iterdir())


def test_the_serve_tab_serves_the_base_and_a_finished_run_and_stops(app_server, tiny_model_dir):
    """The Serve tab starts `edgetune serve` on the Model tab's base: the page shows the
    endpoint and the models (the base and the runs folder's finished run, by its name), an
    OpenAI client gets a completion from the run's adapter there, a reload finds the same
    server, and Stop ends it."""
    sync_api = pytest.importorskip("playwright.sync_api")
    openai = pytest.importorskip("openai")

    url, runs, _ = app_server
    train = subprocess.run(
        [sys.executable, "-m", "edgetune.engine.cli", "train", "--preset", "sft-quickstart", "--runs-dir", str(runs),
         "--name", "tiny", "--set", f"model.name={tiny_model_dir}", "--set", "model.quant=none",
         "--set", "sft.steps=2", "--set", "sft.eval_every=0", "--set", "sft.samples=0"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert train.returncode == 0, train.stderr[-2000:]
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}/v1"

    def status() -> str:
        return page.locator("#serve-status").inner_text()

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")
        _model(page, tiny_model_dir)
        _tab(page, "9 · Serve")
        _wait(lambda: "Not serving" in status(), 30, "the tab's first draw")
        box = page.locator("#serve-port input")
        box.fill(str(port))
        box.press("Tab")
        page.click("#serve-start-btn")
        _wait(lambda: "Started the server" in page.locator("#serve-message").inner_text()
              or "✗" in page.locator("#serve-message").inner_text(), 60, "the start's message")
        assert "Started the server" in page.locator("#serve-message").inner_text()
        _wait(lambda: "Serving at" in status(), 240, "the server to answer")
        shown = status()
        assert endpoint in shown and "tiny" in shown and str(tiny_model_dir) in shown, shown
        page.screenshot(path=str(SHOTS / "09-serve.png"), full_page=True)
        client = openai.OpenAI(base_url=endpoint, api_key="none")
        assert {m.id for m in client.models.list()} == {str(tiny_model_dir), "tiny"}
        reply = client.completions.create(model="tiny", prompt="1 + 1 =", max_tokens=3, temperature=0)
        assert reply.choices[0].text and 1 <= reply.usage.completion_tokens <= 3
        page.click("#serve-start-btn")  # a second server on the same runs folder: refused in one line
        _wait(lambda: "already serving at" in page.locator("#serve-message").inner_text(), 30, "the refusal")
        page.reload()  # the page finds the running server again
        page.wait_for_selector("#tabs")
        _tab(page, "9 · Serve")
        _wait(lambda: "Serving at" in status() and endpoint in status(), 30, "the server after the reload")
        page.click("#serve-stop-btn")
        _wait(lambda: "Stopped the server" in page.locator("#serve-message").inner_text(), 30, "the stop's message")
        _wait(lambda: "Not serving" in status(), 30, "the stopped server")
        browser.close()
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=endpoint, api_key="none", max_retries=0).models.list()


def test_a_runs_figures_stay_across_stop_resume_stop_in_the_runs_table(app_server, tiny_model_dir):
    """Started, stopped, resumed and stopped again from the page: the Runs table still shows
    the held-out loss before training and the latest one (a stop after a resume used to drop
    them), and the run's own record keeps the first start's figure."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from edgetune.engine.run import api

    url, runs, _ = app_server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#tabs")
        _preset(page, "sft-quickstart", "sft", (("steps", 2000), ("eval_every", 1), ("eval_batches", 1),
                             ("batch_size", 2), ("samples", 0)))
        _model(page, tiny_model_dir)
        _tab(page, "4 · Train")
        page.click("#start-btn")
        page.wait_for_selector("#train-message:has-text('Started run')")
        for attempt in ("first", "resumed"):
            at = _progress(page)["step"] if attempt == "resumed" else 0
            _wait(lambda at=at: _progress(page)["status"] == "running" and _progress(page)["step"] >= at + 2, 300,
                  f"the {attempt} run's steps")
            page.click("#stop-btn")
            _wait(lambda: _progress(page)["status"] == "stopped", 240, f"the {attempt} run to stop")
            if attempt == "first":
                _wait(lambda: _enabled(page)["resume"], 30, "Resume")
                page.click("#resume-btn")
                _wait(lambda: _progress(page)["status"] == "running", 120, "the resumed run",
                      seen=lambda: f"status {_progress(page)['status']}; {page.locator('#train-message').inner_text()}")
        _tab(page, "5 · Runs")
        page.click("#refresh-runs-btn")
        _wait(lambda: "stopped" in page.locator("#runs-table").inner_text(), 30, "the stopped run in the table")
        table = page.locator("#runs-table").inner_text()
        assert re.search(r"eval loss before [\d.]+, .*eval loss [\d.]+", table), table
        browser.close()
    (run,) = api.list_runs(runs)
    metrics = run.summary()["metrics"]
    assert {"eval_loss_start", "eval_loss"} <= set(metrics), metrics
