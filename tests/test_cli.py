"""The command line on bad input: one line naming the problem, a non-zero exit, and no
half-written run folder (a run that fails after it started is marked failed)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from edgetune.engine.core.events import read_events


def edgetune(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "edgetune.engine.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def _train(tmp_path, *sets, preset="sft-quickstart"):
    args = ["train", "--preset", preset, "--runs-dir", str(tmp_path / "runs"), "--name", "r"]
    for s in sets:
        args += ["--set", s]
    return edgetune(*args)


def _one_error_line(p):
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.mark.parametrize("sets, needle", [
    (["lora.alpah=4"], "unknown setting 'lora.alpah' (did you mean 'alpha'?)"),
    (["sft.lr=-0.1"], "sft.lr must be positive"),
    (["sft.steps=0"], "sft.steps must be in [1, 10000000], got 0"),
    (["sft.optimizer=adamw8bit"], "sft.optimizer: 'adamw8bit' is not one of auto, adamw, adamw_8bit"),
    (["sft.sebp=maybe"], "sft.sebp: 'maybe' is not one of auto, on, off"),
    (["model.name=./no/such/model"], "model path does not exist: ./no/such/model"),
    (["data.path=/no/such/file.jsonl"], "/no/such/file.jsonl: data.path: file not found"),
])
def test_errors_before_any_run_folder(tmp_path, sets, needle):
    p = _train(tmp_path, *sets)
    assert p.returncode == 2
    assert needle in _one_error_line(p)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def _failed_run(tmp_path, p, needle):
    assert p.returncode == 2, p.stderr[-2000:]
    assert needle in _one_error_line(p)
    run = tmp_path / "runs" / "r"
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "error" and events[-1]["kind"] == "input"
    assert needle in events[-1]["message"]
    assert not (run / "adapter").exists()
    return events


def test_malformed_json_line_names_file_and_row(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "What is 1 plus 2?", "completion": "3"})
    bad.write_text("\n".join([good, good, '{"prompt": "x", "completion": ', good]) + "\n")
    p = _train(tmp_path, f"model.name={tiny_model_dir}", f"data.path={bad}")
    _failed_run(tmp_path, p, f"{bad}, row 3")


def _fails_in_the_worker(tmp_path, model_dir, data_path, needle):
    """The worker's side of the failure above, run in this process: the run is marked failed
    with the message the CLI prints (that one line is checked through the CLI above)."""
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import worker

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    cfg = resolve(preset="sft-quickstart", overrides=[f"model.name={model_dir}", f"data.path={data_path}",
                                                      f"run.runs_dir={tmp_path / 'runs'}"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    term = signal.getsignal(signal.SIGTERM)
    try:
        assert worker.run(str(run)) == 2
    finally:
        signal.signal(signal.SIGTERM, term)
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "error" and events[-1]["kind"] == "input"
    assert needle in events[-1]["message"] and "\n" not in events[-1]["message"]
    assert not (run / "adapter").exists()
    return events[-1]["message"]


def test_empty_dataset(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _fails_in_the_worker(tmp_path, tiny_model_dir, empty, str(empty))


def test_row_without_target(tmp_path, tiny_model_dir):
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": "What is 1 plus 2?", "completion": "3"}] * 3 + [{"prompt": "What is 2 plus 2?", "completion": ""}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    _fails_in_the_worker(tmp_path, tiny_model_dir, f, "row 4")


def test_unknown_columns(tmp_path, tiny_model_dir):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "q", "reply": "r"}) + "\n")
    message = _fails_in_the_worker(tmp_path, tiny_model_dir, f, "question")
    assert "reply" in message


def test_unsupported_architecture(tmp_path):
    from transformers import ViTConfig

    folder = tmp_path / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(folder)
    p = _train(tmp_path, f"model.name={folder}")
    assert p.returncode == 2
    assert "architecture 'vit' is not a causal language model" in _one_error_line(p)


def test_presets_and_runs_listing(tmp_path):
    p = edgetune("presets")
    assert p.returncode == 0 and "sft-quickstart" in p.stdout
    p = edgetune("runs", "--runs-dir", str(tmp_path))
    assert p.returncode == 0


def test_runs_listing_counts_damaged_event_lines(tmp_path):
    """A run whose events.jsonl has damaged lines (a crash mid-write) says how many were
    skipped; an intact one says nothing of it."""
    for name in ("clean", "hurt"):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text("method: sft\n")
        lines = [json.dumps({"i": 0, "time": 1, "type": "started", "method": "sft"}),
                 json.dumps({"i": 1, "time": 2, "type": "step", "step": 1, "total": 3, "loss": 0.5})]
        if name == "hurt":
            lines[1:1] = ['{"i": 1, "time": 2, "ty', "\x00\x00garbage"]
        (run / "events.jsonl").write_text("\n".join(lines) + "\n")
    p = edgetune("runs", "--runs-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines()}
    assert "step 1/3" in rows["hurt"] and "(2 damaged lines in events.jsonl, skipped)" in rows["hurt"]
    assert "step 1/3" in rows["clean"] and "damaged" not in rows["clean"]


# --------------------------------------------------------------------------- talking like its peers


def test_presets_are_described_in_complete_sentences():
    p = edgetune("presets")
    assert p.returncode == 0
    entries = [e for e in re.split(r"\n(?=\S)", p.stdout.strip())]
    assert len(entries) >= 7
    for e in entries:
        text = " ".join(e.split()[1:])
        assert text.endswith(".") and text[0].isupper(), e


def test_estimate_prints_a_gib_table_and_json_on_request():
    p = edgetune("estimate", "--preset", "sft-quickstart")
    assert p.returncode == 0, p.stderr
    assert re.search(r"^part\s+GiB$", p.stdout, re.M) and re.search(r"^total\s+\d+\.\d\d$", p.stdout, re.M)
    # the time before Start, from the data's own rows (no assumption left)
    assert re.search(r"^time on this machine: about \S+.* \(initial eval .*, training .*, final eval .*; the first "
                     r"steps correct it\)$", p.stdout, re.M), p.stdout
    raw = json.loads(edgetune("estimate", "--preset", "sft-quickstart", "--json").stdout)
    assert raw["time"]["assumed"] == [] and raw["time"]["total_s"] > 0
    shown = float(re.search(r"^total\s+(\S+)$", p.stdout, re.M).group(1))
    assert abs(shown - raw["total"] / 2**30) < 0.01
    # the decided values, the same the run records in config.yaml's `effective` block
    eff = raw["effective"]
    assert re.search(rf"^  device\s+{eff['device']}$", p.stdout, re.M)
    assert re.search(rf"^  optimizer\s+{eff['optimizer']}", p.stdout, re.M)
    auto = edgetune("estimate", "--preset", "sft-quickstart", "--set", "model.device=cuda",
                    "--set", "model.gradient_checkpointing=auto", "--set", "model.memory_budget_gib=1.5", "--json")
    auto = json.loads(auto.stdout)
    k, n = auto["effective"]["checkpointed_layers"], auto["model"]["layers"]
    assert 0 < k < n and auto["model"]["checkpointed_layers"] == k
    p = edgetune("estimate", "--preset", "sft-quickstart", "--set", "model.device=cuda",
                 "--set", "model.gradient_checkpointing=auto", "--set", "model.memory_budget_gib=1.5")
    assert re.search(rf"^  gradient checkpointing\s+the first {k} of {n} decoder layers$", p.stdout, re.M), p.stdout


def test_output_into_a_closed_pipe_is_not_a_traceback():
    """`edgetune estimate --json | head -1`: the reader leaves before the writer is done."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first write fails with EPIPE
    try:
        p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "estimate", "--preset", "sft-quickstart",
                            "--json"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert p.returncode == 141 and p.stderr == "", p.stderr


