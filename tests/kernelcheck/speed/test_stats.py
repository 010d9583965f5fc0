"""The A/B statistics are honest: A/A gives few false verdicts, known slowdowns are found, drift fools nothing.

Timings come from ``SimulatedTimer`` (seeded, on a virtual clock), so these run on any CPU in seconds and the
truth is known. False-verdict rates are checked against ``alpha + 3 * sqrt(alpha * (1 - alpha) / n)``: the
rate a correct procedure stays under with probability ~0.999 (normal approximation to Binomial(n, alpha)).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from pytest_kernelcheck import Budget, run_comparison, run_tournament
from pytest_kernelcheck.speed import stats
from pytest_kernelcheck.speed.timing import SimulatedTimer

ALPHA = 0.05
CALL_S = 0.5e-3  # simulated call: 1 ms per pair, so the default 2 s budget allows ~2000 pairs


def false_rate_bound(alpha: float, n: int) -> float:
    return alpha + 3 * math.sqrt(alpha * (1 - alpha) / n)


def lognormal(median_s: float, sd_log: float):
    return lambda rng, now: median_s * math.exp(rng.gauss(0.0, sd_log))


def simulate(candidate_model, baseline_model, seed: int, **budget):
    candidate, baseline = (lambda: None), (lambda: None)
    timer = SimulatedTimer({candidate: candidate_model, baseline: baseline_model}, seed=seed)
    return run_comparison(candidate, baseline, Budget(seed=seed, **budget), timer=timer)


def test_aa_false_verdict_rate_is_at_most_alpha():
    runs = 400
    per_side = 0.1 / math.sqrt(2)  # sd 0.1 of the per-pair log ratio, mid-range of the H200 A/A figures
    side = lognormal(CALL_S, per_side)
    verdicts = [simulate(side, side, seed).verdict for seed in range(runs)]
    false = sum(v in ("win", "loss") for v in verdicts)
    assert false / runs <= false_rate_bound(ALPHA, runs), f"{false} false verdicts in {runs} A/A runs"
    # The procedure must still be able to say "tie" for identical sides within the default budget.
    assert verdicts.count("tie") / runs > 0.5


def test_aa_same_callable_on_both_sides_is_not_a_verdict():
    shared = lambda: None  # noqa: E731
    timer = SimulatedTimer({shared: lognormal(CALL_S, 0.1)}, seed=3)
    result = run_comparison(shared, shared, Budget(seed=3), timer=timer)
    assert result.verdict in ("tie", "inconclusive")
    assert result.ci[0] < 1 < result.ci[1]


@pytest.mark.parametrize(
    "slowdown, sd_ratio, min_win_rate",
    [(1.10, 0.08, 0.95), (1.10, 0.16, 0.95), (1.03, 0.08, 0.5), (1.03, 0.05, 0.5)],
)
def test_power_known_slowdown_of_the_baseline_is_a_win(slowdown, sd_ratio, min_win_rate):
    runs = 60
    per_side = sd_ratio / math.sqrt(2)  # sd of the log ratio of two independent sides
    results = [
        simulate(lognormal(CALL_S, per_side), lognormal(CALL_S * slowdown, per_side), seed) for seed in range(runs)
    ]
    wins = sum(r.verdict == "win" for r in results)
    assert wins / runs >= min_win_rate, [r.verdict for r in results]
    assert not any(r.verdict == "loss" for r in results)
    assert all(r.elapsed_s <= Budget().max_time + 0.1 for r in results)  # within the default budget
    # The estimate is centred on the truth.
    assert abs(np.median([r.speedup for r in results]) / slowdown - 1) < 0.01


def test_loss_is_the_mirror_of_win():
    result = simulate(lognormal(CALL_S * 1.1, 0.05), lognormal(CALL_S, 0.05), seed=7)
    assert result.verdict == "loss"
    assert result.ci[1] < 1 and result.speedup == pytest.approx(1 / 1.1, rel=0.02)


def test_real_but_negligible_difference_is_a_tie():
    # 0.5% slower baseline with little noise: significant with enough pairs, but inside the 2% margin.
    result = simulate(lognormal(CALL_S, 0.01), lognormal(CALL_S * 1.005, 0.01), seed=11)
    assert result.verdict == "tie"
    assert 1 / 1.02 <= result.ci[0] and result.ci[1] <= 1.02


def drifting(median_s: float, sd_log: float, growth: float, over_s: float):
    # Times grow linearly by ``growth`` over ``over_s`` seconds of the (virtual) clock, for both sides alike.
    return lambda rng, now: median_s * (1 + growth * min(now, over_s) / over_s) * math.exp(rng.gauss(0.0, sd_log))


def test_drift_does_not_create_false_verdicts_because_pairs_are_interleaved():
    runs = 200
    results = [
        simulate(drifting(CALL_S, 0.05, 0.3, 2.0), drifting(CALL_S, 0.05, 0.3, 2.0), seed, min_pairs=40)
        for seed in range(runs)
    ]
    false = sum(r.verdict in ("win", "loss") for r in results)
    assert false / runs <= false_rate_bound(ALPHA, runs)


def test_unpaired_comparison_would_be_fooled_by_the_same_drift():
    # Same two identical sides, timed in two blocks (all candidate calls, then all baseline calls).
    candidate, baseline = (lambda: None), (lambda: None)
    model = drifting(CALL_S, 0.05, 0.3, 2.0)
    timer = SimulatedTimer({candidate: model, baseline: model}, seed=1)
    first_block = timer.time_calls([candidate] * 1000, 1)
    second_block = timer.time_calls([baseline] * 1000, 1)
    p = scipy_stats.mannwhitneyu(first_block, second_block).pvalue
    assert p < 1e-6, "the drift should make the later block look slower"


def test_aa_tournament_rarely_separates_identical_variants():
    runs = 120
    separated = 0
    for seed in range(runs):
        fns = {name: (lambda: None) for name in "abc"}
        timer = SimulatedTimer({fn: lognormal(CALL_S, 0.08) for fn in fns.values()}, seed=seed)
        result = run_tournament(fns, Budget(seed=seed, max_time=1.0), timer=timer)
        separated += len(result.indistinguishable_from_best) < 3
    assert separated / runs <= false_rate_bound(ALPHA, runs)


def test_tournament_finds_the_slow_variant_and_keeps_the_tied_ones():
    fns = {name: (lambda: None) for name in ("fast_a", "fast_b", "slow")}
    models = {fns["fast_a"]: lognormal(CALL_S, 0.05), fns["fast_b"]: lognormal(CALL_S, 0.05)}
    models[fns["slow"]] = lognormal(CALL_S * 1.15, 0.05)
    result = run_tournament(fns, Budget(seed=5), timer=SimulatedTimer(models, seed=5))
    assert result.ranking[-1] == "slow"
    assert result.best in ("fast_a", "fast_b")
    assert set(result.indistinguishable_from_best) == {"fast_a", "fast_b"}
    versus = result.versus(result.best, "slow")
    assert versus.verdict == "win" and versus.ci[0] > 1.1
    assert len(result.pairwise) == 3


def test_median_interval_covers_the_median_of_a_skewed_distribution():
    rng = np.random.default_rng(0)
    trials, n, alpha = 2000, 25, 0.1
    true_median = math.log(2)  # exponential(1)
    covered = 0
    for _ in range(trials):
        low, high = stats.median_interval(rng.exponential(1.0, n), alpha)
        covered += low <= true_median <= high
    assert covered / trials >= 1 - alpha - 3 * math.sqrt(alpha * (1 - alpha) / trials)


def test_median_interval_is_unbounded_when_too_few_values():
    assert stats.median_interval([0.1, 0.2, 0.3], 0.01) == (-math.inf, math.inf)


def test_wilcoxon_matches_scipy_and_handles_degenerate_data():
    d = np.random.default_rng(1).normal(0.05, 0.1, 60)
    assert stats.wilcoxon_p_value(d) == pytest.approx(scipy_stats.wilcoxon(d, zero_method="zsplit").pvalue)
    assert stats.wilcoxon_p_value([0.0] * 12) == 1.0
    with pytest.raises(ValueError, match="finite"):
        stats.wilcoxon_p_value([0.1, float("nan"), 0.2])


@pytest.mark.parametrize(
    "p, ci, expected",
    [
        (0.001, (1.05, 1.2), "win"),
        (0.001, (0.8, 0.95), "loss"),
        (0.001, (1.001, 1.015), "tie"),  # significant but negligible: tie takes precedence
        (0.3, (0.99, 1.01), "tie"),
        (0.3, (0.9, 1.2), "inconclusive"),
        (0.001, (0.99, 1.2), "inconclusive"),  # test and interval disagree: no verdict
        (0.2, (1.05, 1.2), "inconclusive"),
    ],
)
def test_decide_precedence(p, ci, expected):
    assert stats.decide(p, ci, 0.01, 0.02) == expected


def test_look_schedule_and_bonferroni_level():
    assert stats.look_schedule(10, 10_240) == [10 * 2**k for k in range(11)]
    assert stats.look_schedule(5, 5) == [5]
    assert Budget().planned_looks == 10  # 20, 40, ..., 10240
    with pytest.raises(ValueError, match="min_pairs"):
        stats.look_schedule(0, 10)


def test_holm_and_benjamini_hochberg_against_hand_computed_values():
    p = [0.001, 0.02, 0.03, 0.5]
    assert stats.holm(p) == pytest.approx([0.004, 0.06, 0.06, 0.5])
    # BH: p_(i) * m / i with a running minimum from the top.
    assert stats.benjamini_hochberg(p) == pytest.approx([0.004, 0.04, 0.04, 0.5])
    assert stats.benjamini_hochberg([]) == []


def test_geometric_mean():
    assert stats.geometric_mean([1.21, 1.0]) == pytest.approx(1.1)
    assert math.isnan(stats.geometric_mean([]))
    with pytest.raises(ValueError, match="positive"):
        stats.geometric_mean([1.0, 0.0])


def test_simulated_timer_is_reproducible():
    fn = lambda: None  # noqa: E731
    a = SimulatedTimer({fn: lognormal(CALL_S, 0.1)}, seed=9).time_calls([fn] * 5, 1)
    b = SimulatedTimer({fn: lognormal(CALL_S, 0.1)}, seed=9).time_calls([fn] * 5, 1)
    assert a == b and len(set(a)) == 5
