"""Faults a long run meets, each injected on the CPU with the tiny model: a graceful stop
between checkpoints, a damaged event log, a truncated or planted checkpoint, leftovers
of a killed write, a SIGKILL mid-step and mid-checkpoint, an edited lora.r."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from inline_run import run_inline, sft_config

from edgetune.engine.core import settings
from edgetune.engine.core.errors import CheckpointError, ConfigError
from edgetune.engine.core.events import EventWriter, read_events, scan_events
from edgetune.engine.core.runfolder import RunDir

from edgetune.engine.training.loop import pick_checkpoint

from edgetune.engine.run import api


def _cfg(model_dir, tmp_path, **over):
    """The shared SFT test config with no periodic checkpoint unless a test asks for one."""
    return sft_config(model_dir, tmp_path, **{**over, "run": {"checkpoint_every": 50, **over.get("run", {})}})


def _losses(events):
    return {e["step"]: e["loss"] for e in events if e["type"] == "step"}


def _sft(cfg, path, **kw):
    from edgetune.engine.methods.sft import sft

    return run_inline(sft.train, cfg, path, **kw)[2]


@pytest.fixture(scope="module")
def full_losses(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    losses = _losses(_sft(_cfg(tiny_model_dir, tmp), tmp / "full"))
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and len(set(losses.values())) == 6
    return losses


def test_stop_between_checkpoints_resumes_from_that_step(tiny_model_dir, tmp_path, full_losses):
    cfg = _cfg(tiny_model_dir, tmp_path)  # periodic checkpoints every 50 steps: none before the stop
    first = _sft(cfg, tmp_path / "cut", stop_after=2)
    assert first[-1]["type"] == "stopped" and first[-1]["step"] == 2
    assert RunDir(tmp_path / "cut").last_checkpoint()[0] == 2
    second = [e for e in _sft(cfg, tmp_path / "cut", resume=True) if e["i"] > first[-1]["i"]]
    assert second[-1]["type"] == "finished"
    assert sorted(_losses(second)) == [3, 4, 5, 6]  # continued from exactly the stopped-at step
    assert {**_losses(first), **_losses(second)} == full_losses  # bit for bit


def _write_config(cfg, run_path):
    (run_path / "config.yaml").write_text(cfg.to_yaml())


def _resume_in_worker(run_path, timeout=300):
    run = api.resume(run_path)
    assert run.wait(timeout) in ("finished", "stopped", "failed"), run.status()
    return run


def _resume_here(run_path):
    """What the worker process does on resume (the checkpoint it picks, its warnings as
    events, the training), run in this process: a worker's start costs the imports of
    torch, transformers and PEFT again; the resume through a real worker is tested below."""
    from edgetune.engine.run import worker

    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own: stop gracefully
    try:
        rc = worker.run(str(run_path), resume=True, owns_pid=False)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    run = api.open_run(run_path)
    assert rc == 0, read_events(run_path / "events.jsonl")[-3:]
    return run


def test_a_stop_while_the_run_starts_ends_it_before_its_first_step(tiny_model_dir, tmp_path):
    """Stop pressed while the run is `starting` (its worker still importing) is kept: the
    run ends `stopped` at step 0 (the worker used to remove the request as it started, and
    the run trained to its end). The STOP a stopped attempt leaves is removed before a
    resume's worker starts (test_stop_during_checkpointing_keeps_that_checkpoint resumes one)."""
    run = api.start(_cfg(tiny_model_dir, tmp_path / "runs"), name="r")
    try:
        assert run.status() == "starting"
        run.stop()
        assert run.wait(240) == "stopped", read_events(run.dir.events_path)[-3:]
        events = read_events(run.dir.events_path)
        assert not any(e["type"] == "step" for e in events) and events[-1]["step"] == 0
        assert run.process.poll() == 0
    finally:
        if run.alive():
            run.kill()


def test_truncated_checkpoint_falls_back_to_the_previous_one(tiny_model_dir, tmp_path, full_losses):
    cfg = _cfg(tiny_model_dir, tmp_path, run={"checkpoint_every": 2, "keep_checkpoints": 3})
    path = tmp_path / "r"
    _sft(cfg, path, stop_after=4)
    _write_config(cfg, path)
    assert [s for s, _ in RunDir(path).list_checkpoints()] == [2, 4]
    state = path / "checkpoints" / "step-4" / "training_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a crash mid-write of an old version
    warnings = []
    assert pick_checkpoint(RunDir(path), warnings.append)[0] == 2
    assert str(state) in warnings[0] and "step 2" in warnings[1]

    run = _resume_here(path)
    assert run.status() == "finished", read_events(path / "events.jsonl")[-3:]
    events = read_events(path / "events.jsonl")
    started = [e for e in events if e["type"] == "started"][-1]
    assert started["resumed_from"] == 2
    after = [e for e in events if e["i"] > started["i"]]
    msgs = [e["message"] for e in after if e["type"] == "warning"] + \
           [e["message"] for e in events if e["type"] == "warning" and e["i"] < started["i"]]
    assert any(str(state) in m for m in msgs), msgs
    # full_losses come from an in-process run; a worker's fp32 sums may differ in the 7th digit
    assert _losses(after) == pytest.approx({k: v for k, v in full_losses.items() if k > 2}, rel=1e-6)


