"""bench/essa_noise.py: its rank statistics against hand-computed values."""

import bench_script
import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench():
    return bench_script.load("essa_noise")


def test_average_ranks_share_ties(bench):
    assert bench.average_ranks([0.5, 0.25, 0.5, 1.0, 0.25]).tolist() == [3.5, 1.5, 3.5, 5.0, 1.5]


def test_spearman_matches_hand_computed_values(bench):
    # y's ranks with a tie: [1, 2, 3.5, 5, 3.5]; deviations from 3: x -> [-2,-1,0,1,2],
    # y -> [-2,-1,0.5,2,0.5]; rho = 8 / sqrt(10 * 9.5)
    assert bench.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / np.sqrt(95), abs=1e-12)
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(bench.spearman([1, 2, 3], [0.5, 0.5, 0.5]))  # a constant draw ranks nothing


def test_permutation_p_and_parents_shared(bench):
    # a perfect ranking of 6 is reached by 1 of 720 orders: p ~ 1/720
    assert bench.permutation_p(range(6), range(6), n=20000) == pytest.approx(1 / 720, abs=1e-3)
    assert bench.permutation_p(range(6), range(6)[::-1], n=2000) == 1.0
    assert bench.parents_shared([0.9, 0.8, 0.1, 0.2], [0.7, 0.1, 0.9, 0.0], 2) == 1  # top 2: {0,1} vs {2,0}


def test_noise_stats_numbers(bench):
    a, b = [0.5, 0.75, 0.25, 0.5], [0.5, 1.0, 0.0, 0.5]
    r = bench.noise_stats(a, b, 4)
    assert r["fitness_mean"] == pytest.approx(0.5)
    assert r["binomial_se_at_mean"] == pytest.approx(0.25)  # sqrt(0.25 / 4)
    assert r["signal_sd_from_covariance"] == pytest.approx(np.sqrt(np.cov(a, b)[0, 1]))
    assert r["parents"] == 2 and r["parents_shared"] == 2


@pytest.mark.slow
def test_tiny_run_writes_the_report(bench, tmp_path):
    r = bench.main(["--tiny", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert [e["prompts"] for e in r["per_prompts"]] == [3, 6]
    for e in r["per_prompts"]:  # every candidate scored on both draws, as the Evaluator returns it
        assert len(e["fitness_a"]) == len(e["fitness_b"]) == 4
        assert all(0.0 <= f <= 1.0 for f in e["fitness_a"] + e["fitness_b"])
    assert r["disjoint_draws"] and r["config"]["sigma0"] == 0.1  # the preset's
    assert "| 6 |" in (tmp_path / "out" / "essa_noise.md").read_text()
