"""engine/models/startup.py and its use in engine/models/model.load: the garbage collector comes back on
after start-up whatever happens, and an error of the side-thread import reaches the caller."""

from __future__ import annotations

import gc
import os
import sys

import pytest

from edgetune.engine.core.errors import ModelError
from edgetune.engine.core.settings import from_dict

from edgetune.engine.models import model as model_lib
from edgetune.engine.models import startup


@pytest.fixture(autouse=True)
def _collector_on():
    assert gc.isenabled()
    yield
    assert gc.isenabled()


@pytest.fixture
def bad_module(tmp_path, monkeypatch):
    """A module whose import raises ValueError('broken at import')."""
    (tmp_path / "edgetune_broken_mod.py").write_text("raise ValueError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "edgetune_broken_mod"
    sys.modules.pop("edgetune_broken_mod", None)


def _cfg(name: str):
    return from_dict({"method": "sft", "model": {"name": name, "quant": "nf4", "gradient_checkpointing": True},
                      "lora": {"r": 4, "alpha": 8}, "data": {"path": "unused.jsonl"}})


def test_paused_gc_is_off_inside_and_on_after_an_error():
    frozen = gc.get_freeze_count()
    with pytest.raises(ImportError):
        with startup.paused_gc():
            assert not gc.isenabled()
            import edgetune_no_such_module  # noqa: F401
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen  # a block freezes nothing (it may hold tensors)


def test_imports_done_freezes_what_the_imports_made_alive():
    frozen = gc.get_freeze_count()
    try:
        startup.pause_gc()
        keep = [[i] for i in range(1000)]
        startup.imports_done()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(keep)  # out of every later collection's walk
    finally:
        startup.resume_gc()
        gc.unfreeze()


def test_imports_done_without_a_pause_changes_nothing():
    frozen = gc.get_freeze_count()
    startup.imports_done()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_inner_block_leaves_the_outer_pause_to_its_owner():
    startup.pause_gc()
    try:
        with startup.paused_gc():
            pass
        assert not gc.isenabled()  # the worker's pause outlives model.load's nested one
    finally:
        startup.resume_gc()
    assert gc.isenabled()


def test_gc_back_on_after_load_fails(tmp_path, monkeypatch):
    seen = []

    def failing_load_base(ms):
        seen.append(gc.isenabled())
        raise ModelError("cannot load")

    monkeypatch.setattr(model_lib, "load_base", failing_load_base)
    with pytest.raises(ModelError, match="cannot load"):
        model_lib.load(_cfg(str(tmp_path)))
    assert seen == [False]  # off during the load, on again after the failure


def test_gc_back_on_after_a_real_missing_model(tmp_path):
    with pytest.raises(ModelError):
        model_lib.load(_cfg(str(tmp_path / "no-such-model")))


def test_background_import_error_reaches_the_caller(bad_module):
    job = startup.BackgroundImport(bad_module)
    with pytest.raises(ValueError, match="broken at import"):
        job.wait()


def test_background_import_imports():
    sys.modules.pop("colorsys", None)
    startup.BackgroundImport("colorsys").wait()
    assert sys.modules["colorsys"].rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)


def test_import_deadlock_is_retried_on_the_caller():
    job = startup.BackgroundImport("colorsys")
    job.thread.join()
    job.error = RuntimeError("deadlock detected by _ModuleLock('colorsys')")  # what importlib raises
    sys.modules.pop("colorsys", None)
    job.wait()
    assert "colorsys" in sys.modules


def test_load_raises_the_side_import_error_with_gc_on(bad_module, tmp_path, monkeypatch):
    """model.load's peft import fails on its thread: the error is load's, the collector on."""
    real = startup.BackgroundImport
    monkeypatch.setattr(startup, "BackgroundImport", lambda *names: real(bad_module))
    monkeypatch.delitem(sys.modules, "peft", raising=False)  # so load starts its import
    monkeypatch.setattr(model_lib, "import_bitsandbytes", lambda: None)
    monkeypatch.setattr(model_lib, "load_base", lambda ms: ("model", "tok", "path"))
    added = []
    monkeypatch.setattr(model_lib, "add_lora", lambda *a, **k: added.append(a))
    with pytest.raises(ValueError, match="broken at import"):
        model_lib.load(_cfg(str(tmp_path)))
    assert added == []  # never reached


def _run_folder(tmp_path, model: str):
    from edgetune.engine.core.settings import resolve

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1 plus 2?", "completion": "3"}\n')
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    cfg = resolve(preset="sft-quickstart", overrides=[f"model.name={model}", f"data.path={data}",
                                                      f"run.runs_dir={tmp_path / 'runs'}"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    return run


def _worker_run(run) -> int:
    import signal

    from edgetune.engine.run import worker

    term = signal.getsignal(signal.SIGTERM)
    try:
        return worker.run(str(run))
    finally:
        signal.signal(signal.SIGTERM, term)


def test_worker_imports_with_gc_off_and_trains_with_it_on(tmp_path, monkeypatch):
    """The worker's imports run with the collector off; the method's train (which loads the
    model, here a missing one) starts with it on again; the run fails as an input error."""
    from edgetune.engine.methods.sft import sft

    from edgetune.engine.run import worker

    seen = {}
    real_module, real_train = worker.method_module, sft.train

    def method_module(method):
        seen["importing"] = gc.isenabled()
        return real_module(method)

    def train(ctx):
        seen["training"] = gc.isenabled()
        return real_train(ctx)

    monkeypatch.setattr(worker, "method_module", method_module)
    monkeypatch.setattr(sft, "train", train)
    frozen = gc.get_freeze_count()
    try:
        assert _worker_run(_run_folder(tmp_path, str(tmp_path / "no-such-model"))) == 2
        assert seen == {"importing": False, "training": True}
        assert gc.get_freeze_count() > frozen  # the imports' objects are out of the collector's walks
    finally:
        gc.unfreeze()


def test_worker_gc_back_on_when_its_imports_fail(tmp_path, monkeypatch):
    from edgetune.engine.run import worker

    def broken(method):
        assert not gc.isenabled()
        raise ImportError("no such method module")

    monkeypatch.setattr(worker, "method_module", broken)
    assert _worker_run(_run_folder(tmp_path, str(tmp_path / "no-such-model"))) == 1  # a bug, said in events


def test_kernel_caches_live_under_the_edgetune_cache_unless_the_user_chose(monkeypatch, tmp_path):
    from edgetune.engine.models import startup as st

    for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/of/theirs")
    st.kernel_caches(tmp_path)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/of/theirs"
