"""Statistics behind A/B verdicts: paired tests, intervals, verdicts, and corrections for many looks and tests.

The data are paired log time ratios ``d_i = log(t_baseline_i / t_candidate_i)``, one per pair of back-to-back
calls run in random order, so ``d > 0`` means the candidate was faster in that pair.

Choices, and why:

- Primary test: the Wilcoxon signed-rank test on ``d``. With the order inside each pair randomised, an A/A
  comparison makes every ``d_i`` symmetric about 0 whatever the shape of the timing noise, which is exactly the
  null hypothesis of the signed-rank test; no normality is assumed. It is also robust to the occasional outlier
  pair (a context switch, a clock change) that would inflate a t-test's variance. scipy's implementation is used
  because it is well tested, handles ties and switches to the normal approximation for large samples.
- Interval: the distribution-free interval for the median of ``d`` from order statistics (the inversion of the
  sign test, with binomial quantiles from scipy). Its coverage is exact for any continuous distribution, it is
  deterministic, and it costs one sort, where a bootstrap of the median costs thousands of resamples of up to
  10^4 pairs at every look and has poor coverage for the median. The reported speedup is ``exp(median d)``, the
  centre of that interval.
- Verdict precedence: "tie" (interval inside the equivalence margin) wins over significance, so a real but
  negligible difference is reported as a tie; otherwise "win"/"loss" need both the signed-rank test to reject
  and the interval to exclude 1 on the same side; everything else is "inconclusive".
- Looks: the data are analysed after 20, 40, 80, ... pairs; each look uses ``alpha / planned_looks``
  (Bonferroni), so the chance of any false win/loss over all looks stays below ``alpha``. Correlated looks make
  this conservative, which costs a few more pairs but never honesty.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..results.records import VERDICTS, Verdict  # noqa: F401  (re-exported: the verdicts ``decide`` gives)


@dataclass(frozen=True)
class PairedAnalysis:
    """The statistics of one look at the paired log ratios (speedups are baseline time / candidate time)."""

    n_pairs: int
    speedup: float
    ci: tuple[float, float]
    p_value: float
    level: float
    verdict: Verdict


def look_schedule(min_pairs: int, max_pairs: int) -> list[int]:
    """Pair counts at which the data are analysed: ``min_pairs`` doubling up to ``max_pairs`` (always the last).

    >>> look_schedule(10, 100)
    [10, 20, 40, 80, 100]
    """
    if min_pairs < 1 or max_pairs < min_pairs:
        raise ValueError(f"need 1 <= min_pairs <= max_pairs, got min_pairs={min_pairs}, max_pairs={max_pairs}")
    looks = []
    n = min_pairs
    while n < max_pairs:
        looks.append(n)
        n *= 2
    looks.append(max_pairs)
    return looks


def wilcoxon_p_value(log_ratios: Sequence[float]) -> float:
    """Two-sided signed-rank p-value for "the log ratios are centred on 0".

    Zero differences are split between the signs ("zsplit"), which keeps them in the count and leans towards the
    null instead of dropping them. All-zero data carry no evidence and give 1.0.

    >>> round(wilcoxon_p_value([0.1, 0.2, 0.15, 0.3, 0.12, 0.22, 0.18, 0.25, 0.11, 0.2]), 4)
    0.002
    """
    import numpy as np
    from scipy import stats

    d = np.asarray(log_ratios, dtype=float)
    if d.size == 0 or not np.all(np.isfinite(d)):
        raise ValueError("log ratios must be a non-empty sequence of finite numbers")
    if np.all(d == 0):
        return 1.0
    return float(stats.wilcoxon(d, zero_method="zsplit").pvalue)


def median_interval(log_ratios: Sequence[float], alpha: float) -> tuple[float, float]:
    """Distribution-free two-sided ``1 - alpha`` interval for the median (order statistics, sign-test inversion).

    Returns ``(-inf, inf)`` when there are too few values for that level.

    >>> median_interval(list(range(1, 21)), 0.05)
    (6.0, 15.0)
    """
    import numpy as np
    from scipy import stats

    d = np.sort(np.asarray(log_ratios, dtype=float))
    n = d.size
    # Largest k with P(Binomial(n, 1/2) <= k - 1) <= alpha / 2: then [d_(k), d_(n-k+1)] covers the median with
    # probability >= 1 - alpha.
    k = int(stats.binom.ppf(alpha / 2, n, 0.5))
    if k >= 1 and stats.binom.cdf(k - 1, n, 0.5) > alpha / 2:  # guard the discrete quantile's edge
        k -= 1
    if k < 1:
        return (-math.inf, math.inf)
    return (float(d[k - 1]), float(d[n - k]))


def decide(p_value: float, ci: tuple[float, float], alpha: float, margin: float) -> Verdict:
    """Verdict from the candidate's side, given a p-value and an interval for the speedup.

    "tie" when the interval lies inside ``[1/(1+margin), 1+margin]`` (even if significant: the difference is too
    small to matter); else "win"/"loss" when ``p < alpha`` and the interval excludes 1 on that side; else
    "inconclusive".

    >>> decide(0.001, (1.05, 1.12), 0.05, 0.02)
    'win'
    >>> decide(0.001, (1.005, 1.012), 0.05, 0.02)
    'tie'
    """
    low, high = ci
    if margin > 0 and low >= 1 / (1 + margin) and high <= 1 + margin:
        return "tie"
    if p_value < alpha and low > 1:
        return "win"
    if p_value < alpha and high < 1:
        return "loss"
    return "inconclusive"


def decimals(value: float, against: float = 1.0, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals, or as many more as it takes for the printed number to sit on the same side
    of ``against`` as ``value`` does (and not on it, unless ``value`` is ``against``).

    A verdict compares interval ends with 1 strictly (:func:`decide`), so a win whose interval starts at 1.0004,
    rounded to 3 decimals, read ``[1.000, 1.040] win``: an interval touching 1 beside a verdict that says it does
    not. Rounding outward would not help (1.0004 rounds down to 1.000 too); more digits do.

    >>> decimals(1.0004), decimals(0.99996), decimals(1.2), decimals(1.0), decimals(0.94996, against=0.95)
    ('1.0004', '0.99996', '1.200', '1.000', '0.94996')
    """
    text = f"{value:.{digits}f}"
    if not math.isfinite(value) or value == against:
        return text
    for more in range(digits + 1, 18):  # 17 decimals tell any two floats near 1 apart
        printed = float(text)
        if printed != against and (printed > against) == (value > against):
            break
        text = f"{value:.{more}f}"
    return text


