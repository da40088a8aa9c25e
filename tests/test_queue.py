"""The queue: its file read back as written and never half written; queued runs that run
one after another, each exactly once, across a driver killed mid-queue; a failed job that
does not stop the next; cancel and reorder from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from edgetune.engine.core.errors import RunError
from edgetune.engine.core.events import read_events

from edgetune.engine.run import api, queue


def _sets(tiny_model_dir, runs, steps=2):
    return [f"model.name={tiny_model_dir}", "model.quant=none", "data.max_rows=16", f"sft.steps={steps}",
            "sft.batch_size=2", "sft.eval_every=0", "run.checkpoint_every=0", f"run.runs_dir={runs}"]


def _queue_run(tiny_model_dir, runs, name, *more, steps=2):
    cfg = api.resolve(preset="sft-quickstart", overrides=_sets(tiny_model_dir, runs, steps) + [f"run.name={name}",
                                                                                               *more])
    return queue.add_run(cfg)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "edgetune.engine.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def _wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _fake_job(runs, folder):
    """A queued run that is never started (the embedded model and data: nothing is loaded)."""
    return queue.add_run(api.resolve(preset="sft-quickstart", overrides=[f"run.runs_dir={runs}",
                                                                         f"run.name={folder}"]))


def test_the_queue_file_reads_back_and_is_never_half_written(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    a, b = _fake_job(runs, "a"), _fake_job(runs, "a")
    assert (a["id"], b["id"]) == (1, 2) and (a["folder"], b["folder"]) == ("a", "a-2")  # a queued name is taken
    assert queue.jobs(runs) == [a, b]
    assert json.loads((runs / queue.QUEUE_FILE).read_text())["jobs"] == [a, b]
    before = (runs / queue.QUEUE_FILE).read_text()

    # a write that fails half way (the disk full as the new file is synced) leaves the old file whole
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(RunError, match="^nothing was queued: no space left on the device$"):
        _fake_job(runs, "c")
    monkeypatch.undo()
    assert (runs / queue.QUEUE_FILE).read_text() == before
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith(".edgetune-queue.json")) == [queue.QUEUE_FILE]
    # ids are never given twice, also after the last job left the queue
    queue.cancel(runs, 1)
    queue.cancel(runs, 2)
    assert _fake_job(runs, "d")["id"] == 3
    assert [h["status"] for h in queue.history(runs)] == ["cancelled", "cancelled"]
    # a damaged file is named, and left as it is
    (runs / queue.QUEUE_FILE).write_text('{"format": 1, "jobs": [')
    with pytest.raises(RunError, match=r"\.edgetune-queue\.json: the queue file cannot be read"):
        _fake_job(runs, "e")
    assert (runs / queue.QUEUE_FILE).read_text() == '{"format": 1, "jobs": ['
    p = _cli("queue", "list", "--runs-dir", str(runs))
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr


def test_cancel_and_reorder_from_the_command_line(tmp_path, capsys):
    from edgetune.engine import cli

    runs = tmp_path / "runs"
    assert cli.main(["train", "--preset", "sft-quickstart", "--name", "one", "--runs-dir", str(runs), "--queue",
                     "--set", "sft.steps=3"]) == 0
    assert "queued as job 1 (run folder " in capsys.readouterr().out
    assert not (runs / "one").exists()  # nothing starts: the folder appears when the job does
    assert api.load_run_config(queue.jobs(runs)[0]["settings"]).sft.steps == 3  # kept as queued
    for name in ("two", "three", "four"):
        _fake_job(runs, name)

    def order():
        return [j["folder"] for j in queue.jobs(runs)]

    assert cli.main(["queue", "down", "1", "--runs-dir", str(runs)]) == 0
    assert order() == ["two", "one", "three", "four"]
    assert cli.main(["queue", "up", "4", "--runs-dir", str(runs)]) == 0
    assert order() == ["two", "one", "four", "three"]
    assert cli.main(["queue", "move", "3", "--to", "1", "--runs-dir", str(runs)]) == 0
    assert order() == ["three", "two", "one", "four"]
    assert cli.main(["queue", "move", "2", "--to", "99", "--runs-dir", str(runs)]) == 0  # clamped to the end
    assert order() == ["three", "one", "four", "two"]
    assert cli.main(["queue", "cancel", "4", "--runs-dir", str(runs)]) == 0
    assert order() == ["three", "one", "two"]
    assert cli.main(["queue", "cancel", "4", "--runs-dir", str(runs)]) == 2  # gone: one line, no traceback
    assert cli.main(["queue", "move", "1", "--to", "0", "--runs-dir", str(runs)]) == 2  # places start at 1
    # a job that has started keeps its place and is not cancelled: its run is stopped instead
    with queue.editing(runs) as data:
        data["jobs"][0]["state"] = "started"
    with pytest.raises(RunError, match="job 3 has started"):
        queue.cancel(runs, 3)
    assert queue.move(runs, 2, 1) == 2  # never in front of the started job
    assert order() == ["three", "two", "one"]


def test_three_queued_runs_survive_a_killed_driver_and_run_once_each(tmp_path, tiny_model_dir):
    runs = tmp_path / "runs"
    for name in ("q1", "q2", "q3"):
        _queue_run(tiny_model_dir, runs, name, steps=6 if name == "q1" else 2)
    # a second driver is refused while one runs
    driver = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", "queue", "run", "--runs-dir", str(runs)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    _wait_for(lambda: (runs / "q1" / "events.jsonl").is_file(), 120, "the first run to start")
    p = _cli("queue", "run", "--runs-dir", str(runs))
    assert p.returncode == 2 and "already run by another process" in p.stderr
    # the driver dies (as the app or the machine would) while the first run trains
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    assert [j["folder"] for j in queue.jobs(runs)] == ["q1", "q2", "q3"]
    # the next driver (the app's, as `edgetune ui` runs it) waits for that run, records it,
    # then runs the others
    import threading

    done = threading.Event()
    app_driver = threading.Thread(target=queue.serve, args=(runs, done.is_set), daemon=True)
    app_driver.start()
    try:
        _wait_for(lambda: queue.jobs(runs) == [], 240, "the queue to empty")
    finally:
        done.set()
        app_driver.join(10)
    assert queue.driver_pid(runs) is None  # the app's driver lets go once the queue is empty
    assert [(h["folder"], h["status"]) for h in queue.history(runs)] == [("q1", "finished"), ("q2", "finished"),
                                                                         ("q3", "finished")]
    assert sorted(r.name for r in api.list_runs(runs)) == ["q1", "q2", "q3"]  # no second folder of any job
    for name in ("q1", "q2", "q3"):
        events = read_events(runs / name / "events.jsonl")
        assert [e["type"] for e in events].count("started") == 1, name  # each trained once
        assert events[-1]["type"] == "finished"
    assert not any((runs / queue.SPOOL).iterdir())  # the queued settings go with their jobs


def test_a_job_whose_folder_appeared_but_never_ran_runs_once(tmp_path, tiny_model_dir):
    """The driver died between making the run folder and starting its worker: the folder
    proves the job started, so the next driver starts that folder's worker (no new run)."""
    runs = tmp_path / "runs"
    job = _queue_run(tiny_model_dir, runs, "cut")
    cfg = api.load_run_config(job["settings"])
    cfg.run.name = job["folder"]
    _, fd = api.create(cfg, job["folder"], job=job["token"])
    os.close(fd)
    with queue.editing(runs) as data:
        data["jobs"][0]["state"] = "started"
    queue.Driver(runs).run()
    assert [r.name for r in api.list_runs(runs)] == ["cut"]
    assert [h["status"] for h in queue.history(runs)] == ["finished"]
    assert [e["type"] for e in read_events(runs / "cut" / "events.jsonl")].count("started") == 1


