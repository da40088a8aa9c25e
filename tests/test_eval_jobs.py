"""An evaluation job runs in its own process beside the runs: a handle made afresh (a reloaded
page, a restarted app) finds its progress and its saved result; a stop ends it without a
result; a bad request ends it with one line."""

import json
import os
import time

import pytest

from edgetune.engine.core.errors import RunError
from edgetune.engine.core.runfolder import lock_runs_folder
from edgetune.engine.core.settings import resolve

from edgetune.engine.run import api, eval_jobs


def _cfg(tiny_model_dir, tmp_path, *more):
    return resolve(preset="fgrpo-quickstart", overrides=[
        f"model.name={tiny_model_dir}", "model.quant=none", "fgrpo.eval_k=0", f"run.runs_dir={tmp_path / 'runs'}",
        *more])


def _until(job, check, seconds=240):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if check(job):
            return
        time.sleep(0.2)
    raise AssertionError(f"{job.path}: {job.status()} {job.progress()} {(job.path / 'worker.log').read_text()[-2000:]}")


def test_a_job_saves_its_result_where_a_fresh_handle_finds_it(tiny_model_dir, tmp_path):
    runs = tmp_path / "runs"
    cfg = _cfg(tiny_model_dir, tmp_path, "fgrpo.eval_prompts=3", "fgrpo.max_new_tokens=4")
    job = eval_jobs.start(cfg, True, [], ["held-out"], runs)
    assert job.path.parent == runs / ".evaluations" and job.status() == "running"
    assert job.wait(240) == "finished", (job.path / "worker.log").read_text()[-2000:]
    again = eval_jobs.list_evals(runs)[0]  # what a reloaded page sees
    assert again.path == job.path and again.process is None and again.status() == "finished"
    (task,) = again.result()["tasks"]
    assert task["task"] == "held-out" and task["prompts"] == 3 and task["systems"][0]["name"] == "the base"
    assert again.progress() == {"system": "the base", "index": 0, "systems": 1, "task": "held-out", "done": 3,
                                "total": 3}
    assert again.request()["tasks"] == ["held-out"] and eval_jobs.active_eval(runs) is None
    assert not (runs / "config.yaml").exists() and (job.path / "config.yaml").is_file()


def test_a_stopped_job_ends_without_a_result_and_a_bad_one_says_why(tiny_model_dir, tmp_path):
    runs = tmp_path / "runs"
    cfg = _cfg(tiny_model_dir, tmp_path, "fgrpo.eval_prompts=30", "fgrpo.max_new_tokens=200")
    job = eval_jobs.start(cfg, True, [], ["held-out"], runs)
    _until(job, lambda j: j.progress().get("total"))  # the model is loaded and grading
    fresh = eval_jobs.EvalJob(job.path)  # stopped from another handle, as a reloaded page would
    assert fresh.status() == "running" and eval_jobs.active_eval(runs).path == job.path
    # it holds the runs folder's lock: no run starts (the queue waits), no second evaluation
    with pytest.raises(RunError, match=f"the evaluation {job.name} is running in {runs}"):
        api.create(cfg)
    with pytest.raises(RunError, match=f"the evaluation {job.name} is running in {runs} \\(one job on the device"):
        eval_jobs.start(cfg, True, [], ["held-out"], runs)
    fresh.stop()
    job.wait(60)
    assert fresh.status() == "stopped" and not (job.path / "result.json").exists()
    assert eval_jobs.active_eval(runs) is None
    fd = lock_runs_folder(runs)  # the lock went with the job's process
    assert fd is not None
    os.close(fd)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    job = eval_jobs.start(cfg, True, [], [str(bad)], runs)
    assert job.wait(120) == "failed"
    assert job.error() == f"{bad}, row 2: missing 'answer' (columns: ['prompt'])"
    assert [j.status() for j in eval_jobs.list_evals(runs)] == ["failed", "stopped"]


def test_a_stop_that_a_library_turns_into_another_error_is_still_a_stop(tmp_path, monkeypatch):
    """The stop's SIGTERM may land inside an import (the model loading), where the library's
    half-imported module then fails with another error (numpy: a RecursionError): the job
    says stopped, not failed; an error with no stop asked says failed."""
    import signal

    from edgetune.engine.run import evaluation

    def compare(*_, **__):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            raise RecursionError("maximum recursion depth exceeded") from None

    monkeypatch.setattr(evaluation, "compare", compare)
    cfg = _cfg("unused-model", tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        for name in ("stopped", "failed"):
            path = tmp_path / name
            path.mkdir()
            (path / "config.yaml").write_text(cfg.to_yaml())
            (path / "request.json").write_text(json.dumps({"base": True, "adapters": [], "tasks": ["held-out"]}))
            if name == "failed":  # no stop asked (a job is one process): the same error is its failure
                monkeypatch.setattr(evaluation, "compare", lambda *_, **__: (_ for _ in ()).throw(RecursionError("deep")))
            assert eval_jobs._run(path) == (130 if name == "stopped" else 1)
            assert eval_jobs.EvalJob(path).status() == name
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (tmp_path / "failed" / "error.txt").read_text().startswith("RecursionError: deep")


def test_a_large_task_file_says_its_size_before_it_starts_and_the_app_asks(tiny_model_dir, tmp_path, capsys):
    from edgetune.engine.core.errors import EdgetuneError

    from edgetune.engine import cli

    runs = tmp_path / "runs"
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(1500)))
    cfg = _cfg(tiny_model_dir, tmp_path, "fgrpo.max_new_tokens=4")
    with pytest.raises(EdgetuneError) as e:
        eval_jobs.start(cfg, True, [], [str(big)], runs)
    assert str(e.value) == (f"{big}: 1,500 prompts x 1 system = 1,500 completions of up to 4 new tokens each (up to "
                            "6,000 tokens to generate; bench/README.md has generation speeds): a long evaluation; to "
                            "start it, tick 'Start a long evaluation' and Start again")
    assert not (runs / ".evaluations").exists()
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(3)))
    assert cli.main(["eval", "--preset", "fgrpo-quickstart", "--set", f"model.name={tiny_model_dir}", "--set",
                     "model.quant=none", "--set", "fgrpo.eval_k=0", "--set", "fgrpo.max_new_tokens=4", "--base",
                     "--task", str(small), "--json"]) == 0
    assert f"{small}: 3 prompts x 1 system = 3 completions of up to 4 new tokens each" in capsys.readouterr().err