def decimals_apart(a: float, b: float, digits: int = 3) -> tuple[str, str]:
    """``a`` and ``b`` with the same number of decimals, ``digits`` or as many more as it takes to print them apart
    (rounding is monotonic, so their order shows too): a finding "1.175 < 1.175" contradicts itself.

    >>> decimals_apart(1.17496, 1.17502), decimals_apart(1.5, 2.0)
    (('1.17496', '1.17502'), ('1.500', '2.000'))
    """
    if not (math.isfinite(a) and math.isfinite(b)) or a == b:
        return f"{a:.{digits}f}", f"{b:.{digits}f}"
    for more in range(digits, 18):
        texts = f"{a:.{more}f}", f"{b:.{more}f}"
        if texts[0] != texts[1]:
            break
    return texts


def analyse_log_ratios(log_ratios: Sequence[float], *, alpha: float, margin: float) -> PairedAnalysis:
    """Test, interval and verdict for one look at the paired log ratios, at level ``alpha`` (already corrected).

    >>> import numpy as np
    >>> a = analyse_log_ratios(np.random.default_rng(0).normal(0.1, 0.05, 200), alpha=0.01, margin=0.02)
    >>> a.verdict, round(a.speedup, 1)
    ('win', 1.1)
    """
    import numpy as np

    d = np.asarray(log_ratios, dtype=float)
    p = wilcoxon_p_value(d)
    low, high = median_interval(d, alpha)
    ci = (math.exp(low), math.exp(high))
    speedup = math.exp(float(np.median(d)))
    return PairedAnalysis(
        n_pairs=int(d.size),
        speedup=speedup,
        ci=ci,
        p_value=p,
        level=1 - alpha,
        verdict=decide(p, ci, alpha, margin),
    )


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (family-wise error control for a handful of tests).

    scipy has no Holm adjustment; this is the textbook step-down with running maximum.

    >>> holm([0.01, 0.04, 0.03])
    [0.03, 0.06, 0.06]
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = round(running, 15)
    return adjusted


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (false discovery rate across comparisons).

    Uses ``scipy.stats.false_discovery_control`` (scipy >= 1.11, well tested); older scipy gets the same
    step-up computed here.

    >>> [round(p, 3) for p in benjamini_hochberg([0.01, 0.04, 0.03, 0.5])]
    [0.04, 0.053, 0.053, 0.5]
    """
    if len(p_values) == 0:
        return []
    try:
        from scipy.stats import false_discovery_control
    except ImportError:  # scipy < 1.11
        m = len(p_values)
        order = sorted(range(m), key=lambda i: p_values[i], reverse=True)
        adjusted = [0.0] * m
        running = 1.0
        for position, i in enumerate(order):
            rank = m - position
            running = min(running, p_values[i] * m / rank)
            adjusted[i] = min(1.0, running)
        return adjusted
    return [float(p) for p in false_discovery_control(list(p_values), method="bh")]


def geometric_mean(values: Sequence[float]) -> float:
    """Geometric mean of positive numbers (the fair average of speedups); NaN for an empty sequence.

    >>> geometric_mean([2.0, 0.5])
    1.0
    """
    if len(values) == 0:
        return math.nan
    if any(not (v > 0) for v in values):
        raise ValueError(f"geometric mean needs positive values, got {list(values)}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


# CPU times whose 90th percentile is past this multiple of their 10th are bimodal or widely spread: a 64^3 matmul
# on two cores with torch's default thread pool took 16 ms in one test and 0.013 ms in another.
SPREAD_RATIO = 3.0


def spread_note(times: Sequence[float], side: str, ratio: float = SPREAD_RATIO) -> str | None:
    """A note for CPU samples whose 90th/10th percentile ratio exceeds ``ratio``, with the usual fix; else None.

    >>> spread_note([1e-3] * 50 + [16e-3] * 50, "candidate")  # doctest: +ELLIPSIS
    "candidate's CPU times are bimodal or widely spread: ... pass --kernel-ab-cpu-threads 1 ..."
    >>> spread_note([1e-3, 1.1e-3] * 20, "candidate") is None
    True
    """
    import numpy as np

    values = np.asarray(times, dtype=float)
    if values.size < 10:
        return None
    low, high = np.percentile(values, [10, 90])
    if low <= 0 or high / low <= ratio:
        return None
    return (f"{side}'s CPU times are bimodal or widely spread: the 90th percentile ({high * 1e3:.4g} ms) is "
            f"{high / low:.3g}x the 10th ({low * 1e3:.4g} ms), usually torch's thread pool contending for the "
            "cores; pass --kernel-ab-cpu-threads 1 (or torch.set_num_threads(1)) for stable times")
