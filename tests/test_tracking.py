"""run.report_to: the worker mirrors the numbers of events.jsonl into TensorBoard (read back
here with TensorBoard's own reader), `none` writes nothing, a missing library is refused in
one line, a failing backend is one warning and the run goes on, a resumed run appends.
The worker runs in this process on the tiny model (tests/conftest.py)."""

import json
import signal
import sys

import numpy as np
import pytest
from inline_run import sft_config

from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.events import read_events
from edgetune.engine.core.settings import resolve

from edgetune.engine.methods.sft import sft

from edgetune.engine.run import api, worker

SFT_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/host_rss",
            "train/gpu/allocated", "train/gpu/reserved", "train/gpu/peak", "train/gpu/total", "eval/eval_loss"}


def _train(cfg, path, resume=False) -> int:
    """What `edgetune train` / `resume` start, in this process: the run folder's config, then the worker."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(cfg.to_yaml())
    term = signal.getsignal(signal.SIGTERM)  # the worker sets its own: stop gracefully
    try:
        return worker.run(str(path), resume=resume, owns_pid=False)
    finally:
        signal.signal(signal.SIGTERM, term)


def _board(path) -> dict:
    """{tag: [(step, value), ...]} as TensorBoard reads <run>/tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _series(events, type, field, key=None) -> list:
    """(step, value) of one field of the events of one type, as TensorBoard stores it (float32)."""
    out = []
    for e in events:
        if e["type"] == type and field in e:
            v = e[field][key] if key else e[field]
            out.append((e["step"], float(np.float32(v))))
    return out


def _sft_cfg(tiny_model_dir, tmp_path, **run):
    return sft_config(tiny_model_dir, tmp_path, sft={"steps": 4, "eval_every": 2},
                      data={"eval_fraction": 0.1}, run={"checkpoint_every": 0, **run})


def test_sft_scalars_in_tensorboard_equal_the_events(tiny_model_dir, tmp_path):
    path = tmp_path / "r"
    assert _train(_sft_cfg(tiny_model_dir, tmp_path), path) == 0
    events = read_events(path / "events.jsonl")
    assert events[-1]["type"] == "finished"
    board = _board(path)
    assert set(board) == SFT_TAGS
    for field in ("loss", "lr", "grad_norm", "tokens_per_s", "host_rss"):
        assert board[f"train/{field}"] == _series(events, "step", field), field
        assert [s for s, _ in board[f"train/{field}"]] == [1, 2, 3, 4]
    for key in ("allocated", "reserved", "peak", "total"):
        assert board[f"train/gpu/{key}"] == _series(events, "step", "gpu", key)
    assert board["eval/eval_loss"] == _series(events, "eval", "eval_loss")
    assert [s for s, _ in board["eval/eval_loss"]] == [0, 2, 4]


