"""A run folder copied from elsewhere, or damaged, on `edgetune runs`, `edgetune resume`,
`edgetune export` and the app: planted symbolic links are refused and their targets stay
as they were; settings that run Python (reward_file, trust_remote_code) run only when the
user names that file or model; a damaged config.yaml is named with its line and never
hides the other runs; an edited lora.r names the setting. The run folders are made by
hand (no training), so each test takes seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from edgetune.engine.core.errors import ConfigError, EdgetuneError, RunError
from edgetune.engine.core.events import EventWriter, read_events
from edgetune.engine.core.settings import resolve

from edgetune.engine.run import api


def edgetune(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgetune.engine.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def _one_error_line(p) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return lines[0]


def stopped_run(runs, name, model_dir, *overrides, checkpoint_r=None):
    """A run folder as a stopped run leaves it: its config, a started and a stopped event,
    and with `checkpoint_r` a checkpoint's adapter_config.json of that rank."""
    run = runs / name
    run.mkdir(parents=True)
    cfg = resolve(preset="sft-quickstart", overrides=[f"model.name={model_dir}", "model.quant=none", "sft.steps=2",
                                                      f"run.runs_dir={runs}", *overrides])
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "events.jsonl").write_text(
        json.dumps({"i": 0, "time": 1, "type": "started", "method": cfg.method}) + "\n"
        + json.dumps({"i": 1, "time": 2, "type": "stopped", "step": 2, "adapter": None, "metrics": {}}) + "\n")
    (run / "worker.log").write_text("the first attempt\n")
    if checkpoint_r is not None:
        ck = run / "checkpoints" / "step-2"
        ck.mkdir(parents=True)
        (ck / "adapter_config.json").write_text(json.dumps({"r": checkpoint_r, "lora_alpha": cfg.lora.alpha,
                                                            "lora_dropout": cfg.lora.dropout}))
        (ck / "edgetune.json").write_text(json.dumps({"method": cfg.method}))
        (ck / "training_state.pt").write_bytes(b"state")
        (ck / "adapter_model.safetensors").write_bytes(b"weights")
    return run


# --------------------------------------------------------------------------- symbolic links


@pytest.mark.parametrize("planted", ["events.jsonl", "worker.log", "config.yaml", "checkpoints",
                                     "checkpoints/step-2/training_state.pt", "adapter"])
def test_a_planted_symbolic_link_is_refused_and_its_target_untouched(tmp_path, tiny_model_dir, planted):
    run = stopped_run(tmp_path / "runs", "copied", tiny_model_dir, checkpoint_r=16)
    target = tmp_path / "home"
    target.mkdir()
    rc = target / ".bashrc"
    rc.write_text("export PATH=$HOME/bin:$PATH\n")
    link = run / planted
    if link.is_dir():  # a folder of the run (checkpoints): its content moves to where the link points
        os.rename(link, target / "moved")
        os.symlink(target / "moved", link)
    elif planted == "adapter":
        os.symlink(target, link)
    else:  # a file of the run: a link to a file of the user's
        link.unlink()
        os.symlink(rc, link)
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}

    with pytest.raises(RunError, match=f"{link}: a symbolic link inside the run folder"):
        api.resume(run)
    if planted == "events.jsonl":  # the CLI's one line (each case refuses in api.resume alike)
        p = edgetune("resume", str(run))
        assert p.returncode == 2 and f"{link}: a symbolic link" in _one_error_line(p)
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert not (run / "worker.pid").exists()  # no worker started


def test_a_run_file_is_never_appended_to_through_a_link(tmp_path):
    """The backstop behind the refusal: events.jsonl and worker.log open with O_NOFOLLOW."""
    rc = tmp_path / ".bashrc"
    rc.write_text("alias ll='ls -l'\n")
    (tmp_path / "run").mkdir()
    os.symlink(rc, tmp_path / "run" / "events.jsonl")
    with pytest.raises(RunError, match="events.jsonl: a symbolic link"):
        EventWriter(tmp_path / "run" / "events.jsonl").emit("error", message="x", kind="killed")
    assert rc.read_text() == "alias ll='ls -l'\n"


# --------------------------------------------------------------------------- code a config names


def test_a_reward_file_runs_on_resume_only_when_named(tmp_path, tiny_model_dir):
    runs = tmp_path / "runs"
    marker = tmp_path / "RAN"
    reward = tmp_path / "reward.py"
    # It shows that it ran, then ends the process: the worker names the file, not a bug of ours.
    reward.write_text(f"import sys\nopen({str(marker)!r}, 'w').write('ran')\nsys.exit(3)\n")
    run = stopped_run(runs, "rl", tiny_model_dir, "method=fgrpo", "fgrpo.reward=file", f"fgrpo.reward_file={reward}",
                      "data.path=embedded:arith-rl")

    with pytest.raises(RunError, match=r"fgrpo.reward_file runs the Python file .*reward.py when this run resumes"):
        api.resume(run)
    p = edgetune("resume", "rl", "--runs-dir", str(runs), cwd=tmp_path)
    line = _one_error_line(p)
    assert p.returncode == 2 and f"--allow-code {reward}" in line and not marker.exists()
    p = edgetune("resume", "rl", "--runs-dir", str(runs), "--allow-code", str(tmp_path / "other.py"), cwd=tmp_path)
    assert p.returncode == 2 and not marker.exists()  # another file named: still refused

    p = edgetune("resume", "rl", "--runs-dir", str(runs), "--allow-code", str(reward), cwd=tmp_path)
    assert marker.exists(), p.stderr[-2000:]
    assert p.returncode == 2 and f"reward_file {reward}: fails to load: it calls sys.exit(3)" in _one_error_line(p)
    err = read_events(run / "events.jsonl")[-1]
    assert err["type"] == "error" and err["kind"] == "input"


