"""bench/long_context.py: its search on lengths with a known limit, and --tiny end to end
on the CPU (tiny 7B / 72B shapes, a fake memory limit, both variants)."""

import json
import subprocess
import sys

import bench_script
import pytest


@pytest.fixture(scope="module")
def bench():
    argv, path = sys.argv, list(sys.path)
    sys.argv = ["long_context.py", "--tiny"]  # the bench reads its flags at import
    sys.path.insert(0, str(bench_script.BENCH))  # its _common
    try:
        return bench_script.load("long_context")
    finally:
        sys.argv, sys.path[:] = argv, path


@pytest.mark.parametrize("limit", [1, 100, 1000, 1500, 5000, 10**6])
def test_search_doubles_then_bisects_to_the_limit(bench, limit):
    calls = []

    def probe(n):
        calls.append(n)
        return {"peak_alloc_GiB": n, "step_s": 0.0} if n <= limit else None

    r = bench.search(probe, start=64, max_len=4096, resolution=0.05, left=lambda: 1e9, quantum=8)
    if limit < 8:
        assert r["longest"] == 0 and r["first_oom"] == 8
    elif limit >= 4096:
        assert r["longest"] == 4096 and r["first_oom"] is None and r["stop"] == "reached --max-len"
    else:
        assert r["longest"] <= limit < r["first_oom"]
        assert r["first_oom"] - r["longest"] <= max(8, 0.05 * r["longest"])
        doubling = [n for n in calls if n >= 64 and (n & (n - 1)) == 0]
        assert calls[: len(doubling)] == doubling  # doubled first
    assert set(r["probes"]) == {str(n) for n in calls}


def test_search_stops_at_the_time_limit(bench):
    clock = iter([100, 100, 0, 0, 0])
    r = bench.search(lambda n: {"peak_alloc_GiB": 0, "step_s": 0}, 64, 4096, 0.05, lambda: next(clock), 8)
    assert r["stop"] == "time limit while doubling" and r["longest"] >= 64


@pytest.mark.slow
def test_tiny_finds_the_longest_rows(tmp_path):
    p = subprocess.run([sys.executable, str(bench_script.BENCH / "long_context.py"), "--tiny", "--variants",
                        "levers,plain", "--caps", "2048", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=1200, cwd=bench_script.BENCH)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    R = json.loads((tmp_path / "long_context.json").read_text())
    assert [(r["model"], r["variant"]) for r in R["rows"]] == [("7b", "levers"), ("7b", "plain"), ("72b", "levers"),
                                                               ("72b", "plain")]
    for r in R["rows"]:
        assert r["longest"] >= 32 and r["first_oom"] > r["longest"], r
        at = r["at_longest"]
        assert at["tokens"] == r["longest"] and 0 < at["peak_alloc"] <= 2048 * 1024 and at["tok_per_s"] > 0
        assert r["probes"][str(r["first_oom"])] is None
    assert "| 72b | plain |" in R["table"]