def test_a_setting_edited_before_a_resume_is_applied_and_recorded_or_refused(tiny_model_dir, tmp_path):
    """sft.lr edited after the run trained: its checkpoint's optimizer keeps the old rate, so
    resume refuses it, naming it (and the worker behind it); sft.eval_every and sft.steps
    edited: the resumed attempt applies them and its `started` event records them."""
    from edgetune.engine.run import worker

    cfg = _cfg(tiny_model_dir, tmp_path, sft={"steps": 2})
    path = tmp_path / "r"
    path.mkdir()
    _write_config(cfg, path)
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        assert worker.run(str(path), owns_pid=False) == 0
        good = (path / "config.yaml").read_text()
        (path / "config.yaml").write_text(good.replace("  lr: 0.001\n", "  lr: 0.0005\n", 1))
        expected = (f"{path / 'config.yaml'}: sft.lr is 0.0005 but the run trained with 0.001, which its checkpoint "
                    "keeps (a resume would ignore the new value); set it back to 0.001 to resume, or start a new "
                    "run with the new value")
        with pytest.raises(ConfigError) as e:
            api.resume(path, more=1)
        assert str(e.value) == expected
        assert settings.load_run_config(path / "config.yaml").sft.steps == 2  # refused before anything changed
        assert worker.run(str(path), resume=True, owns_pid=False) == 2
        assert read_events(path / "events.jsonl")[-1]["message"] == expected
        (path / "config.yaml").write_text(good.replace("  steps: 2\n", "  steps: 3\n", 1)
                                          .replace("  eval_every: 0\n", "  eval_every: 1\n", 1))
        before = read_events(path / "events.jsonl")[-1]["i"]
        assert worker.run(str(path), resume=True, owns_pid=False) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    after = [e for e in read_events(path / "events.jsonl") if e["i"] > before]
    assert after[0]["type"] == "started" and after[0]["changed"] == {"sft.steps": [2, 3], "sft.eval_every": [0, 1]}
    assert [e["step"] for e in after if e["type"] == "step"] == [3] and any(e["type"] == "eval" for e in after)
    assert after[-1]["type"] == "finished"


def test_a_data_file_or_base_replaced_since_the_run_trained_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """The run records its input files' checksums; the data file replaced (an upload of the
    same name with 24 rows instead of 40) is refused by resume and by the worker, the base's
    weights replaced by a merged export; the adapter alone still exports."""
    from edgetune.engine.core.errors import RunError

    from edgetune.engine.run import worker

    data = tmp_path / "rows.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "completion": f"{i + 1}"}) + "\n" for i in range(40)]
    data.write_text("".join(rows))
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    cfg = _cfg(base, tmp_path, data={"path": str(data)}, sft={"steps": 2})
    path = tmp_path / "r"
    path.mkdir()
    _write_config(cfg, path)
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        assert worker.run(str(path), owns_pid=False) == 0
        recorded = json.loads((path / "inputs.json").read_text())
        assert recorded[str(data)]["setting"] == "data.path"
        assert recorded[str(base / "model.safetensors")]["setting"] == "model.name"
        data.write_text("".join(rows[:24]))
        expected = (f"{data}: has changed since run 'r' trained on it (data.path); put the original file back, or "
                    "start a new run on the new one")
        with pytest.raises(ConfigError) as e:
            api.resume(path, more=1)
        assert str(e.value) == expected
        assert worker.run(str(path), resume=True, owns_pid=False) == 2
        assert read_events(path / "events.jsonl")[-1]["message"] == expected
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    data.write_text("".join(rows))
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(RunError) as e:
        api.export(path, tmp_path / "merged", merged=True)
    assert str(e.value) == (f"{weights}: has changed since run 'r' trained on it (model.name); put the original "
                            "file back, or start a new run on the new one")
    assert not (tmp_path / "merged").exists()
    assert api.export(path, tmp_path / "adapter-only") == tmp_path / "adapter-only"  # reads no base


