import random
from math import comb

import pytest

from edgetune.engine.training.passk import mean_pass_at_k, pass_at_k


def test_hand_checked():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain success rate


def test_one_when_too_few_failures():
    assert pass_at_k(8, 5, 4) == 1.0  # 3 failures cannot fill 4 draws
    assert pass_at_k(8, 8, 8) == 1.0
    assert pass_at_k(8, 4, 4) < 1.0  # 4 failures can


def test_matches_binomial_form():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 60)
        c = rng.randint(0, n)
        k = rng.randint(1, n)
        ref = 1.0 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(ref, abs=1e-12)


def test_large_n_is_stable():
    # C(2048, 512) ~ 1e490 overflows a float; the product form never builds it.
    v = pass_at_k(2048, 3, 512)
    assert v == pytest.approx(1 - comb(2045, 512) / comb(2048, 512), abs=1e-12)
    assert 0.57 < v < 0.58


def test_mean_and_errors():
    assert mean_pass_at_k([(4, 1), (4, 0), (4, 4)], 2) == pytest.approx((0.5 + 0 + 1) / 3)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        mean_pass_at_k([], 1)
