"""bench/learning_curves.py: held-out curves read back from runs' event files."""

import json

import bench_script
import pytest


def _events(path, evals):
    lines = [{"type": "step", "step": 1, "reward_mean": 0.5}] + [{"type": "eval", **e} for e in evals]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    return path


def test_curves_table_and_plot_from_event_files(tmp_path):
    bench = bench_script.load("learning_curves")
    run = tmp_path / "runs" / "gcd-grpo"
    run.mkdir(parents=True)
    files = [_events(tmp_path / "gcd-fgrpo.jsonl", [{"step": 0, "success_rate": 0.34, "pass@4": 0.44},
                                                     {"step": 8, "success_rate": 0.4, "pass@4": 0.6}]),
             _events(run / "events.jsonl", [{"step": 0, "success_rate": 0.34, "pass@4": 0.44}]),
             _events(tmp_path / "products-essa.jsonl", [{"step": 4, "reward": 0.6, "candidate": "mean"}])]
    assert bench.main([*map(str, files), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "curves.md").read_text()
    assert "- gcd F-GRPO: 0: 34% (44%), 8: 40% (60%)" in md
    assert "- gcd GRPO γ=0: 0: 34% (44%)" in md and "- products ESSA: 4: 60%" in md
    from PIL import Image

    with Image.open(tmp_path / "out" / "curves.png") as im:
        assert im.size[0] > 2 * im.size[1]  # two panels side by side
    with pytest.raises(SystemExit, match="exists"):  # a second report never overwrites the first
        bench.main([*map(str, files), "--out", str(tmp_path / "out")])


def test_a_file_not_named_task_method_is_refused(tmp_path):
    bench = bench_script.load("learning_curves")
    f = _events(tmp_path / "mystery.jsonl", [])
    with pytest.raises(SystemExit, match="not named <task>-<method>"):
        bench.main([str(f), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="no such events file"):
        bench.main([str(tmp_path / "gone-fgrpo.jsonl"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
