"""The essa-quickstart preset learns: on the embedded SmolLM2-135M (NF4), after its SFT
warm start, CMA-ES over the adapter's singular values raises the greedy held-out reward
("What is A plus B?", 30 held-out pairs). About 7 minutes on 2 shared CPU cores, so
slow; the recorded runs are in bench/results/2026-11-30-cpu/essa-quickstart.md."""

import pytest


@pytest.mark.slow
def test_essa_quickstart_raises_held_out_reward(tmp_path):
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    cfg = resolve(preset="essa-quickstart", overrides=[f"run.runs_dir={tmp_path}"])
    run = api.start(cfg, name="essa-quickstart")
    assert run.wait(timeout=3600) == "finished", run.dir.log_path.read_text()[-2000:]
    events = list(run.events())
    evals = [e for e in events if e["type"] == "eval"]
    assert evals[0]["candidate"] == "warm_start" and evals[0]["step"] == 0
    assert evals[-1]["step"] == cfg.essa.generations
    assert evals[-1]["reward"] > evals[0]["reward"]
    assert sum(e["type"] == "candidate" for e in events) == cfg.essa.population * cfg.essa.generations
    assert (run.path / "adapter" / "adapter_model.safetensors").is_file()
