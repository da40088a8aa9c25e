"""How sure a score is, and whether two systems really differ: the numbers `edgetune eval`
prints beside every score and every comparison. Pure Python and numpy (no torch).

- One system: a share of items passed has a Wilson 95% interval (right near 0 and 1, where
  the textbook p ± 1.96·se is not); a mean of real scores has a percentile bootstrap 95%
  interval over the items.
- Two systems on the same items (paired): 0/1 outcomes use the exact McNemar test (a
  binomial test on the items where the two disagree) with the Agresti–Min adjusted Wald
  interval of the difference; real-valued scores use a paired bootstrap of the per-item
  differences (interval, and a two-sided p-value from the bootstrap centred at zero).
- `in_words` says the answer as a sentence and, when no difference shows, how many items
  would show a gap of GAP with 80% power (Connor's sample size for paired proportions; for
  real scores the normal one from the spread of the differences).

Bootstraps draw from a fixed seed, so the same outcomes give the same intervals every time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
Z80 = 0.8416212335729143  # of 80% power (one-sided 0.8)
ALPHA = 0.05  # a difference whose p-value is below this is called detected
GAP = 0.05  # the gap the sample-size sentence speaks of (5 points of a share)
RESAMPLES = 10_000
SEED = 0
BASE, ADAPTER = "the base", "the adapter"  # the two systems of a run's own before / after comparison
TESTS = {"proportion": "exact McNemar", "mean": "paired bootstrap"}  # the test of each Paired.kind


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class Paired:
    """b minus a on the same n items."""

    kind: str  # "proportion" (0/1 outcomes, McNemar) or "mean" (real scores, paired bootstrap)
    n: int
    difference: float
    low: float
    high: float
    p_value: float
    needed: int | None  # items that would show a gap of GAP with 80% power (None: not computable)
    better: int = 0  # proportions: items b passes and a fails
    worse: int = 0  # and the other way round

    def dict(self) -> dict:
        return asdict(self)


def wilson(passed: int, n: int) -> Interval:
    """The share passed/n with its Wilson score 95% interval."""
    if n <= 0 or not 0 <= passed <= n:
        raise ValueError(f"a proportion needs 0 <= passed <= n and n > 0, got {passed}/{n}")
    p, z2 = passed / n, Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


def _resampled_means(x: np.ndarray, seed: int = SEED, resamples: int = RESAMPLES) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(resamples, len(x)))
    return x[idx].mean(axis=1)


def bootstrap_mean(values, seed: int = SEED, resamples: int = RESAMPLES) -> Interval:
    """The mean with its percentile bootstrap 95% interval over the items."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("the mean of no items")
    means = _resampled_means(x, seed, resamples)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return Interval(float(x.mean()), float(lo), float(hi))


def mcnemar_exact(better: int, worse: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of `better` successes in
    better + worse discordant items at 1/2 (1 when there are none)."""
    m = better + worse
    if m == 0:
        return 1.0
    k = min(better, worse)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2.0**m
    return min(1.0, 2 * tail)


def paired_sample_size(discordant: float, gap: float = GAP) -> int:
    """Items a paired test of two shares needs to detect `gap` at 5% (two-sided) with 80%
    power, when a share `discordant` of items gets different outcomes (Connor 1987)."""
    psi = max(discordant, gap)  # at least the gap itself is discordant
    n = (Z95 * math.sqrt(psi) + Z80 * math.sqrt(psi - gap * gap)) ** 2 / (gap * gap)
    return math.ceil(n)


def compare_proportions(a, b) -> Paired:
    """b against a on the same items, each outcome 0 or 1."""
    a, b = np.asarray(a, dtype=int), np.asarray(b, dtype=int)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"a paired comparison needs the same items on both sides, got {a.size} and {b.size}")
    if not (np.isin(a, (0, 1)).all() and np.isin(b, (0, 1)).all()):
        raise ValueError("McNemar's test needs 0/1 outcomes")
    n = int(a.size)
    better, worse = int(((b == 1) & (a == 0)).sum()), int(((b == 0) & (a == 1)).sum())
    # Agresti–Min: add 1/2 to each of the four cells, then the Wald interval of the difference
    n_ = n + 2
    d_ = (better - worse) / n_
    se = math.sqrt(max(0.0, (better + 0.5 + worse + 0.5) / n_ - d_ * d_) / n_)
    diff = (better - worse) / n
    return Paired("proportion", n, diff, max(-1.0, d_ - Z95 * se), min(1.0, d_ + Z95 * se),
                  mcnemar_exact(better, worse), paired_sample_size((better + worse) / n), better, worse)


def compare_means(a, b, seed: int = SEED, resamples: int = RESAMPLES, gap: float = GAP) -> Paired:
    """b against a on the same items, real-valued scores: the paired bootstrap of the
    per-item differences."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"a paired comparison needs the same items on both sides, got {a.size} and {b.size}")
    d = b - a
    mean = float(d.mean())
    means = _resampled_means(d, seed, resamples)
    lo, hi = np.percentile(means, [2.5, 97.5])
    # two-sided p: how often the bootstrap, shifted to a true difference of 0, lands as far out
    far = int((np.abs(means - mean) >= abs(mean) - 1e-12).sum())
    p = min(1.0, (far + 1) / (resamples + 1)) if np.ptp(d) > 0 or mean != 0 else 1.0
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    needed = math.ceil(((Z95 + Z80) * sd / gap) ** 2) if sd > 0 else None
    return Paired("mean", int(d.size), mean, float(lo), float(hi), p, needed)


def p_text(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.2g}"


def _amount(x: float, kind: str) -> str:
    return f"{100 * x:.0f}" if kind == "proportion" else f"{x:.3g}"


def in_words(c: Paired, a: str, b: str, unit: str = "prompts", gap: float = GAP) -> str:
    """The comparison as a sentence: "adapter B is better than the base by 12 points (95% CI
    5–19)", or "A vs B: no detectable difference on 50 prompts; about 400 would show a
    5-point gap"."""
    points = " points" if c.kind == "proportion" else ""
    if c.p_value < ALPHA and c.difference != 0:
        word = "better" if c.difference > 0 else "worse"
        return (f"{b} is {word} than {a} by {_amount(abs(c.difference), c.kind)}{points} "
                f"(95% CI {_amount(c.low, c.kind)} to {_amount(c.high, c.kind)}, {p_text(c.p_value)})")
    line = f"{a} vs {b}: no detectable difference on {c.n} {unit} ({p_text(c.p_value)})"
    if c.needed is not None and c.needed > c.n:
        size = f"a {_amount(gap, c.kind)}-point gap" if c.kind == "proportion" else f"a gap of {gap:g}"
        line += f"; about {c.needed} would show {size}"
    return line


def compare_losses(a_values, b_values, a: str, b: str, metric: str, unit: str) -> dict:
    """System b against system a on per-item losses (lower is better): the paired
    bootstrap's fields, signed as measured (b - a), and the answer in words, where
    "better" means a lower loss."""
    c = compare_means(a_values, b_values)
    lower = replace(c, difference=-c.difference, low=-c.high, high=-c.low)
    return {"a": a, "b": b, "metric": metric, **c.dict(), "words": in_words(lower, a, b, unit=unit)}
