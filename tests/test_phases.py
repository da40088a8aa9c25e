"""Every method announces its phases in order, with progress through the long ones, and a
stop asked for during the initial evaluation ends the run there (between batches) with
the adapter saved. Tiny random Llama (conftest.py), CPU."""

import json

import pytest
from inline_run import run_inline

from edgetune.engine.core import phases, settings


def _phases(events):
    return [e for e in events if e["type"] == "phase"]


def _order(events):
    out = []
    for e in _phases(events):
        if not out or out[-1] != e["phase"]:
            out.append(e["phase"])
    return out


def _stop_during(phase: str):
    """run_inline's emit, wrapped: ask for a stop once `phase` reports its first batch done."""
    def install(ctx_holder):
        inner = ctx_holder.emit

        def emit(type, **fields):
            ev = inner(type, **fields)
            if type == "phase" and fields["phase"] == phase and fields.get("done", 0) >= 1:
                ctx_holder.stop_flag[0] = True
            return ev
        ctx_holder.emit = emit
    return install


def _run(train, cfg, path, stop_in=None):
    if stop_in is None:
        return run_inline(train, cfg, path)[2]

    def wrapped(ctx):
        _stop_during(stop_in)(ctx)
        return train(ctx)
    return run_inline(wrapped, cfg, path)[2]


def _sft_cfg(model_dir, tmp_path, **sft):
    return settings.from_dict({
        "method": "sft",
        "model": {"name": str(model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"path": "embedded:arith-sft", "max_rows": 64, "max_seq_len": 128, "eval_fraction": 0.25},
        "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
        "sft": {"lr": 1e-3, "steps": 3, "batch_size": 4, "warmup_steps": 1, "eval_every": 3, **sft},
    })


def test_describe_reads_like_a_status_line():
    assert phases.describe({"phase": "initial_eval", "done": 12, "total": 30, "unit": "prompts"}) == \
        "initial eval 12/30 prompts"
    assert phases.describe({"phase": "loading"}) == "loading the model"


def test_sft_phases_in_order_with_eval_progress(tiny_model_dir, tmp_path):
    from edgetune.engine.methods.sft import sft

    events = _run(sft.train, _sft_cfg(tiny_model_dir, tmp_path), tmp_path / "run")
    # no base_eval: the initial evaluation's losses (the adapter starts at zero) are the base's,
    # which the run's before / after comparison reuses
    assert _order(events) == ["data_check", "loading", "initial_eval", "training", "final_eval", "export"]
    assert [e for e in events if e["type"] == "comparison"]
    initial = [e for e in _phases(events) if e["phase"] == "initial_eval"]
    total = initial[0]["total"]
    assert total == 4 and initial[0]["unit"] == "batches"  # 16 held-out rows, batches of 4
    assert [e["done"] for e in initial] == [0, 1, 2, 3, 4]
    assert events[-1]["type"] == "finished"
    # each phase event comes before the events of its phase
    first_step = next(e["i"] for e in events if e["type"] == "step")
    training = next(e["i"] for e in _phases(events) if e["phase"] == "training")
    assert training < first_step


def test_sft_stop_during_initial_eval_ends_between_batches(tiny_model_dir, tmp_path):
    from edgetune.engine.methods.sft import sft

    events = _run(sft.train, _sft_cfg(tiny_model_dir, tmp_path), tmp_path / "run", stop_in="initial_eval")
    done = [e["done"] for e in _phases(events) if e["phase"] == "initial_eval"]
    assert max(done) == 1  # stopped after the first of 4 batches
    assert not [e for e in events if e["type"] in ("step", "eval")]
    assert events[-1]["type"] == "stopped" and events[-1]["step"] == 0
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


@pytest.fixture
def rl_file(tmp_path):
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_fgrpo_evaluates_the_base_after_training_and_stops_between_chunks(tiny_model_dir, rl_file, tmp_path):
    from edgetune.engine.methods.fgrpo import fgrpo

    cfg = settings.resolve(overrides={
        "method": "fgrpo",
        "model": {"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(rl_file), "eval_fraction": 0.4},
        "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
        "fgrpo": {"num_generations": 2, "prompts_per_step": 2, "max_new_tokens": 4, "steps": 2,
                  "eval_prompts": 8, "eval_k": 0, "micro_batch_size": 4},
    })
    full = _run(fgrpo.train, cfg, tmp_path / "full")
    # the first step right after loading: the base model is evaluated after training
    assert _order(full) == ["loading", "data_check", "training", "final_eval", "base_eval", "export"]
    base = [e for e in _phases(full) if e["phase"] == "base_eval"]
    assert base[-1]["done"] == base[-1]["total"] == 8 and base[-1]["unit"] == "prompts"
    assert len({e["done"] for e in base}) >= 3  # 8 prompts in chunks of one rollout batch (4 rows)
    evals = [e for e in full if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [2, 0] and full[-1]["type"] == "finished"
    assert {"success_rate_start", "success_rate_end"} <= set(full[-1]["metrics"])

    cut = _run(fgrpo.train, cfg, tmp_path / "cut", stop_in="final_eval")
    done = [e["done"] for e in _phases(cut) if e["phase"] == "final_eval"]
    assert max(done) < 8
    assert not [e for e in cut if e["type"] == "eval"]  # stopped: neither evaluation finished
    assert not [e for e in _phases(cut) if e["phase"] == "base_eval"]  # a stop skips it too
    # the stop ends the run `stopped`, as one between steps does
    assert cut[-1]["type"] == "stopped" and "success_rate_start" not in cut[-1]["metrics"]


def _slow_set_up(seconds: float):
    """run_inline's emit, wrapped: the initial evaluation takes `seconds` longer."""
    import time

    def install(ctx_holder):
        inner = ctx_holder.emit

        def emit(type, **fields):
            if type == "phase" and fields["phase"] == "initial_eval" and not fields.get("done"):
                time.sleep(seconds)
            return inner(type, **fields)
        ctx_holder.emit = emit
    return install


def _timed(train, cfg, path):
    def wrapped(ctx):
        _slow_set_up(2.0)(ctx)
        return train(ctx)
    return run_inline(wrapped, cfg, path)[2]


def _check_clock_starts_at_training(events):
    training = next(e for e in _phases(events) if e["phase"] == "training")
    first = next(e for e in events if e["type"] == "step")
    # elapsed counts from the training phase: the slow set-up before it is not training time
    assert first["elapsed"] <= first["time"] - training["time"] + 0.05
    assert first["elapsed"] < 2.0
    assert first["eta"] is not None and first["eta"] < 2.0 * first["total"]


def test_sft_elapsed_and_eta_count_from_the_first_step(tiny_model_dir, tmp_path):
    from edgetune.engine.methods.sft import sft

    _check_clock_starts_at_training(_timed(sft.train, _sft_cfg(tiny_model_dir, tmp_path), tmp_path / "run"))


def test_fgrpo_elapsed_and_eta_count_from_the_first_step(tiny_model_dir, rl_file, tmp_path):
    from edgetune.engine.methods.fgrpo import fgrpo

    cfg = settings.resolve(overrides={
        "method": "fgrpo",
        "model": {"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(rl_file), "eval_fraction": 0.4},
        "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
        "fgrpo": {"num_generations": 2, "prompts_per_step": 2, "max_new_tokens": 4, "steps": 2,
                  "eval_prompts": 4, "eval_k": 0, "micro_batch_size": 4},
    })
    _check_clock_starts_at_training(_timed(fgrpo.train, cfg, tmp_path / "run"))