def test_a_failed_job_does_not_stop_the_next(tmp_path, tiny_model_dir):
    runs = tmp_path / "runs"
    gone = tmp_path / "gone.jsonl"
    gone.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n')
    _queue_run(tiny_model_dir, runs, "missing", f"data.path={gone}")
    _queue_run(tiny_model_dir, runs, "broken", f"data.path={bad}")
    _queue_run(tiny_model_dir, runs, "fine")
    gone.unlink()  # after it was queued: the job fails as it starts, before any run folder
    (runs / "fine").mkdir()  # a folder of the user's took the third job's name since: it is left alone
    (runs / "fine" / "notes.txt").write_text("mine")
    lines = []
    queue.Driver(runs, say=lines.append).run()
    assert sorted(p.name for p in (runs / "fine").iterdir()) == ["notes.txt"]
    ended = {h["folder"]: h for h in queue.history(runs)}
    assert ended["missing"]["status"] == "failed" and f"{gone}: data.path: file not found" in \
        ended["missing"]["message"]
    assert not (runs / "missing").exists()
    assert ended["broken"]["status"] == "failed" and "row 2" in ended["broken"]["message"]
    assert ended["fine-2"]["status"] == "finished"
    assert any(line.startswith("job 1: run missing failed: ") for line in lines), lines


