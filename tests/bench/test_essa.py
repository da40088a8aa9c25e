"""bench/essa.py --tiny runs end to end on the CPU and reports what the GPU run will."""

import json

import bench_script


def test_bench_tiny_runs_and_batched_matches_sequential(tmp_path, capsys):
    bench = bench_script.load("essa")
    R = bench.main(["--tiny", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "essa.json").read_text())
    assert saved["batched"]["k"] == 6 and saved["sequential"]["candidates_timed"] == 2
    assert R["fitness_equal_on_sequential_candidates"]
    for key in ("sequential", "batched", "plain_lora", "plain_base"):
        assert saved[key]["gen_tokens_per_s"] > 0
    fl = saved["fast_loop"]  # batched candidates through the fast loop too (eager on the CPU)
    assert fl["batched"]["k"] == 6 and fl["batched"]["gen_tokens_per_s"] > 0
    assert fl["batched_fitness_max_abs_diff_vs_sequential"] == 0.0
    assert fl["batched_vs_plain_lora"] > 0 and fl["batched_vs_sequential_candidates_per_min"] > 0
    out = capsys.readouterr().out
    assert "| batched (K=6) |" in out and "| batched (K=6) via rollouts' fast loop |" in out
