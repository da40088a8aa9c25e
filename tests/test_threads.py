"""The CPU thread count of the processes edgetune starts: decided in one place
(engine/core/threads.py), kept when the user sets OMP_NUM_THREADS, and what a run's worker
really uses (its `started` event says so, and the log lines show it)."""

from __future__ import annotations

import time

from edgetune.engine.core import threads
from edgetune.engine.core.settings import resolve

from edgetune.engine.run import api


def test_half_the_cores_and_one_on_two():
    assert [threads.torch_threads(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    # the ranks of one run share the half: 8 ranks on 16 cores, one thread each
    assert [threads.torch_threads(16, processes=p) for p in (2, 8, 32)] == [4, 1, 1]
    assert threads.worker_env({}, processes=4)["OMP_NUM_THREADS"] == str(threads.torch_threads(processes=4))


def test_the_users_thread_count_is_kept():
    assert threads.worker_env({"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    env = threads.worker_env({"PATH": "/bin"}, PYTHONUNBUFFERED="1")
    assert env["OMP_NUM_THREADS"] == str(threads.torch_threads()) and env["PYTHONUNBUFFERED"] == "1"
    assert threads.worker_env({"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == str(threads.torch_threads())


def _started(run, timeout=240) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        ev = next((e for e in run.events() if e["type"] == "started"), None)
        if ev is not None:
            return ev
        assert run.alive(), (run.dir.log_path.read_text()[-2000:])
        time.sleep(0.2)
    raise AssertionError("no started event")


def test_a_worker_uses_the_decided_threads_unless_told(tmp_path, tiny_model_dir, monkeypatch):
    from edgetune.app import live

    sets = [f"model.name={tiny_model_dir}", "model.quant=none", "data.max_rows=16", "sft.steps=1",
            "sft.batch_size=2", "sft.eval_every=0", f"run.runs_dir={tmp_path}"]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = api.start(resolve(preset="sft-quickstart", overrides=sets))
    try:
        ev = _started(run)
        assert ev["device"] == "cpu" and ev["cpu_threads"] == threads.torch_threads()
        n = threads.torch_threads()
        assert f"started sft on cpu ({n} CPU thread{'s' if n != 1 else ''})" in live.log_lines([ev])
    finally:
        run.wait(120)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    told = api.start(resolve(preset="sft-quickstart", overrides=sets))
    try:
        assert _started(told)["cpu_threads"] == 2
    finally:
        told.wait(120)