def test_trust_remote_code_runs_on_resume_only_when_the_model_is_named(tmp_path, tiny_model_dir):
    run = stopped_run(tmp_path / "runs", "remote", tiny_model_dir, "model.trust_remote_code=true")
    with pytest.raises(RunError, match=f"model.trust_remote_code runs the Python code that model {tiny_model_dir} "
                                       f"ships when this run resumes.*--allow-code {tiny_model_dir}"):
        api.resume(run)
    with pytest.raises(RunError, match="trust_remote_code"):
        api.resume(run, allow_code=[str(tmp_path / "another-model")])
    cfg = api.load_run_config(run / "config.yaml")
    api.confirm_code(api.Run(run), cfg, [str(tiny_model_dir) + "/"])  # the same folder, written another way
    assert [s for s, _ in api.code_it_runs(cfg)] == ["model.trust_remote_code"]


def test_the_app_refuses_a_run_that_runs_code_and_names_the_command(tmp_path, tiny_model_dir):
    from edgetune.app.ui import build_app

    runs = tmp_path / "runs"
    run = stopped_run(runs, "remote", tiny_model_dir, "model.trust_remote_code=true")
    page = build_app(str(runs)).edgetune_page
    shown = page.train_tab.do_resume(str(run))[page.train_tab.msg]
    assert "model.trust_remote_code" in shown and f"edgetune resume {run} --allow-code {tiny_model_dir}" in shown
    assert read_events(run / "events.jsonl")[-1]["type"] == "stopped"  # nothing started


def test_the_evaluate_tab_does_not_run_a_run_folders_reward_file(tmp_path, tiny_model_dir):
    from edgetune.app.ui import build_app

    runs = tmp_path / "runs"
    marker = tmp_path / "RAN"
    reward = tmp_path / "reward.py"
    reward.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef reward(prompt, completion, **kw):\n    return 0.0\n")
    run = stopped_run(runs, "rl", tiny_model_dir, "method=fgrpo", "fgrpo.reward=file", f"fgrpo.reward_file={reward}",
                      "data.path=embedded:arith-rl")
    page = build_app(str(runs)).edgetune_page
    tab = page.eval_tab
    values = {tab.base: True, tab.runs: ["rl"], tab.held_out: True, tab.files: "", tab.harness: "",
              **{k: None for k in page.form_inputs}}
    shown = tab.do_start(values)[tab.msg]
    assert f"{run / 'config.yaml'}: fgrpo.reward_file runs the Python file {reward} when this run is graded" in shown
    assert f"edgetune eval --config {run / 'config.yaml'} --adapter {run} --task held-out" in shown
    assert not (runs / ".evaluations").exists() and not marker.exists()


def test_a_planted_evaluation_pid_is_not_a_running_job_and_stop_signals_nothing(tmp_path):
    from edgetune.engine.run import eval_jobs

    job = tmp_path / "runs" / ".evaluations" / "eval-planted"
    job.mkdir(parents=True)
    (job / "request.json").write_text(json.dumps({"base": True, "adapters": [], "tasks": ["held-out"]}))
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # any process of this user
    try:
        for planted in (str(other.pid), f"{other.pid} 0"):
            (job / "pid").write_text(planted)
            found = eval_jobs.list_evals(tmp_path / "runs")[0]
            assert found.status() == "crashed" and eval_jobs.active_eval(tmp_path / "runs") is None
            found.stop()
            time.sleep(0.2)
            assert other.poll() is None  # not signalled
        (tmp_path / "runs" / "r").mkdir()
        (tmp_path / "runs" / "r" / "config.yaml").write_text("method: sft\n")
        (tmp_path / "runs" / "r" / "worker.pid").write_text(str(other.pid))
        api.Run(tmp_path / "runs" / "r").kill()  # nor by a run's kill
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_the_apps_chat_does_not_run_a_run_folders_model_code(tmp_path, tiny_model_dir, monkeypatch):
    from edgetune.app.ui import build_app

    run = stopped_run(tmp_path / "runs", "remote", tiny_model_dir, "model.trust_remote_code=true")
    page = build_app(str(tmp_path / "runs")).edgetune_page
    asked = []
    monkeypatch.setattr(page.chat, "stream", lambda *a, **k: asked.append(a) or iter(()))
    tab = page.chat_tab
    out = list(tab.do_chat({tab.prompt: "Hi", page.attached: str(run), tab.base: [], tab.tuned: [],
                            tab.max_new: 8}))[-1]
    assert f"{run / 'config.yaml'}: model.trust_remote_code would run the Python code" in out[tab.info]
    assert not asked  # no model was loaded


