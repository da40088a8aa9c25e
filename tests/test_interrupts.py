"""Ctrl-C ends every long command that is not a run (export, data, estimate, eval, ui) in
one line, at whatever point it arrives, and leaves nothing half written; a second Ctrl-C
while the first is being handled ends the process at once. (A run's own Ctrl-C, a graceful
stop then a kill, is tests/test_cli.py's.)"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save
from test_export_gguf import embedded_run  # noqa: F401  (a fixture: a run on the embedded GGUF model)

HOOKS = os.path.join(os.path.dirname(__file__), "helpers", "fault_hooks")


def _start(*args, env=None, cwd=None):
    # A terminal's Ctrl-C reaches a command whose SIGINT is at its default; under a shell's
    # background job SIGINT is inherited as ignored: reset it in the child.
    return subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=cwd,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(cond, proc, timeout=240, what="the command to get there"):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def _interrupt(proc, timeout=120) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # a command that did not end at Ctrl-C: not left behind by a failing test
        proc.communicate()
        raise
    return proc.returncode, out, err


@pytest.fixture
def run_with_adapter(tmp_path):
    run = tmp_path / "runs" / "r"
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text("method: sft\n")
    (run / "events.jsonl").write_text("")
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    weights = {"base_model.model.q_proj.lora_B.weight": np.ones((4, 2), np.float32)}
    (run / "adapter" / "adapter_model.safetensors").write_bytes(save(weights))
    return run


def _left_beside(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name != "runs")


def test_ctrl_c_during_an_export_is_one_line_and_leaves_nothing(run_with_adapter, tmp_path):
    marker, out = tmp_path / "copying", tmp_path / "exp"
    proc = _start("export", str(run_with_adapter), "--out", str(out),
                  env={"PYTHONPATH": HOOKS, "EDGETUNE_FAULT": "copy:1", "EDGETUNE_FAULT_MARKER": str(marker)})
    _wait_for(marker.exists, proc, what="the export's first file copy")
    assert any(p.name.startswith(".edgetune-tmp-") for p in tmp_path.iterdir())  # half written, here
    rc, _, err = _interrupt(proc)
    assert rc == 130
    assert err == f"interrupted: nothing was exported to {out} (what the export had written so far is removed)\n"
    assert _left_beside(out) == ["copying"]  # no export, no temporary folder


def test_a_second_ctrl_c_while_the_first_is_handled_ends_the_export_at_once(run_with_adapter, tmp_path):
    marker, held, out = tmp_path / "copying", tmp_path / "held", tmp_path / "exp"
    proc = _start("export", str(run_with_adapter), "--out", str(out),
                  env={"PYTHONPATH": HOOKS, "EDGETUNE_FAULT": "copy:1", "EDGETUNE_FAULT_MARKER": str(marker),
                       "EDGETUNE_FAULT_HOLD": str(held)})
    _wait_for(marker.exists, proc, what="the export's first file copy")
    proc.send_signal(signal.SIGINT)
    _wait_for(held.exists, proc, what="the first Ctrl-C to be held")
    t0 = time.time()
    rc, _, err = _interrupt(proc, timeout=30)
    assert rc == -signal.SIGINT and time.time() - t0 < 10 and "Traceback" not in err
    # what the killed export left is its own temporary folder, which the next export removes
    assert subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "export", str(run_with_adapter), "--out",
                           str(out)], capture_output=True, timeout=300).returncode == 0
    assert _left_beside(out) == ["copying", "exp", "held"]


def test_ctrl_c_during_the_gguf_check_stops_llama_cpp_and_writes_nothing(embedded_run, tmp_path):
    from edgetune.engine.core.runfolder import pid_alive

    fake = tmp_path / "site" / "llama_cpp"  # a llama.cpp that takes its time
    fake.mkdir(parents=True)
    pid_file, out = tmp_path / "llama.pid", tmp_path / "exp"
    (fake / "__init__.py").write_text(
        "import os, time\n"
        "class Llama:\n"
        "    def __init__(self, **kw):\n"
        f"        open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "        time.sleep(3600)\n")
    proc = _start("export", str(embedded_run), "--out", str(out), "--gguf", env={"PYTHONPATH": str(fake.parent)})
    _wait_for(pid_file.exists, proc, what="llama.cpp's process")
    rc, _, err = _interrupt(proc)
    assert rc == 130
    assert err.splitlines()[-1] == (f"interrupted: nothing was exported to {out} (what the export had written so "
                                    "far is removed)") and "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".edgetune-tmp-")]
    t0 = time.time()
    while pid_alive(int(pid_file.read_text())) and time.time() - t0 < 20:
        time.sleep(0.1)
    assert not pid_alive(int(pid_file.read_text()))  # llama.cpp's process went with the export


def test_ctrl_c_during_a_data_check_is_one_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    row = json.dumps({"instruction": "Add the numbers " * 20, "output": "The sum is 42. " * 20}) + "\n"
    data.write_text(row * 400_000)
    proc = _start("data", str(data))
    seen = []

    def checking():
        seen.append(proc.stderr.readline())  # "checking rows.jsonl: N rows (...)" every few seconds
        return seen[-1].startswith("checking")

    _wait_for(checking, proc, what="the check's progress line")
    rc, out, err = _interrupt(proc)
    assert rc == 130 and out == ""
    assert err.splitlines()[-1] == f"interrupted: the check of {data} stopped; nothing was written"
    assert "Traceback" not in err and all(ln.startswith("checking") for ln in err.splitlines()[:-1])


@pytest.mark.parametrize("after_s", [0.2, 0.8, 1.5, 2.5])
def test_ctrl_c_while_an_evaluation_starts_up_is_one_line(tmp_path, after_s):
    """Ctrl-C in the middle of the imports and the model's load (torch, transformers): while
    the command's own modules load, while the libraries' do (a KeyboardInterrupt that leaves
    a dataclass's exec()'d methods, which Python would otherwise answer at exit by killing
    its own process with SIGINT), while the model loads."""
    proc = _start("eval", "--preset", "fgrpo-quickstart", "--adapter", "", cwd=tmp_path)
    time.sleep(after_s)
    assert proc.poll() is None
    rc, out, err = _interrupt(proc)
    assert rc == 130 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == "interrupted: the evaluation stopped; nothing was written"
    assert not list(tmp_path.iterdir())


def _burn(cpu_s: float) -> None:
    t0 = time.process_time()
    while time.process_time() - t0 < cpu_s:
        sum(range(1000))


def test_a_stop_that_a_library_swallows_is_raised_again_but_never_inside_the_cleanup():
    """The first KeyboardInterrupt can be lost (raised in a `__del__`, Python only prints it;
    a library turns it into an error it catches) and the work would go on: it is raised
    again while the work goes on, but not inside the `finally` that cleans up after it."""
    from edgetune.engine.core import interrupts

    before = signal.getsignal(signal.SIGUSR1)
    cleaned = []
    try:
        interrupts.install(signal.SIGUSR1)
        with pytest.raises(KeyboardInterrupt):
            try:
                try:
                    os.kill(os.getpid(), signal.SIGUSR1)
                    time.sleep(5)  # the stop lands here
                except KeyboardInterrupt:
                    pass  # and is swallowed
                assert interrupts.asked()
                _burn(20)  # the work goes on, and is stopped again within half a second of CPU
            finally:
                _burn(2 * interrupts.AGAIN_EVERY_S + 0.5)  # the cleanup runs to its end
                cleaned.append(True)
        assert cleaned == [True]
    finally:
        interrupts.ended(signal.SIGUSR1, before)
    assert not interrupts.asked()
    _burn(2 * interrupts.AGAIN_EVERY_S + 0.5)  # after the end, nothing more is raised


def test_ctrl_c_ends_the_app_in_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _start("ui", "--port", str(port), "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path,
                  env={"GRADIO_TEMP_DIR": str(tmp_path / "gradio")})
    lines = []

    def ready():
        lines.append(proc.stdout.readline())
        return lines[-1].startswith("edgetune ready")

    _wait_for(ready, proc, what="the app to be ready")
    rc, out, err = _interrupt(proc)
    assert rc == 130 and "Traceback" not in err and "Keyboard interruption" not in out
    assert err.strip().splitlines()[-1] == ("interrupted: the app stopped; runs it started go on training "
                                            "(edgetune runs lists them)")


def test_ctrl_c_just_after_a_run_finished_kills_nothing_and_says_it_finished(tmp_path, capsys, monkeypatch):
    """The Ctrl-C lands while the worker winds down after its `finished` event: nothing is
    killed, nothing is written, and the command ends as the run did."""
    from edgetune.engine.core.events import EventWriter, read_events

    from edgetune.engine.run import api

    from edgetune.engine.cli.watch import watch

    path = tmp_path / "runs" / "r"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("method: sft\n")
    (path / "checkpoints" / "step-6").mkdir(parents=True)
    w = EventWriter(path / "events.jsonl")
    w.emit("started", method="sft", step=0)
    w.emit("finished", step=6, metrics={})
    w.close()
    run = api.Run(path)

    def ctrl_c(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "wait", ctrl_c)
    assert watch(run, quiet=True) == 0
    err = capsys.readouterr().err
    assert "the run had finished already; nothing was killed" in err and "killed;" not in err
    assert read_events(path / "events.jsonl")[-1]["type"] == "finished" and run.status() == "finished"