def _fake_finished_run(runs, name="r1"):
    """A run folder as the engine leaves it, with a (tiny) adapter to export."""
    run = runs / name
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text("method: sft\n")
    (run / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "x"}')
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"base_model.model.q_proj.lora_B.weight": np.zeros((4, 2), np.float32)},
              str(run / "adapter" / "adapter_model.safetensors"))
    (run / "events.jsonl").write_text(json.dumps({"i": 0, "time": 1, "type": "finished", "step": 1}) + "\n")
    return run


def test_export_takes_a_run_name_and_zip_gets_its_extension(tmp_path):
    runs = tmp_path / "runs"
    _fake_finished_run(runs)
    p = edgetune("export", "r1", "--out", "mine", "--zip", "--runs-dir", str(runs), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "mine.zip").is_file() and not (tmp_path / "mine").exists()
    import zipfile

    assert "adapter_config.json" in zipfile.ZipFile(tmp_path / "mine.zip").namelist()
    p = edgetune("export", "nope", "--out", "x", "--runs-dir", str(runs), cwd=tmp_path)
    assert p.returncode == 2 and "no run or folder 'nope'" in _one_error_line(p)


def _tiny_sets(tiny_model_dir, steps=2):
    return [f"model.name={tiny_model_dir}", "model.quant=none", "data.max_rows=32", f"sft.steps={steps}",
            "sft.batch_size=2", "sft.eval_every=0", "run.checkpoint_every=0"]