def test_a_data_link_retargeted_since_the_run_trained_is_refused_and_a_lost_inputs_json_is_named(tiny_model_dir,
                                                                                                 tmp_path):
    from edgetune.engine.run import worker

    rows = [json.dumps({"prompt": f"What is {i} + 1?", "completion": f"{i + 1}"}) + "\n" for i in range(40)]
    (tmp_path / "a.jsonl").write_text("".join(rows))
    (tmp_path / "b.jsonl").write_text("".join(reversed(rows)))
    link = tmp_path / "data.jsonl"
    link.symlink_to(tmp_path / "a.jsonl")
    cfg = _cfg(tiny_model_dir, tmp_path, data={"path": str(link)}, sft={"steps": 2})
    path = tmp_path / "r"
    path.mkdir()
    _write_config(cfg, path)
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        assert worker.run(str(path), owns_pid=False) == 0
        link.unlink()
        link.symlink_to(tmp_path / "b.jsonl")  # other rows under the same name
        with pytest.raises(ConfigError) as e:
            api.resume(path, more=1)
        assert str(e.value) == (f"{link}: leads to {tmp_path / 'b.jsonl'} now, not to {tmp_path / 'a.jsonl'} as when "
                                "run 'r' trained on it (data.path); point it back, or start a new run on the new file")
        assert api.load_run_config(path / "config.yaml").sft.steps == 2 and api.Run(path).status() == "finished"
        link.unlink()
        link.symlink_to(tmp_path / "a.jsonl")
        (path / "inputs.json").write_text('{"cut')  # damaged: the check cannot be made, and says so
        api.more_steps(api.Run(path), api.load_run_config(path / "config.yaml"), 1)
        assert worker.run(str(path), resume=True, owns_pid=False) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    warned = [e["message"] for e in read_events(path / "events.jsonl") if e["type"] == "warning"]
    assert any(w.startswith(f"{path / 'inputs.json'}: damaged (") and "cannot be checked" in w for w in warned)
    assert str(link) in json.loads((path / "inputs.json").read_text())  # recorded anew, under the link's name


def test_a_run_folder_made_unwritable_mid_run_is_the_users_condition_in_one_line(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    from edgetune.engine.training import loop

    from edgetune.engine.run import worker

    cfg = _cfg(tiny_model_dir, tmp_path, sft={"steps": 3}, run={"checkpoint_every": 1})
    path = tmp_path / "r"
    path.mkdir()
    _write_config(cfg, path)

    def refused(ctx, step, *a, **k):  # as the file system answers once the folder is read-only or not ours
        raise PermissionError(13, "Permission denied", str(path / "checkpoints" / f"step-{step}"))

    monkeypatch.setattr(loop, "save_checkpoint", refused)
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        assert worker.run(str(path), owns_pid=False) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    err = read_events(path / "events.jsonl")[-1]
    assert err["type"] == "error" and err["kind"] == "input", err
    assert err["message"].startswith(f"{path / 'checkpoints' / 'step-'}") and err["message"].endswith(
        f": cannot write there (Permission denied); make the run folder writable, then edgetune resume {path}")


def test_resume_names_the_checkpoint_it_uses_and_an_edited_lora_r(tiny_model_dir, tmp_path):
    """The CLI's resume line names the checkpoint the worker continued from, not a newer
    damaged one it skipped; a config.yaml whose lora.r was edited after the checkpoint is
    refused naming the setting, by resume and, behind it, by the worker itself."""
    cfg = _cfg(tiny_model_dir, tmp_path, run={"checkpoint_every": 2, "keep_checkpoints": 3})
    path = tmp_path / "r"
    _sft(cfg, path, stop_after=4)
    _write_config(cfg, path)
    good = (path / "config.yaml").read_text()
    (path / "config.yaml").write_text(good.replace("  r: 8\n", "  r: 4\n", 1))
    expected = f"{path / 'config.yaml'}: lora.r is 4, but checkpoint step-4 was trained with 8"
    with pytest.raises(ConfigError, match=expected):
        api.resume(path)
    from edgetune.engine.run import worker

    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        assert worker.run(str(path), resume=True, owns_pid=False) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert read_events(path / "events.jsonl")[-1]["message"].startswith(expected)

    (path / "config.yaml").write_text(good)
    state = path / "checkpoints" / "step-4" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "resume", str(path)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("Resumed")]
    assert said == ["Resumed r from its step-2 checkpoint."], p.stdout
    assert f"warning: checkpoint {state.parent} is damaged, skipped" in p.stdout


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_is_refused_and_never_run(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, run={"checkpoint_every": 2, "keep_checkpoints": 3})
    path = tmp_path / "r"
    _sft(cfg, path, stop_after=2)
    _write_config(cfg, path)
    copied = tmp_path / "copied"
    shutil.copytree(path, copied)
    marker = tmp_path / "PWNED"
    state = copied / "checkpoints" / "step-2" / "training_state.pt"
    good = torch.load(state, weights_only=True)
    torch.save({**good, "extra": _Payload(marker)}, state)
    with pytest.raises(CheckpointError, match="training_state.pt: unreadable or unsafe"):
        pick_checkpoint(RunDir(copied), lambda m: None)
    assert not marker.exists()

    run = _resume_in_worker(copied)  # the CLI and the app resume through the same worker
    events = read_events(copied / "events.jsonl")
    assert run.status() == "failed" and events[-1]["type"] == "error" and events[-1]["kind"] == "input"
    assert str(state) in events[-1]["message"] and "no intact checkpoint" in events[-1]["message"]
    assert not marker.exists()
    p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "resume", str(copied)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and str(state) in p.stderr
    assert not marker.exists()


