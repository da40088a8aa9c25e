"""bench/essa.py --tiny runs end to end on the CPU and reports what the GPU run will."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "essa.py"


def test_bench_tiny_runs_and_batched_matches_sequential(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_essa", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    R = bench.main(["--tiny", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "essa.json").read_text())
    assert saved["batched"]["k"] == 6 and saved["sequential"]["candidates_timed"] == 2
    assert R["fitness_equal_on_sequential_candidates"]
    for key in ("sequential", "batched", "plain_lora", "plain_base"):
        assert saved[key]["gen_tokens_per_s"] > 0
    assert "| batched (K=6) |" in capsys.readouterr().out
