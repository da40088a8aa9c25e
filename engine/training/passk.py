"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

With n samples of a problem of which c are correct, the chance that k samples drawn
without replacement contain at least one correct one is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1 .. n} (1 - k / i)

The product form never builds the huge binomials (C(2048, 512) is beyond a float),
and it is exactly 1 when n - c < k (every draw of k must contain a correct sample).
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: list[tuple[int, int]], k: int) -> float:
    """Mean over problems of pass@k; `counts` holds (n, c) per problem."""
    if not counts:
        raise ValueError("pass@k of no problems")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