def test_damaged_event_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.emit("started", method="sft")
    w.emit("step", step=1)
    w.close()
    with open(path, "a") as f:
        f.write('{"i": 2, "time": 1, "type": "st')  # killed mid-write
    assert [e["i"] for e in read_events(path)] == [0, 1]  # an unfinished last line waits
    w = EventWriter(path)  # the resumed worker
    assert w.emit("started", method="sft")["i"] == 2
    w.emit("step", step=2)
    w.emit("finished", step=2, adapter="a", metrics={})
    w.close()
    with open(path, "a") as f:
        f.write("\x00\x00garbage\n")
    events, damaged = scan_events(path)
    assert [e["i"] for e in events] == [0, 1, 2, 3, 4] and damaged == 2
    assert [e["i"] for e in read_events(path, 3)] == [3, 4]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("method: sft\n")
    shutil.copy(path, run / "events.jsonl")
    s = api.Run(run).summary()
    assert s["status"] == "finished" and s["step"] == 2 and s["damaged_event_lines"] == 2


def test_leftovers_of_a_killed_write_are_removed_on_start(tiny_model_dir, tmp_path):
    from edgetune.engine.core.runfolder import clean_temporaries

    run = tmp_path / "r"
    (run / "checkpoints" / ".step-3.abc.tmp").mkdir(parents=True)
    (run / "checkpoints" / ".step-3.abc.tmp" / "adapter_model.safetensors").write_bytes(b"half")
    (run / ".adapter.x1.tmp").mkdir()
    (run / ".memory.json.y2.tmp").write_text("{")
    (run / "checkpoints" / ".step-2.old-123").mkdir()
    (run / "notes.tmp").write_text("the user's")  # not one of our names
    (run / "checkpoints" / "step-2").mkdir()
    removed = clean_temporaries(run)
    assert len(removed) == 4
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints", "notes.tmp", "step-2"]


# --------------------------------------------------------------------------- user reward functions


def _user_reward(tmp_path, body):
    from edgetune.engine.training.rewards import build_reward

    f = tmp_path / "reward.py"
    f.write_text("import math, time\n\ndef reward(completion, answer, row):\n" + body)
    return build_reward("file", str(f))


def test_user_reward_that_raises_hangs_or_returns_nan_costs_only_that_completion(tmp_path, monkeypatch):
    from edgetune.engine.training import rewards

    monkeypatch.setattr(rewards, "USER_REWARD_TIMEOUT_S", 0.5)
    r = _user_reward(tmp_path, "    if completion == 'raise': raise KeyError('no such key')\n"
                               "    if completion == 'hang': time.sleep(60)\n"
                               "    if completion == 'nan': return math.nan\n"
                               "    return 1.0\n")
    t0 = time.time()
    s = r.score(["ok", "raise", "hang", "nan", "ok"], [{"answer": "1"}] * 5)
    assert time.time() - t0 < 5
    assert s.rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert s.errors[0] is None and s.errors[4] is None
    assert "KeyError" in s.errors[1] and "TimeoutError: took longer than 0.5 s" in s.errors[2]
    assert "returned nan" in s.errors[3]


def test_user_reward_that_catches_the_timeout_is_still_stopped(tmp_path, monkeypatch):
    """The limit is a kill of the reward's process: a function that swallows every
    exception and retries forever costs its completion reward 0 within the limit, and
    the next completion is scored by a fresh process."""
    from edgetune.engine.training import rewards

    monkeypatch.setattr(rewards, "USER_REWARD_TIMEOUT_S", 0.5)
    r = _user_reward(tmp_path, "    print('scoring', completion)  # prints go to the log, not the scores\n"
                               "    while completion == 'hang':\n"
                               "        try:\n"
                               "            time.sleep(60)\n"
                               "        except BaseException:\n"
                               "            pass\n"
                               "    return 1.0\n")
    first = r.parts[0][0].score.worker.proc
    t0 = time.time()
    s = r.score(["hang", "ok"], [{"answer": "1"}] * 2)
    assert time.time() - t0 < 5
    assert s.rewards == [0.0, 1.0]
    assert s.errors == ["file: TimeoutError: took longer than 0.5 s", None]
    assert first.poll() is not None  # killed, not left running


