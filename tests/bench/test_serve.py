"""bench/serve.py --tiny end to end on the CPU: every stream count served both ways, each
request its full token count, and the tables written."""

import json
import subprocess
import sys

import bench_script


def test_tiny_serves_every_stream_count_both_ways(tmp_path):
    p = subprocess.run([sys.executable, str(bench_script.BENCH / "serve.py"), "--tiny", "--streams", "1,3",
                        "--adapters", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=bench_script.BENCH)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads((tmp_path / "serve.json").read_text())
    assert [r["streams"] for r in result["rows"]] == [1, 3] and result["tokens_per_request"] == 6
    for r in result["rows"]:
        for how in ("batched", "one_after_another"):
            assert r[how]["tokens"] == 6 * r["streams"] and r[how]["seconds"] > 0
    assert result["machine_before"]["cores"] and len(result["machine_after"]["load_average_1_5_15"]) == 3
    table = (tmp_path / "serve.md").read_text()
    assert "| 3 |" in table and "speed-up" in table
