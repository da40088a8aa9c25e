"""bench/learning_seeds.py: per-seed gains against each seed's own base, pooled by hand."""

import json
from pathlib import Path

import bench_script


def _bench():
    return bench_script.load("learning_seeds")


def _run(path: Path, seed: int, methods: dict) -> Path:
    tasks = [{"task": "gcd", "methods": {m: {"success_rate": g, "pass@4": p} for m, (g, p) in methods.items()}}]
    path.write_text(json.dumps({"args": {"seed": seed, "eval_k": 4}, "tasks": tasks}))
    return path


def test_gains_are_taken_against_the_same_seeds_base(tmp_path, capsys):
    a = _run(tmp_path / "a.json", 0, {"base": (0.30, 0.5), "fgrpo": (0.50, 0.7), "grpo": (0.40, 0.6)})
    b = _run(tmp_path / "b.json", 1, {"base": (0.10, 0.3), "fgrpo": (0.20, 0.5)})
    c = _run(tmp_path / "c.json", 1, {"fgrpo": (0.40, 0.9)})  # another setting, base from seed 1's file
    _bench().main([f"default={a}", f"default={b}", f"other={c}"])
    lines = {tuple(cell.strip() for cell in row.split("|")[1:4]): row for row in capsys.readouterr().out.splitlines()}
    fgrpo = lines[("gcd", "default", "F-GRPO")]
    # seeds 0 and 1: gains +20 and +10 (mean +15), one of two at >= +15; pass@4 mean 60%
    assert "| 2 | 20% | 35% | +15 (+20, +10) | 1 of 2 | 60.0% |" in fgrpo
    assert "| 1 | 30% | 40% | +10 (+10) | 0 of 1 | 60.0% |" in lines[("gcd", "default", "GRPO γ=0")]
    assert "| 1 | 10% | 40% | +30 (+30) | 1 of 1 | 90.0% |" in lines[("gcd", "other", "F-GRPO")]


def test_methods_picks_the_rows_and_target_counts_them(tmp_path, capsys):
    a = _run(tmp_path / "a.json", 0, {"base": (0.30, 0.5), "sft": (0.62, 0.8), "fgrpo": (0.50, 0.7)})
    b = _run(tmp_path / "b.json", 1, {"base": (0.10, 0.3), "sft": (0.35, 0.6)})
    _bench().main(["--methods", "sft", "--target", "0.30", f"steps={a}", f"steps={b}"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| gcd")]
    # sft only (the F-GRPO row of a.json is left out); gains +32 and +25, one of two at >= +30
    assert rows == ["| gcd | steps | SFT | 2 | 20% | 48% | +28 (+32, +25) | 1 of 2 | 70.0% |"]


def test_a_file_that_is_not_a_report_is_named_in_one_line(tmp_path, capsys):
    import pytest

    bad = tmp_path / "notes.json"
    bad.write_text('{"tasks": []}')
    with pytest.raises(SystemExit):
        _bench().main([f"default={bad}"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(bad) in err and "not a learning.json" in err and "Traceback" not in err


def test_essa_gains_are_taken_against_its_own_warm_start(tmp_path, capsys):
    # each setting has its own warm start (a wider LoRA trains another one); the base is not ESSA's reference
    a = _run(tmp_path / "a.json", 0, {"base": (0.10, 0.3), "essa_warm_start": (0.40, 0.6), "essa": (0.52, 0.7)})
    b = _run(tmp_path / "b.json", 1, {"essa_warm_start": (0.30, 0.5), "essa": (0.34, 0.5)})
    c = _run(tmp_path / "c.json", 0, {"essa_warm_start": (0.60, 0.7), "essa": (0.58, 0.7)})
    _bench().main(["--methods", "essa", "--target", "0.08", f"wide={a}", f"wide={b}", f"narrow={c}"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| gcd")]
    # wide: +12 and +4 over warm starts 40% and 30% (mean 35%), one of two at >= +8; narrow: -2
    assert rows == ["| gcd | narrow | ESSA | 1 | 60% | 58% | -2 (-2) | 0 of 1 | 70.0% |",
                    "| gcd | wide | ESSA | 2 | 35% | 43% | +8 (+12, +4) | 1 of 2 | 60.0% |"]


def test_one_method_of_a_file_can_be_pooled_under_a_label(tmp_path, capsys):
    a = _run(tmp_path / "a.json", 0, {"base": (0.30, 0.5), "fgrpo": (0.50, 0.7), "grpo": (0.40, 0.6)})
    b = _run(tmp_path / "b.json", 1, {"base": (0.10, 0.3), "fgrpo": (0.90, 0.9), "grpo": (0.20, 0.45)})
    _bench().main([f"grpo:grpo={a}", f"grpo:grpo={b}", f"new:fgrpo={b}"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| gcd")]
    # GRPO from both files, pass@4 (0.6 + 0.45) / 2; F-GRPO of b only, a's left out
    assert rows == ["| gcd | grpo | GRPO γ=0 | 2 | 20% | 30% | +10 (+10, +10) | 0 of 2 | 52.5% |",
                    "| gcd | new | F-GRPO | 1 | 10% | 90% | +80 (+80) | 1 of 1 | 90.0% |"]
    try:
        _bench().main([f"x:ppo={a}"])
    except SystemExit as e:
        assert e.code == 2 and "unknown method 'ppo'" in capsys.readouterr().err
    else:
        raise AssertionError("an unknown method was taken")