def test_what_a_user_reward_starts_ends_with_the_step_and_what_it_prints_is_capped(tmp_path, monkeypatch, capfd):
    """A reward that starts a process and leaves it running, forks a copy of itself that
    returns too, and prints 10 kB a call: the step's scores are the function's own, the
    processes it left end with the step, and the log takes what the cap allows."""
    from edgetune.engine.core.runfolder import pid_alive

    from edgetune.engine.training import rewards

    monkeypatch.setattr(rewards, "USER_REWARD_LOG_CAP_BYTES", 4096)
    pids = tmp_path / "pids"
    r = _user_reward(tmp_path, "    import os, subprocess\n"
                               "    left = subprocess.Popen(['sleep', '300'])\n"
                               f"    open({str(pids)!r}, 'a').write(f'{{left.pid}}\\n')\n"
                               "    fork = os.fork()\n"
                               "    if fork == 0:\n"
                               "        return 0.5  # the fork returns into the reward process's loop\n"
                               f"    open({str(pids)!r}, 'a').write(f'{{fork}}\\n')\n"
                               "    print('x' * 10_000, flush=True)\n"
                               "    return 1.0\n")
    s = r.score(["a", "b", "c"], [{"answer": "1"}] * 3)
    assert s.rewards == [1.0, 1.0, 1.0] and s.errors == [None, None, None]
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 6
    t0 = time.time()
    while any(pid_alive(p) for p in started) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert not [p for p in started if pid_alive(p)]  # ended with the step
    assert r.parts[0][0].score.worker.proc.poll() is None  # the reward process itself serves the next step
    time.sleep(0.5)  # what it printed reaches the log through a thread of this process
    err = capfd.readouterr().err
    assert err.count("x") == 4096
    assert f"[reward_file {tmp_path / 'reward.py'}: what it prints past 4,096 bytes is left out of this log]" in err
    r.parts[0][0].score.worker.close()


def test_what_a_user_reward_starts_in_a_session_of_its_own_ends_with_the_step(tmp_path):
    """A process started in a new session, and one whose parent exits at once (a daemon's
    double fork), are not in the reward process's group: they end with the step all the same."""
    from edgetune.engine.core.runfolder import pid_alive

    pids = tmp_path / "pids"
    r = _user_reward(tmp_path, "    import subprocess\n"
                               "    away = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
                               f"    open({str(pids)!r}, 'a').write(f'{{away.pid}}\\n')\n"
                               f"    subprocess.run(['sh', '-c', 'setsid sleep 300 >/dev/null 2>&1 & echo $! >> {pids}'])\n"
                               "    return 1.0\n")
    s = r.score(["a", "b"], [{"answer": "1"}] * 2)
    assert s.rewards == [1.0, 1.0]
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 4
    t0 = time.time()
    while any(pid_alive(p) for p in started) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert not [p for p in started if pid_alive(p)]
    r.parts[0][0].score.worker.close()


def test_a_user_reward_whose_process_exits_while_a_fork_holds_its_pipe_is_reported_at_once(tmp_path, monkeypatch):
    from edgetune.engine.core.runfolder import pid_alive

    from edgetune.engine.training import rewards

    monkeypatch.setattr(rewards, "USER_REWARD_TIMEOUT_S", 30.0)
    pids = tmp_path / "pids"
    r = _user_reward(tmp_path, "    import os\n"
                               "    if completion == 'exit':\n"
                               "        child = os.fork()\n"
                               "        if child == 0:\n"
                               "            time.sleep(300)\n"
                               "            os._exit(0)\n"
                               f"        open({str(pids)!r}, 'a').write(f'{{child}}\\n')\n"
                               "        os._exit(3)\n"
                               "    return 1.0\n")
    s = r.score(["exit", "ok"], [{"answer": "1"}] * 2)
    assert s.rewards == [0.0, 1.0]
    assert s.errors == ["file: RuntimeError: the reward process ended (exit status 3)", None]  # not a timeout
    (fork,) = [int(x) for x in pids.read_text().split()]
    r.parts[0][0].score.worker.close()
    t0 = time.time()
    while pid_alive(fork) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert not pid_alive(fork)


def test_user_reward_calling_sys_exit_stops_in_one_line_naming_the_file(tmp_path):
    from edgetune.engine.core.errors import ConfigError

    from edgetune.engine.training import rewards

    r = _user_reward(tmp_path, "    import sys\n    sys.exit(3)\n")
    with pytest.raises(rewards.RewardFailing) as e:
        r.score(["x"], [{"answer": "1"}])
    assert str(e.value) == (f"reward_file {tmp_path / 'reward.py'}: reward() called sys.exit(3); a reward returns "
                            "a number (raise an exception to score a completion 0)")
    (tmp_path / "at_import.py").write_text("import sys\nsys.exit(4)\n")
    with pytest.raises(ConfigError, match=r"at_import.py: fails to load: it calls sys.exit\(4\)$"):
        rewards.build_reward("file", str(tmp_path / "at_import.py"))