def test_a_reward_calling_sys_exit_while_scoring_is_the_files_error(tmp_path):
    from edgetune.engine.training.rewards import RewardFailing, load_user_reward

    f = tmp_path / "reward.py"
    f.write_text("import sys\n\ndef reward(completion, answer, row):\n    sys.exit(0)\n")
    score = load_user_reward(str(f))
    with pytest.raises(RewardFailing, match=f"reward_file {f}: reward\\(\\) called sys.exit\\(0\\)"):
        score("7", {"answer": "7"}, False)


# --------------------------------------------------------------------------- damaged or edited config.yaml


def test_a_damaged_config_is_listed_as_damaged_and_the_other_runs_still_are(tmp_path, tiny_model_dir):
    from edgetune.app.ui import build_app

    runs = tmp_path / "runs"
    stopped_run(runs, "good", tiny_model_dir)
    bad = stopped_run(runs, "bad", tiny_model_dir)
    (bad / "config.yaml").write_text("method: sft\nmodel: {name: [\n")
    p = edgetune("runs", "--runs-dir", str(runs))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines()}
    assert lines.keys() == {"good", "bad"}
    assert lines["good"].split()[1] == "stopped"
    assert lines["bad"].split()[1] == "damaged" and f"{bad / 'config.yaml'}, line 3, column 1: not valid YAML" \
        in lines["bad"]

    table = build_app(str(runs)).edgetune_page.runs_tab.frame()  # the app's Runs table
    rows = {r["run"]: r for r in table.to_dict("records")}
    assert rows["good"]["status"] == "stopped" and rows["bad"]["status"] == "damaged"
    assert "config.yaml, line 3" in rows["bad"]["metrics"]


@pytest.mark.parametrize("cut", ["mid-line", "at a line's end"])
def test_resume_of_a_truncated_config_names_file_and_line(tmp_path, tiny_model_dir, cut):
    run = stopped_run(tmp_path / "runs", "cut", tiny_model_dir)
    text = (run / "config.yaml").read_text()
    lines = text.splitlines(keepends=True)
    if cut == "mid-line":
        kept = text[: text.index("lora:") + 3]  # "lor": a key without its colon
        where = f"line {kept.count(chr(10)) + 1}"
    else:
        kept = "".join(lines[: next(i for i, ln in enumerate(lines) if ln.startswith("data:"))])
        where = f"line {kept.count(chr(10))}: ends without the 'data' settings"
    (run / "config.yaml").write_text(kept)
    with pytest.raises(ConfigError, match=f"{run / 'config.yaml'}, {where}"):
        api.resume(run)
    p = edgetune("resume", str(run))
    assert p.returncode == 2 and f"config.yaml, {where}" in _one_error_line(p)


def test_resume_after_editing_lora_r_names_the_setting(tmp_path, tiny_model_dir):
    run = stopped_run(tmp_path / "runs", "edited", tiny_model_dir, "lora.r=32", checkpoint_r=16)
    p = edgetune("resume", str(run))
    assert p.returncode == 2
    assert _one_error_line(p) == (f"error: {run / 'config.yaml'}: lora.r is 32, but checkpoint step-2 was trained "
                                  "with 16; set it back to 16 to resume, or start a new run with the new value")


def test_a_config_from_an_earlier_edgetune_with_a_retired_setting_still_loads(tmp_path, tiny_model_dir):
    run = stopped_run(tmp_path / "runs", "older", tiny_model_dir)
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("sft:\n", "sft:\n  sample_every: 0\n", 1))
    assert "sample_every: 0" in (run / "config.yaml").read_text()
    assert api.load_run_config(run / "config.yaml").sft.steps > 0
    with pytest.raises(ConfigError, match="unknown setting 'sft.sample_every'"):
        resolve(overrides=["sft.sample_every=0"])  # retired: refused where a user types it


# --------------------------------------------------------------------------- export while training again


def test_export_refuses_a_run_that_trains_again(tmp_path, tiny_model_dir):
    run = stopped_run(tmp_path / "runs", "again", tiny_model_dir)
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 16}))
    first = run / "adapter" / "adapter_model.safetensors"
    save_file({"base_model.model.lora_A.weight": np.ones((2, 2), np.float32)}, first)  # the first attempt's
    # resumed: a new `started` after the stop, and its worker alive (this process stands in)
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"i": 2, "time": 3, "type": "started", "method": "sft"}) + "\n")
    (run / "worker.pid").write_text(str(os.getpid()))
    for source in (run, run / "adapter"):
        with pytest.raises(EdgetuneError, match=f"{run}: the run is running: its adapter is written when it ends"):
            api.export(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (run / "worker.pid").unlink()  # the attempt ended (crashed): its previous adapter exports
    assert (api.export(run, tmp_path / "out") / "adapter_model.safetensors").read_bytes() == first.read_bytes()
