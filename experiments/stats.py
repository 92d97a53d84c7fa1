"""Pure statistics of the experiment reports: mean and standard error, differences (paired by seed or not), the
two-sided Fisher exact test of a 2 x 2 table, the binomial standard error of a rate, and the reports' verdict rule
(an effect only at 2 standard errors or more). No dependencies beyond the standard library; exact tests against
hand-computed values in tests/test_experiment_stats.py."""

from __future__ import annotations

import math
import statistics

THRESHOLD = 2.0  # a difference is called an effect only at |difference| >= THRESHOLD standard errors
NO_DIFFERENCE = "no measurable difference"


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation, n - 1, over sqrt(n)); SE is nan for one value."""
    if not values:
        raise ValueError("mean_se of no values")
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def paired_difference(a: dict, b: dict) -> tuple[float, float, int]:
    """a - b paired by key (seed) over the keys both have: mean and SE of the per-key differences, and their count."""
    keys = [k for k in a if k in b]
    if not keys:
        raise ValueError("no key (seed) in common")
    m, se = mean_se([a[k] - b[k] for k in keys])
    return m, se, len(keys)


def unpaired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a) - mean(b) and its standard error sqrt(SE_a^2 + SE_b^2) (independent samples)."""
    (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
    return ma - mb, math.hypot(sa, sb)


def binomial_se(p: float, n: int) -> float:
    """Standard error of a rate p measured on n independent trials: sqrt(p (1 - p) / n)."""
    if n < 1 or not 0.0 <= p <= 1.0:
        raise ValueError(f"binomial_se needs 0 <= p <= 1 and n >= 1, got p={p}, n={n}")
    return math.sqrt(p * (1.0 - p) / n)


def _hypergeom(k: int, row1: int, col1: int, total: int) -> float:
    """P(top-left cell = k) for a 2 x 2 table with fixed margins (first row sum row1, first column sum col1)."""
    return math.comb(col1, k) * math.comb(total - col1, row1 - k) / math.comb(total, row1)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p value of Fisher's exact test for the table [[a, b], [c, d]]: the summed probability, under fixed
    margins, of every table no more probable than the observed one (relative tolerance 1e-7, as scipy.stats)."""
    if min(a, b, c, d) < 0:
        raise ValueError("counts must be >= 0")
    row1, col1, total = a + b, a + c, a + b + c + d
    lo, hi = max(0, row1 + col1 - total), min(row1, col1)
    observed = _hypergeom(a, row1, col1, total)
    p = sum(q for k in range(lo, hi + 1) if (q := _hypergeom(k, row1, col1, total)) <= observed * (1 + 1e-7))
    return min(1.0, p)


def z_score(diff: float, se: float) -> float:
    """|diff| / se; inf for a non-zero difference with SE 0, nan without an SE (one value) or for 0 / 0."""
    if math.isnan(se) or (se == 0 and diff == 0):
        return float("nan")
    return math.inf if se == 0 else abs(diff) / se


MIN_N = 3  # fewer values give an SE too unreliable to judge by (with 2, t at 95% is 12.7, not 2)


def verdict(diff: float, se: float, n: int | None = None) -> str:
    """The reports' rule: "effect" at |diff| >= 2 SE, else "no measurable difference"; without a verdict where the SE
    rests on fewer than MIN_N values (n given) or there is none."""
    if n is not None and n < MIN_N:
        return f"too few values (n={n}) for a verdict"
    z = z_score(diff, se)
    if math.isnan(z):
        return "no SE (one value)" if math.isnan(se) else NO_DIFFERENCE
    return "effect" if z >= THRESHOLD else NO_DIFFERENCE


def fisher_verdict(p: float, alpha: float = 0.05) -> str:
    """The count comparisons' counterpart of the 2 SE rule (about p < 0.05 for a normal statistic)."""
    return "effect" if p < alpha else NO_DIFFERENCE


def fmt_mean_se(values: list[float], digits: int = 3) -> str:
    """'mean ± SE (n=N)'; one value: 'value (n=1)'."""
    m, se = mean_se(values)
    core = f"{m:.{digits}f}" if len(values) == 1 else f"{m:.{digits}f} ± {se:.{digits}f}"
    return f"{core} (n={len(values)})"


def fmt_diff(diff: float, se: float, digits: int = 3) -> str:
    """A signed difference with its SE: '+0.012 ± 0.004'."""
    return f"{diff:+.{digits}f} ± {se:.{digits}f}"


def fmt_z(diff: float, se: float) -> str:
    """The difference in standard errors, two decimals ('2.13'); 'inf' for SE 0, '-' without an SE."""
    z = z_score(diff, se)
    return "-" if math.isnan(z) else ("inf" if math.isinf(z) else f"{z:.2f}")