def test_a_revived_job_whose_worker_never_spoke_is_recorded_not_started_again(tmp_path, tiny_model_dir):
    """A folder revived once whose worker again ended before its first event: recorded as
    failed, and the queue goes on (no third start of the same job)."""
    runs = tmp_path / "runs"
    job = _queue_run(tiny_model_dir, runs, "mute")
    cfg = api.load_run_config(job["settings"])
    _, fd = api.create(cfg, job["folder"], job=job["token"])
    os.close(fd)
    with queue.editing(runs) as data:
        data["jobs"][0].update(state="started", revived=True)
    queue.Driver(runs).run()
    assert [(h["folder"], h["status"]) for h in queue.history(runs)] == [("mute", "failed")]
    assert not (runs / "mute" / "events.jsonl").exists() and not (runs / "mute" / "worker.log").exists()


# --------------------------------------------------------------------------- a queue from elsewhere


def _plant(runs, tmp_path, *overrides, **job):
    """A queue file and settings as another user's (or a copied) runs folder holds them: in
    the form `add_run` writes, but recorded by no user of this machine."""
    import uuid

    token = uuid.uuid4().hex
    spool = runs / queue.SPOOL / f"{token}.yaml"
    spool.parent.mkdir(parents=True, exist_ok=True)
    spool.write_text(api.resolve(preset="sft-quickstart", overrides=[f"run.runs_dir={runs}", *overrides]).to_yaml())
    entry = {"id": 1, "token": token, "kind": "train", "folder": "planted", "cwd": str(tmp_path),
             "command": ["train", "--config", str(spool.resolve())], "settings": str(spool.resolve()),
             "state": "queued", **job}
    (runs / queue.QUEUE_FILE).write_text(json.dumps({"format": 1, "next_id": 2, "jobs": [entry], "history": []}))
    return entry


def test_a_planted_queue_job_runs_nothing_until_this_user_confirms_it(tmp_path):
    runs = tmp_path / "runs"
    marker = tmp_path / "RAN"
    reward = tmp_path / "reward.py"
    reward.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef reward(prompt, completion, **kw):\n    return 0.0\n")
    _plant(runs, tmp_path, "method=fgrpo", "fgrpo.reward=file", f"fgrpo.reward_file={reward}",
           "data.path=embedded:arith-rl")
    lines = []
    queue.Driver(runs, say=lines.append).run()  # returns: nothing it may run
    assert not marker.exists() and not (runs / "planted").exists()
    assert len(lines) == 1 and lines[0].startswith("job 1 (planted) waits: it was not queued by this user") \
        and f"it runs {reward} (fgrpo.reward_file)" in lines[0] and "edgetune queue confirm 1 --runs-dir" in lines[0]
    p = _cli("queue", "list", "--runs-dir", str(runs))
    assert p.returncode == 0 and "job 1 (planted) waits" in p.stdout
    from edgetune.app.ui import build_app  # the app's Queue section says the same

    section = build_app(str(runs)).edgetune_page.train_tab.queue
    assert lines[0] in section.section()[section.note]
    assert _cli("queue", "confirm", "1", "--runs-dir", str(runs)).returncode == 0
    assert queue.queued_here(queue.jobs(runs)[0])  # the user's word, kept outside the runs folder