def test_user_reward_failing_in_a_row_stops_with_the_reason(tmp_path, monkeypatch):
    from edgetune.engine.training import rewards

    monkeypatch.setattr(rewards, "USER_REWARD_MAX_CONSECUTIVE_FAILURES", 3)
    r = _user_reward(tmp_path, "    return 1.0 if completion == 'ok' else 1 / 0\n")
    s = r.score(["x", "x", "ok", "x", "x", "ok"], [{"answer": "1"}] * 6)  # a success resets the count
    assert s.rewards == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    with pytest.raises(rewards.RewardFailing, match=r"reward.py: failed on 3 completions in a row "
                                                    r"\(last: ZeroDivisionError: division by zero\)"):
        r.score(["x"] * 4, [{"answer": "1"}] * 4)


def test_fgrpo_run_with_a_broken_reward_stops_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    from edgetune.engine.training import rewards

    from edgetune.engine.methods.fgrpo import fgrpo

    monkeypatch.setattr(rewards, "USER_REWARD_MAX_CONSECUTIVE_FAILURES", 5)
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text("def reward(completion, answer, row):\n    raise RuntimeError('oops')\n")
    cfg = settings.resolve(overrides={
        "method": "fgrpo",
        "model": {"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8}, "data": {"path": str(tmp_path / "rl.jsonl"), "eval_fraction": 0.0},
        "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
        "fgrpo": {"num_generations": 4, "prompts_per_step": 2, "max_new_tokens": 4, "steps": 3, "reward": "file",
                  "reward_file": str(tmp_path / "reward.py"), "eval_prompts": 0},
    })
    with pytest.raises(rewards.RewardFailing, match="failed on 5 completions in a row .last: RuntimeError: oops"):
        run_inline(fgrpo.train, cfg, tmp_path / "r")
    assert not (tmp_path / "r" / "adapter").exists()


# --------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 320 KiB tmpfs: room for the run folder's small files, not for a checkpoint."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"needs permission to mount a tmpfs: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_the_users_condition_in_one_line(tiny_model_dir, tmp_path, small_disk):
    cfg = _cfg(tiny_model_dir, tmp_path, run={"runs_dir": str(small_disk / "runs"), "checkpoint_every": 1},
               lora={"r": 64, "alpha": 16})
    run = api.start(cfg, name="r")
    try:
        status = run.wait(300)
    finally:
        run.kill() if run.alive() else None
    events = read_events(run.dir.events_path)
    assert status == "failed", (run.dir.log_path.read_text()[-3000:], events[-3:])
    err = events[-1]
    assert err["type"] == "error" and err["kind"] == "input", err
    assert err["message"].startswith("no space left on ") and str(small_disk / "runs" / "r") in err["message"]
    assert "edgetune resume" in err["message"]
    assert not any(p.name.endswith(".tmp") for p in run.path.rglob("*"))  # the half-written checkpoint went


# --------------------------------------------------------------------------- kills and stops at the worst moment

# sitecustomize.py: pauses a worker on cue
HOOKS = os.path.join(os.path.dirname(__file__), "helpers", "fault_hooks")


def _start_paused(cfg, name, tmp_path, monkeypatch, fault, until=None):
    """Start a worker that pauses at `fault` (see helpers/fault_hooks/sitecustomize.py); return
    the run once it sits there."""
    marker = tmp_path / f"{name}.paused"
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", HOOKS)
        m.setenv("EDGETUNE_FAULT", fault)
        m.setenv("EDGETUNE_FAULT_MARKER", str(marker))
        if until is not None:
            m.setenv("EDGETUNE_FAULT_UNTIL", str(until))
        run = api.start(cfg, name=name)
    t0 = time.time()
    while not marker.exists():
        assert run.alive(), (run.dir.log_path.read_text()[-3000:] if run.dir.log_path.exists() else "no log")
        assert time.time() - t0 < 300, "the worker never reached the fault"
        time.sleep(0.1)
    return run


@pytest.fixture(scope="module")
def worker_losses(tiny_model_dir, tmp_path_factory):
    """Losses of the uninterrupted run in a worker process, the way every run below trains
    (the test process's own numerics may differ in the last bits: other threads, other imports)."""
    tmp = tmp_path_factory.mktemp("worker-full")
    run = api.start(_cfg(tiny_model_dir, tmp / "runs", run={"checkpoint_every": 2}), name="full")
    assert run.wait(300) == "finished"
    losses = _losses(read_events(run.dir.events_path))
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and len(set(losses.values())) == 6
    return losses


def _sigkill(run):
    os.killpg(run.process.pid, signal.SIGKILL)
    run.process.wait(30)
    assert run.status() == "crashed"


def _attempt(run_path, after_i):
    return [e for e in read_events(run_path / "events.jsonl") if e["i"] > after_i]


def _resume_to_end(path):
    before = read_events(path / "events.jsonl")[-1]["i"]
    run = api.resume(path)
    assert run.wait(300) == "finished", (path / "worker.log").read_text()[-3000:]
    return _attempt(path, before)


@pytest.mark.slow  # three workers (and the reference run's)
def test_sigkill_mid_step_resumes_from_the_last_checkpoint_with_the_same_losses(
        tiny_model_dir, tmp_path, monkeypatch, worker_losses):
    cfg = _cfg(tiny_model_dir, tmp_path / "runs", run={"checkpoint_every": 2})
    run = _start_paused(cfg, "r", tmp_path, monkeypatch, "step:4")  # after step 4's backward
    _sigkill(run)
    assert [s for s, _ in run.dir.list_checkpoints()] == [2]
    after = _resume_to_end(run.path)
    assert after[0]["type"] == "started" and after[0]["resumed_from"] == 2
    assert _losses(after) == {k: v for k, v in worker_losses.items() if k > 2}


@pytest.mark.slow  # two workers
def test_sigkill_mid_checkpoint_leaves_nothing_half_written(tiny_model_dir, tmp_path, monkeypatch, worker_losses):
    cfg = _cfg(tiny_model_dir, tmp_path / "runs", run={"checkpoint_every": 2})
    run = _start_paused(cfg, "r", tmp_path, monkeypatch, "save:2")  # writing step 4's checkpoint
    _sigkill(run)
    half = [p for p in run.dir.checkpoints.iterdir() if p.name.startswith(".step-4.")]
    assert half and (half[0] / "adapter_model.safetensors").is_file()  # the kill really was mid-write
    assert [s for s, _ in run.dir.list_checkpoints()] == [2]
    after = _resume_to_end(run.path)
    assert after[0]["resumed_from"] == 2
    assert not any(p.name.endswith(".tmp") for p in run.path.rglob("*"))
    assert _losses(after) == {k: v for k, v in worker_losses.items() if k > 2}


@pytest.mark.slow  # two workers
def test_stop_during_checkpointing_keeps_that_checkpoint(tiny_model_dir, tmp_path, monkeypatch, worker_losses):
    cfg = _cfg(tiny_model_dir, tmp_path / "runs", run={"checkpoint_every": 2})
    stop_file = tmp_path / "runs" / "r" / "STOP"
    run = _start_paused(cfg, "r", tmp_path, monkeypatch, "save:2", until=stop_file)
    run.stop()  # pressed while step 4's checkpoint is being written
    assert run.wait(120) == "stopped"
    events = read_events(run.dir.events_path)
    assert events[-1]["type"] == "stopped" and events[-1]["step"] == 4
    assert [e["step"] for e in events if e["type"] == "checkpoint"] == [2, 4]  # written once, whole
    after = _resume_to_end(run.path)
    assert after[0]["resumed_from"] == 4 and _losses(after) == {5: worker_losses[5], 6: worker_losses[6]}


def test_app_killed_while_a_run_trains_the_run_goes_on(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path / "runs", sft={"steps": 400})
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    app = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from edgetune.engine.run import api\n"
        f"run = api.start(api.resolve(config={str(tmp_path / 'cfg.yaml')!r}), name='r')\n"
        "print(run.path, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    path = app.stdout.readline().strip()
    run = api.Run(path)
    try:
        next(e for e in run.events(follow_live=True, timeout=300) if e["type"] == "step")
        app.send_signal(signal.SIGKILL)
        app.wait(30)
        # A new app process finds the run on disk, still training, and follows it live.
        again = api.active_run(tmp_path / "runs")
        assert again is not None and again.name == "r" and again.status() == "running"
        seen = read_events(again.dir.events_path)[-1]["i"]
        new = next(e for e in again.events(seen + 1, follow_live=True, timeout=120) if e["type"] == "step")
        assert new["i"] > seen
        again.stop()
        assert again.wait(120) == "stopped"
    finally:
        if run.alive():
            run.kill()
        if app.poll() is None:
            app.kill()


def test_cuda_out_of_memory_in_a_step_says_what_to_lower(tiny_model_dir, tmp_path):
    import torch.nn.modules.module as module_lib

    from edgetune.engine.run import worker

    cfg = _cfg(tiny_model_dir, tmp_path, run={"checkpoint_every": 2})
    path = tmp_path / "r"
    path.mkdir()
    (path / "config.yaml").write_text(cfg.to_yaml())
    calls = []

    def oom_on_fifth_forward(module, args, output):
        if type(module).__name__ == "LlamaModel":  # the decoder stack, once per forward
            calls.append(1)
            if len(calls) == 5:  # step 3, first micro-batch (grad_accum 2)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = module_lib.register_module_forward_hook(oom_on_fifth_forward)
    term = signal.getsignal(signal.SIGTERM)
    try:
        assert worker.run(str(path)) == 2
    finally:
        handle.remove()
        signal.signal(signal.SIGTERM, term)
    err = read_events(path / "events.jsonl")[-1]
    assert err["type"] == "error" and err["kind"] == "input"
    assert err["message"].startswith("out of GPU memory in step 3: set ")
    assert "the planner estimates" in err["message"] and " peak, against " in err["message"]
    assert "checkpoints up to step 2 are kept" in err["message"]
    assert RunDir(path).last_checkpoint()[0] == 2


def test_fgrpo_stop_between_checkpoints_resumes_from_that_step(tiny_model_dir, tmp_path):
    from test_fgrpo import config

    from edgetune.engine.methods.fgrpo import fgrpo

    files = tmp_path / "files"
    files.mkdir()
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (files / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (files / "reward.py").write_text("def reward(completion, answer, row):\n"
                                     "    return (sum(map(ord, completion)) % 7) / 6\n")
    cfg = config(tiny_model_dir, files, tmp_path, eval_prompts=0)  # run.checkpoint_every 0: only the stop's

    def steps(events):
        return [(e["step"], e["reward_mean"], e["loss"], e["grad_norm"]) for e in events if e["type"] == "step"]

    full = run_inline(fgrpo.train, cfg, tmp_path / "full")[2]
    first = run_inline(fgrpo.train, cfg, tmp_path / "cut", stop_after=1)[2]
    assert first[-1]["type"] == "stopped" and RunDir(tmp_path / "cut").last_checkpoint()[0] == 1
    second = [e for e in run_inline(fgrpo.train, cfg, tmp_path / "cut", resume=True)[2] if e["i"] > first[-1]["i"]]
    assert second[-1]["type"] == "finished" and [s[0] for s in steps(second)] == [2, 3]
    assert steps(first) + steps(second) == steps(full)


# --------------------------------------------------------------------------- a plan far beyond the machine


def test_a_plan_far_beyond_the_machine_is_refused_before_loading(tmp_path):
    """sft.batch_size and lora.r at their largest on the CPU: one line naming the settings, before
    the data check or the model load starts (no phase event), not gigabytes later."""
    from edgetune.engine.planning import planner

    from edgetune.engine.run import worker

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    cfg = settings.resolve(preset="sft-quickstart", overrides={
        "model": {"device": "cpu"}, "sft": {"batch_size": 2**16}, "lora": {"r": 4096},
        "run": {"runs_dir": str(tmp_path / "runs")}})
    (run / "config.yaml").write_text(cfg.to_yaml())
    term = signal.getsignal(signal.SIGTERM)
    try:
        t0 = time.time()
        assert worker.run(str(run)) == 2
        assert time.time() - t0 < 30
    finally:
        signal.signal(signal.SIGTERM, term)
    events = read_events(run / "events.jsonl")
    assert not [e for e in events if e["type"] == "phase"]
    msg = events[-1]["message"]
    assert events[-1]["type"] == "error" and events[-1]["kind"] == "input" and "\n" not in msg
    assert msg.startswith("the planner predicts ") and "far beyond this machine's RAM (" in msg
    from edgetune.engine.core.units import size

    assert f"({size(planner.host_memory())}); driven by sft.batch_size=65536, data.max_seq_len=256 " \
           "(edgetune estimate shows the parts)" in msg


def test_the_quickstarts_are_not_refused_on_a_small_machine():
    """The refusal is for settings typed wrong: every quick start passes on a 4 GiB machine."""
    from edgetune.engine.planning import planner

    for preset in ("sft-quickstart", "fgrpo-quickstart", "essa-quickstart", "dpo-quickstart"):
        planner.refuse_far_beyond(settings.resolve(preset=preset), "cpu", memory=4 * 2**30)


def test_a_seed_beyond_numpy_and_torch_is_one_line():
    from edgetune.engine.core.errors import ConfigError

    from edgetune.engine.training.loop import MAX_SEED, micro_batch_indices, seed_everything

    with pytest.raises(ConfigError) as e:
        seed_everything(2**70)
    assert str(e.value) == f"run.seed={2**70}: out of range (a seed is a whole number from 0 to {MAX_SEED})"
    seed_everything(MAX_SEED)  # the largest one works, and so do the streams drawn from it
    assert len(micro_batch_indices(10, 4, 7, MAX_SEED)) == 4