def test_resume_by_name_says_it_starts_over_without_a_checkpoint(tmp_path, tiny_model_dir):
    from edgetune.engine.core.settings import resolve

    runs = tmp_path / "runs"
    run = runs / "cut"
    run.mkdir(parents=True)
    cfg = resolve(preset="sft-quickstart", overrides=_tiny_sets(tiny_model_dir) + [f"run.runs_dir={runs}"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "events.jsonl").write_text(
        json.dumps({"i": 0, "time": 1, "type": "started", "method": "sft"}) + "\n"
        + json.dumps({"i": 1, "time": 2, "type": "stopped", "step": 0, "adapter": None, "metrics": {}}) + "\n")
    p = edgetune("resume", "cut", "--runs-dir", str(runs), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no checkpoint, so training starts again from step 0" in p.stdout
    assert "finished: adapter in" in p.stdout + p.stderr  # followed to this attempt's end, not the old stop
    assert read_events(run / "events.jsonl")[-1]["type"] == "finished"


def _wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow  # two CLI runs, each with its worker
def test_ctrl_c_once_stops_gracefully_twice_kills(tmp_path, tiny_model_dir):
    def start(name):
        args = ["train", "--preset", "sft-quickstart", "--runs-dir", str(tmp_path / "runs"), "--name", name]
        for s in _tiny_sets(tiny_model_dir, steps=500):
            args += ["--set", s]
        # A terminal's Ctrl-C reaches a CLI whose SIGINT is at its default. Under a shell's
        # background job (`... &`, as a CI runner may start the suite) SIGINT is inherited
        # as ignored, and Python then never raises KeyboardInterrupt: reset it in the child.
        return subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def stepping(name, proc):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        return any(e["type"] == "step" for e in read_events(tmp_path / "runs" / name / "events.jsonl"))

    once = start("once")
    _wait_for(lambda: stepping("once", once), 240, "a first step")
    once.send_signal(signal.SIGINT)
    out, err = once.communicate(timeout=120)
    assert once.returncode == 0, err[-2000:]
    assert read_events(tmp_path / "runs" / "once" / "events.jsonl")[-1]["type"] == "stopped"
    assert "stopped: adapter in" in out + err

    # The second Ctrl-C once the CLI has said it is stopping. A tiny model's graceful stop may
    # still end first (the CLI then says so, exits 0 and kills nothing): try again, up to 3 runs.
    for attempt in range(3):
        twice = start(f"twice{attempt}")
        _wait_for(lambda: stepping(f"twice{attempt}", twice), 240, "a first step")
        twice.send_signal(signal.SIGINT)
        err = ""
        while "Ctrl-C again to kill" not in err and twice.poll() is None:
            err += twice.stderr.readline()
        t0 = time.time()
        twice.send_signal(signal.SIGINT)
        err += twice.communicate(timeout=60)[1]
        if twice.returncode == 0 and "nothing was killed" in err:
            continue
        assert twice.returncode == 130 and time.time() - t0 < 20, err[-2000:]
        assert "killing the worker" in err
        last = read_events(tmp_path / "runs" / f"twice{attempt}" / "events.jsonl")[-1]
        assert last["type"] in ("error", "stopped")  # killed, unless the stop finished as the kill came
        break
    else:
        raise AssertionError("the graceful stop ended before the second Ctrl-C in 3 runs")


def test_sigterm_to_the_cli_stops_its_run_as_ctrl_c_does(tmp_path, tiny_model_dir):
    """A plain `kill` of `edgetune train` asks its worker (in a session of its own) for a
    graceful stop and follows it to the end: no worker is left training without a parent."""
    args = ["train", "--preset", "sft-quickstart", "--runs-dir", str(tmp_path / "runs"), "--name", "term"]
    for s in _tiny_sets(tiny_model_dir, steps=500):
        args += ["--set", s]
    proc = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    events = tmp_path / "runs" / "term" / "events.jsonl"
    _wait_for(lambda: proc.poll() is None and events.is_file()
              and any(e["type"] == "step" for e in read_events(events)), 240, "a first step")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    last = read_events(events)[-1]
    assert last["type"] == "stopped" and last["step"] < 500
    assert "stopped: adapter in" in out + err
    from edgetune.engine.run import api

    assert not api.Run(tmp_path / "runs" / "term").alive()
    listed = edgetune("runs", "--runs-dir", str(tmp_path / "runs")).stdout
    assert re.search(r"term\s+stopped\s+sft\s+step \d+/500", listed), listed


def test_every_ui_option_has_help():
    text = " ".join(edgetune("ui", "--help").stdout.split())
    for option, words in (("--host", "the address to serve on"), ("--port", "the port to serve on"),
                          ("--runs-dir", "where the page lists, starts and reads runs")):
        assert f"{option} " in text and words in text, (option, text)


def test_a_run_without_steps_lists_its_step_count(tmp_path):
    from edgetune.engine.core.settings import resolve

    run = tmp_path / "runs" / "fresh"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(resolve(preset="fgrpo-quickstart").to_yaml())
    listed = edgetune("runs", "--runs-dir", str(tmp_path / "runs")).stdout
    steps = resolve(preset="fgrpo-quickstart").fgrpo.steps
    assert f"step 0/{steps}" in listed and "None" not in listed


def test_sigterm_during_the_initial_eval_is_a_graceful_stop(tmp_path, tiny_model_dir):
    """A plain `kill` of the worker while it evaluates ends the run within seconds, as Stop does."""
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    cfg = resolve(preset="sft-quickstart", overrides=[
        f"model.name={tiny_model_dir}", "model.quant=none", "data.max_rows=400", "data.eval_fraction=0.5",
        "sft.steps=5", "sft.batch_size=1", "sft.eval_every=5", "sft.eval_batches=0", f"run.runs_dir={tmp_path}"])
    run = api.start(cfg)
    try:
        _wait_for(lambda: any(e["type"] == "phase" and e["phase"] == "initial_eval" and e.get("done", 0) >= 2
                              for e in run.events()), 240, "the initial evaluation to be under way")
        os.kill(run.process.pid, signal.SIGTERM)
        t0 = time.time()
        assert run.wait(30) == "stopped", list(run.events())[-3:]
        assert time.time() - t0 < 30
        done = [e for e in run.events() if e["type"] == "phase" and e["phase"] == "initial_eval"]
        assert done[-1]["done"] < done[-1]["total"]  # it stopped inside the evaluation
        assert run.process.poll() == 0
    finally:
        if run.alive():
            run.kill()


def test_ui_prints_its_url_and_ready(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", "ui", "--port", str(port), "--runs-dir",
                             str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path, env=dict(os.environ, GRADIO_ANALYTICS_ENABLED="False"))
    try:
        lines = []
        deadline = time.time() + 180
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "ready" in line:
                break
        text = "".join(lines)
        assert f"edgetune ready: http://127.0.0.1:{port}/" in text and "this machine only" in text, text[-2000:]
        assert "Traceback" not in text
    finally:
        proc.terminate()
        proc.wait(30)


def test_eval_shows_progress_then_a_table_or_json(tmp_path, tiny_model_dir, monkeypatch, capsys):
    sets = [f"model.name={tiny_model_dir}", "model.quant=none", "fgrpo.eval_prompts=4", "fgrpo.max_new_tokens=4"]
    args = ["eval", "--preset", "fgrpo-quickstart", "--adapter", ""]
    for s in sets:
        args += ["--set", s]
    p = edgetune(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # the random tiny model never answers: 0 of 4, with the Wilson interval of 0/4
    assert re.search(r"^the base\s+0\.0% \[0\.0, 49\.0\]\s+0\.000 \[0\.000, 0\.000\]", p.stdout, re.M), p.stdout
    assert "held-out: 4 prompts, graded by last_number" in p.stdout and "paired" not in p.stdout
    assert "8/8" in p.stderr  # the bar counted 4 prompts in each of its two passes
    assert "Loading weights" not in p.stderr and "FutureWarning" not in p.stderr
    # --json: the same command in this process (a second model load in a fresh one adds nothing)
    from edgetune.engine import cli

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main([*args, "--json"]) == 0
    (raw,) = json.loads(capsys.readouterr().out)["tasks"]
    (base,) = raw["systems"]
    assert raw["prompts"] == 4 and base["name"] == "the base" and base["adapter"] is None
    assert base["per_prompt"]["success_rate"] == [0, 0, 0, 0] and raw["comparisons"] == []
    assert base["scores"]["pass@1"] == {"estimate": 0.0, "low": 0.0, "high": 0.0}


def test_eval_compares_a_run_with_the_base_in_a_table(tmp_path, tiny_model_dir):
    sets = [f"model.name={tiny_model_dir}", "model.quant=none", "fgrpo.eval_prompts=4", "fgrpo.max_new_tokens=4",
            "fgrpo.eval_k=0"]
    p = _train(tmp_path, *sets, "fgrpo.steps=1", "fgrpo.num_generations=2", "fgrpo.prompts_per_step=2",
               preset="fgrpo-quickstart")
    assert p.returncode == 0, p.stderr[-2000:]
    # the run's own comparison of its adapter with the base, as `train` prints it
    assert "held-out success_rate: the base vs the adapter: no detectable difference on 4 prompts (p = 1)" \
        in p.stdout + p.stderr
    args = ["eval", "--preset", "fgrpo-quickstart", "--base", "--adapter", "r", "--runs-dir", str(tmp_path / "runs")]
    for s in sets:
        args += ["--set", s]
    p = edgetune(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [ln for ln in p.stdout.splitlines() if re.match(r"^(the base|r)\s+\d", ln)]
    assert [ln.split()[0] for ln in rows] == ["the", "r"]
    assert f"  r: {tmp_path / 'runs' / 'r' / 'adapter'}" in p.stdout
    assert "r vs the base, success_rate: +0.0 pts" in p.stdout
    # neither answers anything: no difference, and how many prompts would show a 5-point gap
    assert "the base vs r: no detectable difference on 4 prompts (p = 1); about 155 would show a 5-point gap" \
        in p.stdout
    assert "r (2/2): evaluating: 4/4" in p.stderr


@pytest.mark.parametrize("args, needle", [
    (["--preset", "dpo-quickstart", "--base"],
     "DPO runs have no held-out split `edgetune eval` can grade (it grades those of SFT, F-GRPO, ESSA); give a "
     "task file of prompts and answers: --task FILE"),
    (["--preset", "sft-quickstart", "--base", "--task", "missing.jsonl"], "missing.jsonl: file not found"),
    (["--preset", "fgrpo-quickstart"], "nothing to evaluate: give --adapter RUN (repeatable) and/or --base"),
    (["--preset", "fgrpo-quickstart", "--adapter", "no-such-run"], "no run or folder 'no-such-run'"),
])
def test_eval_refuses_in_one_line_before_loading_a_model(tmp_path, args, needle):
    p = edgetune("eval", *args, cwd=tmp_path)
    assert p.returncode == 2 and needle in _one_error_line(p)


def test_library_notices_are_silenced_where_raised():
    """bitsandbytes' `pip install kernels` notice (on AVX512-BF16 CPUs) and transformers' v6
    FutureWarnings stay out of a run's output; other warnings still show."""
    code = ("import warnings, edgetune.engine.models.model, bitsandbytes\n"
            "warnings.warn('`x` is deprecated and will be removed in v6', FutureWarning)\n"
            "warnings.warn('our own warning', UserWarning)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "pip install kernels" not in p.stderr and "removed in v6" not in p.stderr
    assert "our own warning" in p.stderr


def test_a_cpu_load_offline_says_nothing_of_hubs_or_kernels_it_could_not_fetch(tmp_path):
    """HF_HUB_OFFLINE, as on a machine without network: loading the embedded model in NF4 on
    the CPU prints nothing about a hub, a kernel or a trust check (bitsandbytes looks for a
    faster kernel on AVX512-BF16 CPUs); another notice of the same libraries still shows."""
    code = ("import logging\n"
            "from edgetune.engine.core.settings import ModelSettings\n"
            "from edgetune.engine.models.model import load_base\n"
            "load_base(ModelSettings(device='cpu', quant_cache=False))\n"
            "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('another bitsandbytes notice')\n"
            "logging.getLogger('kernels._internals.hf_hub').warning('another kernels notice')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    progress = re.compile(r"^[\w ]+: +\d+%\|")  # transformers' bars: loading the weights (converting the GGUF)
    notices = [ln for ln in re.split(r"[\r\n]+", p.stderr) if ln.strip() and not progress.match(ln)]
    assert notices == ["another bitsandbytes notice", "another kernels notice"], p.stderr[-3000:]


def test_more_ranks_than_cores_on_a_cpu_is_refused(tmp_path, monkeypatch, capsys):
    """Without a CUDA GPU each rank is a CPU process: --gpus 1000 would start 1,000."""
    import os

    from edgetune.engine.planning import planner

    from edgetune.engine import cli

    monkeypatch.setattr(planner, "gpu_memory", lambda: None)
    runs = tmp_path / "runs"
    rc = cli.main(["train", "--preset", "sft-quickstart", "--gpus", "1000", "--runs-dir", str(runs)])
    assert rc == 2 and not runs.exists()
    assert capsys.readouterr().err == (f"error: --gpus 1000: this machine has no CUDA GPU, so each rank would be a "
                                       f"CPU process; at most {os.cpu_count()} (its CPU cores)\n")


def test_a_worker_that_dies_in_start_up_is_named_with_its_signal_and_last_log_line(tmp_path, monkeypatch,
                                                                                     capsys):
    """A worker killed before its first event: the error names the signal and what it printed last."""
    from edgetune.engine import cli

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os, resource, signal, sys\n"
        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
        "print('loading a native library built for another CPU', file=sys.stderr, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    runs = tmp_path / "runs"
    rc = cli.main(["train", "--preset", "sft-quickstart", "--runs-dir", str(runs), "--name", "r"])
    err = capsys.readouterr().err
    assert rc == 1
    log = runs / "r" / "worker.log"
    pid = (runs / "r" / "worker.pid").read_text()
    assert err.splitlines()[-1] == (f"error: the worker (pid {pid}) ended without a final event (killed by signal 4 "
                                    f"(SIGILL)); the last line of {log}: loading a native library built for another "
                                    "CPU")
    assert "Traceback" not in err


def test_five_hundred_runs_list_from_the_runs_folders_index(tmp_path, capsys, monkeypatch):
    """`edgetune runs` and the app's Runs table read each run's config.yaml and events.jsonl
    once, into the runs folder's index; then only a run whose files changed is read again
    (counted here: the listing's time is a bench figure, not a test's)."""
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    from edgetune.engine import cli

    runs = tmp_path / "runs"
    cfg = resolve(preset="sft-quickstart")
    text, config = cfg.to_yaml(), cfg.to_dict()
    for k in range(500):
        run = runs / f"run-{k:03d}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(text)
        events = [{"i": 0, "time": 1.0, "type": "started", "method": "sft", "config": config}]
        events += [{"i": s, "time": 1.0 + s, "type": "step", "step": s, "total": 60, "loss": 1 / s} for s in range(1, 51)]
        if k % 2:
            events.append({"i": 51, "time": 60.0, "type": "stopped", "step": 50, "metrics": {"loss": 0.02}})
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    first = api.summaries(runs)
    read = []
    facts = api.Run._facts
    monkeypatch.setattr(api.Run, "_facts", lambda self: read.append(self.name) or facts(self))
    again = api.summaries(runs)
    assert read == [] and again == first  # nothing parsed again
    assert {s["status"] for s in again} == {"stopped", "crashed"} and {s["step"] for s in again} == {50}
    with open(runs / "run-007" / "events.jsonl", "a") as f:  # a run that moves on is read again
        f.write(json.dumps({"i": 52, "time": 70.0, "type": "started", "method": "sft", "config": config}) + "\n")
        f.write(json.dumps({"i": 53, "time": 71.0, "type": "step", "step": 51, "total": 60, "loss": 0.01}) + "\n")
    moved = {s["name"]: s for s in api.summaries(runs)}["run-007"]
    assert moved["step"] == 51 and moved["status"] == "crashed" and read == ["run-007"]
    (runs / api.INDEX_FILE).write_text("[not an index")  # damaged: rebuilt, never in the way
    assert cli.main(["runs", "--runs-dir", str(runs)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 500
    assert api.summaries(runs) == [r.summary() for r in api.list_runs(runs)]


def test_rename_delete_and_restore_a_run_from_the_command_line(tmp_path, capsys):
    """The Runs tab's rename, delete (to the trash) and restore, as commands."""
    from edgetune.engine import cli

    runs = tmp_path / "runs"
    _fake_finished_run(runs, "first")
    assert cli.main(["rename", "first", "arith-v1", "--runs-dir", str(runs)]) == 0
    assert (runs / "arith-v1" / "config.yaml").is_file() and not (runs / "first").exists()
    assert cli.main(["delete", "arith-v1", "--runs-dir", str(runs)]) == 0
    assert not (runs / "arith-v1").exists() and (runs / ".trash" / "arith-v1" / "config.yaml").is_file()
    capsys.readouterr()
    assert cli.main(["restore", "--runs-dir", str(runs)]) == 0
    assert capsys.readouterr().out.split() == ["arith-v1"]
    assert cli.main(["restore", "arith-v1", "--runs-dir", str(runs)]) == 0
    assert (runs / "arith-v1" / "adapter" / "adapter_model.safetensors").is_file()
    assert cli.main(["restore", "nope", "--runs-dir", str(runs)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


def test_delete_of_dot_or_a_trash_that_is_no_folder_of_its_own_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from edgetune.engine import cli

    runs = tmp_path / "runs"
    run = _fake_finished_run(runs, "r")
    monkeypatch.chdir(run)
    for args in (["delete", "."], ["delete", ".."], ["rename", ".", "other"], ["delete", "./"]):
        assert cli.main([*args, "--runs-dir", str(runs)]) == 2, args
        assert "not '.' or '..'" in _one_line_error(capsys)
    assert not (run / ".trash").exists() and sorted(p.name for p in runs.iterdir()) == ["r"]
    monkeypatch.chdir(tmp_path)
    (runs / ".trash").write_text("a file of the user's")
    assert cli.main(["delete", "r", "--runs-dir", str(runs)]) == 2
    assert _one_line_error(capsys) == f"error: {runs / '.trash'}: not a folder of the runs folder (a file); move it " \
        "aside, and deleted runs go to a new trash"
    (runs / ".trash").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (runs / ".trash").symlink_to(elsewhere)  # through it, the run would leave the runs folder
    assert cli.main(["delete", "r", "--runs-dir", str(runs)]) == 2
    assert "(a link)" in _one_line_error(capsys)
    assert (run / "config.yaml").is_file() and not any(elsewhere.iterdir())
    assert cli.main(["restore", "--runs-dir", str(runs)]) == 2
    assert "(a link)" in _one_line_error(capsys)


def test_one_run_whose_events_file_is_a_folder_blocks_no_other(tmp_path, capsys):
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    from edgetune.engine import cli

    runs = tmp_path / "runs"
    bad = _fake_finished_run(runs, "bad")
    (bad / "events.jsonl").unlink()
    (bad / "events.jsonl").mkdir()
    run, fd = api.create(resolve(preset="sft-quickstart", overrides=[f"run.runs_dir={runs}"]), "fine")  # a start
    os.close(fd)
    assert run.path.is_dir() and api.active_run(runs) is None
    assert cli.main(["runs", "--runs-dir", str(runs)]) == 0
    assert any(line.startswith("bad ") and "damaged" in line for line in capsys.readouterr().out.splitlines())
    assert cli.main(["resume", "bad", "--runs-dir", str(runs)]) == 2
    assert "events.jsonl" in _one_line_error(capsys)
    assert cli.main(["export", "bad", "--out", str(tmp_path / "out"), "--runs-dir", str(runs)]) == 0  # its adapter


@pytest.fixture
def small_mount(tmp_path):
    """A 256 KiB tmpfs of the test's own, to fill up or make read-only."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"needs permission to mount a tmpfs: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_commands_on_a_full_disk_or_a_read_only_runs_folder_fail_in_one_line_and_change_nothing(
        small_mount, capsys):
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import queue

    from edgetune.engine import cli

    runs = small_mount / "runs"
    _fake_finished_run(runs, "r")
    (runs / "r" / "config.yaml").write_text(resolve(preset="sft-quickstart", overrides=["run.name=r"]).to_yaml())
    train = ["train", "--preset", "sft-quickstart", "--runs-dir", str(runs), "--queue"]
    assert cli.main([*train, "--name", "q"]) == 0
    capsys.readouterr()

    def state():
        return sorted(str(p.relative_to(runs)) for p in runs.rglob("*")), (runs / "r" / "config.yaml").read_text()

    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    before = state()
    for args in (train, ["queue", "cancel", "1", "--runs-dir", str(runs)], ["delete", "r", "--runs-dir", str(runs)],
                 ["rename", "r", "r2", "--runs-dir", str(runs)]):
        assert cli.main(args) == 2, args
        assert "read-only" in _one_line_error(capsys), args
    assert state() == before
    subprocess.run(["mount", "-o", "remount,rw", str(small_mount)], check=True)
    fd = os.open(small_mount / "filler", os.O_WRONLY | os.O_CREAT)  # the disk full
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        os.close(fd)
    before = state()
    for args in (train, ["queue", "cancel", "1", "--runs-dir", str(runs)],
                 ["rename", "r", "r2", "--runs-dir", str(runs)]):
        assert cli.main(args) == 2, args
        assert "no space left on the device" in _one_line_error(capsys), args
    assert state() == before  # the rename: neither the folder nor its config.yaml changed
    assert [j["folder"] for j in queue.jobs(runs)] == ["q"]


def test_every_option_of_train_says_what_it_is(capsys):
    from edgetune.engine import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--name NAME the run's folder name" in out and "--runs-dir RUNS_DIR the folder runs are kept in" in out
