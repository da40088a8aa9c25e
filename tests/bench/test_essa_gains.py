"""bench/essa_gains.py: ESSA's gain over its warm start read back from learning_search's logs."""

import json

import bench_script
import pytest


def _run(logs, group, task, rewards):
    """A run's events as learning_search.sh copies them: held-out evaluations at generations 0, 2, ..."""
    d = logs / group / f"{task}-essa" / "runs" / f"{task}-essa"
    d.mkdir(parents=True)
    lines = [{"type": "step", "step": 1, "best": 0.5, "mean": 0.4}]
    lines += [{"type": "eval", "step": 2 * i, "reward": r, "candidate": "mean"} for i, r in enumerate(rewards)]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_mean_gain_over_seeds_per_setting_and_task(tmp_path, capsys):
    bench = bench_script.load("essa_gains")
    logs = tmp_path / "logs"
    _run(logs, "rel04_seed0", "gcd", [0.36, 0.40, 0.44])  # +8 at generation 4
    _run(logs, "rel04_seed1", "gcd", [0.30, 0.28, 0.40])  # +10
    _run(logs, "rel04_seed0", "products", [0.42, 0.62])  # +20 (kept aside: not counted)
    _run(logs, "shipped_seed0", "gcd", [0.5, 0.5, 0.46, 0.46])  # -4 at generation 6
    _run(logs, "shipped_seed1", "gcd", [0.5])  # stopped before its first search point: left out
    assert bench.main([str(logs)]) == 0
    out = capsys.readouterr().out
    assert "| task | rel04 | shipped |" in out
    assert "| gcd | +9.0 (+8, +10) | -4.0 (-4) |" in out
    assert "| products | +20.0 (+20) | not run |" in out
    assert "| benchmark tasks with a mean gain ≥ +8 | 1 | 0 |" in out
    assert "Last generation reached: 2 to 6" in out


def test_a_folder_without_essa_runs_is_refused(tmp_path):
    bench = bench_script.load("essa_gains")
    with pytest.raises(SystemExit, match="no ESSA run"):
        bench.main([str(tmp_path)])