def test_a_queued_job_whose_settings_changed_since_waits(tmp_path):
    runs = tmp_path / "runs"
    job = _fake_job(runs, "mine")
    assert queue.queued_here(job)
    spool = queue.jobs(runs)[0]["settings"]
    with open(spool, "a") as f:
        f.write("\n# edited by someone else\n")
    lines = []
    assert queue.Driver(runs, say=lines.append).step() == "empty"
    assert "job 1 (mine) waits" in lines[0] and not (runs / "mine").exists()


@pytest.mark.parametrize("field, value, said", [
    ("folder", "../escaped-run", "folder '../escaped-run' is not a plain run name"),
    ("folder", None, "folder None is not a plain run name"),
    ("command", ["export", "x", "--out", "/tmp/y"], "is not one edgetune train --queue makes"),
    ("cwd", 3, "its working folder 3 is not an absolute path"),
    ("id", "1", "its number is not a whole number"),
])
def test_a_queue_job_of_a_form_add_never_makes_is_refused_in_one_line(tmp_path, field, value, said):
    runs = tmp_path / "runs"
    _plant(runs, tmp_path, **{field: value})
    for args in (("queue", "list"), ("queue", "run"), ("queue", "cancel", "1")):
        p = _cli(*args, "--runs-dir", str(runs))
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and said in p.stderr, (args, p.stderr)
    assert not (tmp_path / "escaped-run").exists() and not (runs / "planted").exists()


def _started_job(runs, tiny_model_dir, name):
    """A queued run whose folder appeared and whose worker (this test's process) trains."""
    from edgetune.engine.core.events import EventWriter

    job = _queue_run(tiny_model_dir, runs, name)
    cfg = api.load_run_config(job["settings"])
    run, fd = api.create(cfg, job["folder"], job=job["token"])
    os.close(fd)
    w = EventWriter(run.events_path)
    w.emit("started", step=0)
    w.close()
    run.pid_path.write_text(str(os.getpid()))
    with queue.editing(runs) as data:
        data["jobs"][0]["state"] = "started"
    assert queue.Driver(runs).step() == "wait"  # the driver saw it train
    return run


def _finish(run):
    from edgetune.engine.core.events import EventWriter

    run.pid_path.unlink()
    w = EventWriter(run.events_path)
    w.emit("finished", step=2, metrics={})
    w.close()


def test_a_queued_run_renamed_after_it_started_is_recorded_under_its_new_name_not_run_again(tmp_path,
                                                                                              tiny_model_dir):
    runs = tmp_path / "runs"
    run = _started_job(runs, tiny_model_dir, "first")
    _finish(run)
    api.rename_run(run.path, "renamed")
    queue.Driver(runs).run()
    assert [(h["folder"], h["status"]) for h in queue.history(runs)] == [("renamed", "finished")]
    assert [r.name for r in api.list_runs(runs)] == ["renamed"]  # no second run under the old name


def test_a_queued_run_deleted_after_it_started_is_never_started_again(tmp_path, tiny_model_dir):
    import shutil

    runs = tmp_path / "runs"
    run = _started_job(runs, tiny_model_dir, "gone")
    shutil.rmtree(run.path)
    queue.Driver(runs).run()
    assert [(h["folder"], h["status"]) for h in queue.history(runs)] == [("gone", "deleted")]
    assert api.list_runs(runs) == []
    run = _started_job(runs, tiny_model_dir, "trashed")
    _finish(run)
    api.trash_run(run.path)
    queue.Driver(runs).run()
    assert queue.history(runs)[-1]["status"] == "finished" and ".trash" in queue.history(runs)[-1]["message"]
    assert api.list_runs(runs) == []
