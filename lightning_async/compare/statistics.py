"""Statistics over seeds: summaries, Student t intervals, and intervals for ratios of paired means.

Plain Python (``math`` only), so ``compare`` and ``probe`` need neither scipy nor numpy. Everything is paired by
seed: a seed fixes the initialisation and the data order, so the runs of one seed in two modes differ only by the
mode, and differences taken within a seed cancel the seed's own luck.

* :func:`mean_interval`: the two-sided Student t interval of a mean, ``mean +- t(1 - alpha/2, n - 1) sd / sqrt(n)``.
  With three seeds the 95% interval is 4.30 standard errors wide on each side (two standard errors are only an
  82% interval).
* :func:`ratio_interval`: Fieller's interval for ``mean(a) / mean(b)`` from paired values (the share of a gap a
  correction recovers: ``a = async - corrected``, ``b = async - sync`` per seed). It is bounded exactly when the
  denominator's own t interval excludes zero; otherwise every share is consistent with the data and the interval
  is the whole line (:attr:`Interval.bounded` is False).
* :func:`t_quantile`: the quantile of Student's t distribution, from its CDF (the regularized incomplete beta
  function, evaluated by its continued fraction) by bisection.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: the confidence level of every interval ``compare`` and ``probe`` print
LEVEL = 0.95


@dataclass
class Stat:
    """Summary of one quantity over seeds: mean, sample standard deviation (ddof=1), range, and the t interval."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if self.n > 1 else None

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def interval(self, level: float = LEVEL) -> Interval | None:
        """The t interval of the mean (None with fewer than two values)."""
        return mean_interval(self.values, level)


def stat(values: Sequence[float]) -> Stat | None:
    """:class:`Stat` of ``values``, or None when there are none."""
    return Stat(list(values)) if values else None


@dataclass(frozen=True)
class Interval:
    """A two-sided confidence interval ``[low, high]`` at ``level`` from ``n`` paired seeds (``low`` may be -inf and
    ``high`` +inf: an unbounded interval says the data do not pin the quantity down at all)."""

    low: float
    high: float
    level: float
    n: int

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    def excludes(self, value: float = 0.0) -> bool:
        """Whether ``value`` lies outside the interval (for 0: the quantity differs from 0 at this level)."""
        return value < self.low or value > self.high

    def below(self, value: float = 0.0) -> bool:
        """Whether the whole interval lies below ``value``."""
        return self.high < value

    def scaled(self, factor: float) -> Interval:
        """The interval of ``factor`` times the quantity (``factor`` > 0)."""
        return Interval(self.low * factor, self.high * factor, self.level, self.n)

    def describe(self, fmt: str = "{:+.3f}", unit: str = "") -> str:
        """``95% CI +0.128 to +0.342, n=3`` (``unbounded`` for the whole line)."""
        pct = f"{100 * self.level:g}%"
        if not self.bounded:
            return f"{pct} CI unbounded, n={self.n}"
        return f"{pct} CI {fmt.format(self.low)}{unit} to {fmt.format(self.high)}{unit}, n={self.n}"


# ---- Student's t distribution ----------------------------------------------------------------------
def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


def regularized_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, the regularized incomplete beta function, for ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``t_quantile(0.975, 2)`` = 4.303)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


def critical_t(n: int, level: float = LEVEL) -> float:
    """The two-sided critical value for a mean of ``n`` values: ``t(1 - (1 - level)/2, n - 1)``."""
    if n < 2:
        raise ValueError(f"an interval needs at least two values, got {n}")
    return t_quantile(0.5 + level / 2.0, n - 1)


# ---- intervals ----------------------------------------------------------------------------------------
def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval | None:
    """The t interval of the mean of ``values`` (None with fewer than two)."""
    n = len(values)
    if n < 2:
        return None
    mean = statistics.fmean(values)
    half = critical_t(n, level) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean - half, mean + half, level, n)


def _covariance(a: Sequence[float], b: Sequence[float]) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (len(a) - 1)


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float], level: float = LEVEL) -> Interval | None:
    """Fieller's interval for ``mean(numerators) / mean(denominators)`` from values paired by seed.

    The interval holds every ``r`` for which ``mean(a - r b) = 0`` passes the t test at ``level``:
    ``(mean a - r mean b)^2 <= t^2 var(a - r b) / n``, a quadratic ``A r^2 - 2 B r + C <= 0``. With ``A > 0``
    (the denominator's t interval excludes zero) it is ``[(B - sqrt(B^2 - AC)) / A, (B + sqrt(B^2 - AC)) / A]``;
    otherwise it is unbounded and returned as ``[-inf, +inf]``. None with fewer than two pairs.
    """
    n = len(numerators)
    if n != len(denominators):
        raise ValueError(f"paired values needed: {n} numerators, {len(denominators)} denominators")
    if n < 2:
        return None
    q = critical_t(n, level) ** 2 / n
    ma, mb = statistics.fmean(numerators), statistics.fmean(denominators)
    saa, sbb = statistics.variance(numerators), statistics.variance(denominators)
    sab = _covariance(numerators, denominators)
    a_coef = mb * mb - q * sbb
    b_coef = ma * mb - q * sab
    c_coef = ma * ma - q * saa
    if a_coef <= 0:
        return Interval(-math.inf, math.inf, level, n)
    root = math.sqrt(max(0.0, b_coef * b_coef - a_coef * c_coef))
    return Interval((b_coef - root) / a_coef, (b_coef + root) / a_coef, level, n)


def paired_differences(first: dict, second: dict) -> list[float]:
    """``first[s] - second[s]`` for each seed ``s`` in both (ordered by seed)."""
    return [first[s] - second[s] for s in sorted(set(first) & set(second), key=lambda s: (s is None, s))]
