"""A run whose loss (or ESSA fitness) turns NaN or infinite fails at that step, naming it:
never `finished`, and no final adapter written."""

import math
import signal

import pytest
from inline_run import sft_config

from edgetune.engine.core.errors import RunError
from edgetune.engine.core.events import read_events

from edgetune.engine.run import api


def _worker_run(cfg, path):
    """The worker's own run of a run folder, in this process (so a monkeypatch reaches it)."""
    from edgetune.engine.run import worker

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(cfg.to_yaml())
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        rc = worker.run(str(path), owns_pid=False)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    return rc, api.open_run(path), read_events(path / "events.jsonl")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_sft_loss_fails_the_run_at_that_step(tiny_model_dir, tmp_path, monkeypatch, bad):
    from edgetune.engine.methods.sft import sft

    loss_fn, calls = sft.causal_lm_loss, [0]

    def diverges_at_step_2(model, batch):  # grad_accum 2: calls 3 and 4 are step 2's
        calls[0] += 1
        loss, n = loss_fn(model, batch)
        return (loss * bad if calls[0] >= 3 else loss), n

    monkeypatch.setattr(sft, "causal_lm_loss", diverges_at_step_2)
    cfg = sft_config(tiny_model_dir, tmp_path, run={"checkpoint_every": 0}, model={"quant": "none"})
    rc, run, events = _worker_run(cfg, tmp_path / "r")
    assert rc == 2 and run.status() == "failed"
    assert [e["step"] for e in events if e["type"] == "step"] == [1]
    assert not any(e["type"] in ("finished", "stopped") for e in events)
    error = events[-1]
    assert error["type"] == "error" and error["message"].startswith(f"step 2: loss is {bad}; lower sft.lr (now 0.001)")
    assert "no adapter was saved" in error["message"]
    assert not run.dir.adapter.exists()


def test_a_non_finite_essa_fitness_fails_the_run_at_that_generation(tiny_model_dir, tmp_path_factory, tmp_path,
                                                                     monkeypatch):
    from inline_run import essa_start, run_inline

    from edgetune.engine.core.settings import resolve

    from edgetune.engine.methods.essa import essa

    root = essa_start(tmp_path_factory.mktemp("essa-nan"), tiny_model_dir)
    cfg = resolve(overrides={
        "method": "essa", "model": {"name": str(root / "model"), "quant": "none"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"path": str(root / "rl.jsonl"), "eval_fraction": 0.2},
        "run": {"runs_dir": str(tmp_path), "seed": 3, "checkpoint_every": 0},
        "essa": {"warm_start": str(root / "warm"), "population": 4, "generations": 3, "prompts_per_generation": 2,
                 "max_new_tokens": 2, "eval_every": 0, "eval_prompts": 0}})
    fitness, gens = essa.population_fitness, [0]

    def nan_in_generation_2(*a, **k):
        gens[0] += 1
        fits = fitness(*a, **k)
        return [math.nan if gens[0] == 2 and i == 1 else f for i, f in enumerate(fits)]

    monkeypatch.setattr(essa, "population_fitness", nan_in_generation_2)
    with pytest.raises(RunError, match=r"^generation 2: candidate 1's fitness is nan; ") as e:
        run_inline(essa.train, cfg, tmp_path / "r")
    assert "no adapter was saved" in str(e.value)
    assert not (tmp_path / "r" / "adapter").exists()


def test_a_non_finite_fgrpo_update_fails_the_run_at_that_step(tiny_model_dir, tmp_path, monkeypatch):
    from inline_run import run_inline

    from edgetune.engine.core.settings import resolve

    from edgetune.engine.methods.fgrpo import fgrpo

    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(3) for b in range(3)]
    (tmp_path / "rl.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    cfg = resolve(overrides={
        "method": "fgrpo", "model": {"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8}, "data": {"path": str(tmp_path / "rl.jsonl"), "eval_fraction": 0.0},
        "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
        "fgrpo": {"num_generations": 2, "prompts_per_step": 1, "max_new_tokens": 2, "steps": 3, "eval_prompts": 0}})
    update = fgrpo.policy_update

    def inf_gradient(*a, **k):
        return {**update(*a, **k), "grad_norm": math.inf}

    monkeypatch.setattr(fgrpo, "policy_update", inf_gradient)
    with pytest.raises(RunError, match=r"^step 1: gradient norm is inf; lower fgrpo.lr \(now [0-9.e-]+\) or lora"):
        run_inline(fgrpo.train, cfg, tmp_path / "r")
    assert not (tmp_path / "r" / "adapter").exists()