def test_a_resumed_run_appends_to_its_tensorboard_folder(tiny_model_dir, tmp_path, monkeypatch):
    cfg = _sft_cfg(tiny_model_dir, tmp_path)
    path = tmp_path / "r"
    real = sft.train

    def stop_after_2(ctx):  # a graceful stop once step 2 is reported (as the STOP file would)
        emit = ctx.emit

        def watch(type, **fields):
            if type == "step" and fields["step"] == 2:
                ctx.stop_flag[0] = True
            return emit(type, **fields)

        ctx.emit = watch
        return real(ctx)

    monkeypatch.setattr(sft, "train", stop_after_2)
    assert _train(cfg, path) == 0
    assert read_events(path / "events.jsonl")[-1]["type"] == "stopped"
    monkeypatch.setattr(sft, "train", real)
    assert _train(cfg, path, resume=True) == 0
    events = read_events(path / "events.jsonl")
    assert events[-1]["type"] == "finished"
    assert len(list((path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file a worker
    board = _board(path)
    assert [s for s, _ in board["train/loss"]] == [1, 2, 3, 4]  # steps continue, none twice
    assert board["train/loss"] == _series(events, "step", "loss")
    assert board["eval/eval_loss"] == _series(events, "eval", "eval_loss")


def test_report_to_none_writes_no_folder(tiny_model_dir, tmp_path):
    path = tmp_path / "r"
    cfg = sft_config(tiny_model_dir, tmp_path, sft={"steps": 2}, run={"report_to": "none", "checkpoint_every": 0})
    assert _train(cfg, path) == 0
    assert read_events(path / "events.jsonl")[-1]["type"] == "finished"
    assert not (path / "tensorboard").exists()
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["adapter", "checkpoints"]  # no mlruns/, wandb/


def test_a_backend_that_is_not_installed_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # find_spec answers None: not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = resolve(overrides={"run": {"report_to": "mlflow"}})  # the word itself is valid
    with pytest.raises(ConfigError) as e:
        api.preflight(cfg)  # before a run folder exists
    assert str(e.value) == "run.report_to: mlflow is not installed (pip install edgetune[mlflow])"
    # a resume where the library has gone since: the worker refuses before loading anything
    path = tmp_path / "r"
    assert _train(sft_config(tiny_model_dir, tmp_path, run={"report_to": "wandb"}), path) == 2
    last = read_events(path / "events.jsonl")[-1]
    assert (last["type"], last["kind"]) == ("error", "input")
    assert last["message"] == "run.report_to: wandb is not installed (pip install edgetune[wandb])"
    with pytest.raises(ConfigError, match="run.report_to: 'tensorbord' is not one of tensorboard, mlflow"):
        resolve(overrides={"run": {"report_to": "tensorbord"}})


def test_a_failing_backend_is_one_warning_and_the_run_goes_on(tiny_model_dir, tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    calls = []

    def full_disk(self, *args, **kwargs):
        calls.append(args[0])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full_disk)
    path = tmp_path / "r"
    assert _train(sft_config(tiny_model_dir, tmp_path, sft={"steps": 3}, run={"checkpoint_every": 0}), path) == 0
    events = read_events(path / "events.jsonl")
    warnings = [e["message"] for e in events if e["type"] == "warning"]
    assert warnings == ["run.report_to tensorboard: OSError: [Errno 28] No space left on device; tracking "
                        "stopped, training goes on (events.jsonl has every number)"]
    assert len(calls) == 1  # tried once, then left alone
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2, 3]
    assert events[-1]["type"] == "finished"


def test_fgrpo_scalars_in_tensorboard_equal_the_events(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = resolve(overrides={
        "method": "fgrpo",
        "model": {"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(tmp_path / "rl.jsonl"), "eval_fraction": 0.2},
        "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
        "fgrpo": {"num_generations": 2, "prompts_per_step": 2, "max_new_tokens": 4, "steps": 2, "reward": "exact",
                  "eval_prompts": 2, "eval_k": 1, "eval_every": 1},
    })
    path = tmp_path / "r"
    assert _train(cfg, path) == 0
    events = read_events(path / "events.jsonl")
    assert events[-1]["type"] == "finished"
    board = _board(path)
    for field in ("reward_mean", "success_rate", "truncated", "loss", "lr", "grad_norm", "tokens_per_s"):
        assert board[f"train/{field}"] == _series(events, "step", field), field
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [1, 2, 0]  # the base model's (step 0) measured after training
    for field in ("success_rate", "pass@1"):
        assert field in evals[0]
        assert board[f"eval/{field}"] == _series(events, "eval", field), field
    assert "eval/prompts" not in board  # a count of prompts, not a measurement


def test_essa_tags_and_its_warm_start_run_under_their_own_steps():
    from edgetune.engine.run.tracking import scalars

    gen = {"i": 9, "time": 1.0, "type": "step", "step": 3, "total": 8, "elapsed": 2.0, "eta": None, "best": 0.75,
           "mean": 0.5, "std": 0.1, "sigma": 0.2, "best_so_far": 0.75, "seconds": 1.5, "host_rss": 10,
           "gpu": {"allocated": 0, "reserved": 0, "peak": 0, "total": 0}}
    assert {t: (v, s) for t, v, s in scalars(gen) if not t.startswith("train/gpu/")} == {
        "train/best": (0.75, 3), "train/mean": (0.5, 3), "train/std": (0.1, 3), "train/sigma": (0.2, 3),
        "train/best_so_far": (0.75, 3), "train/seconds": (1.5, 3), "train/host_rss": (10.0, 3)}
    assert scalars({"type": "eval", "step": 3, "reward": 0.25, "candidate": "mean"}) == [("eval/reward", 0.25, 3)]
    warm = {"type": "warm_start", "event": "step", "step": 2, "total": 5, "loss": 1.5, "lr": 0.001}
    assert scalars(warm) == [("warm_start/train/loss", 1.5, 2), ("warm_start/train/lr", 0.001, 2)]
    assert scalars({"type": "candidate", "generation": 1, "index": 0, "fitness": 0.5}) == []
    assert scalars({"type": "warm_start", "event": "phase", "phase": "training"}) == []
