"""The three A/B runs without pytest: a comparison of two callables (:mod:`.comparison`), a tournament of several,
a measurement of one; each samples through :mod:`.sampling` and returns its result."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from . import inputs as owned_inputs
from . import stats, throughput, timing
from .ab_results import (
    ComparisonResult,
    MeasureResult,
    PairwiseResult,
    TournamentResult,
)
from .budget import Budget
from .comparison import _fresh_note
from .comparison import run_comparison as run_comparison  # re-exported: where callers have found it
from .modes import timer_for_mode
from .sampling import ceiling_source, measure_rounds, positive_times
from .spec import ABSpec


def _one_mode(spec: ABSpec, what: str) -> str:
    """The one mode a tournament or measurement runs in; several are refused (each needs its own run)."""
    if len(spec.modes) != 1:
        raise ValueError(f"a {what} runs in one measurement mode; got modes={spec.modes!r}: run one {what} per "
                         "mode (modes=('latency',))")
    return spec.modes[0]


def check_owned_inputs(inputs: Any, check: Any) -> None:
    """Refuse bad ``inputs=`` / ``check=`` before anything runs, naming the argument (as :class:`.spec.ABSpec`)."""
    ABSpec.build(None, inputs=inputs, check=check)


def _tournament_look(
    names: Sequence[str], times: Sequence[Sequence[float]], alpha_look: float, margin: float
) -> tuple[list[str], list[PairwiseResult]]:
    """Rank by the median of per-round centred log times; test every pair, Holm-adjusted across all pairs.

    Testing all pairs (not just "best vs the rest") keeps the error rate honest although the best is chosen
    from the same data.
    """
    import numpy as np

    logs = np.log(np.asarray(times, dtype=float))
    centred = logs - logs.mean(axis=0)  # per-round centring cancels drift shared by the round
    scores = np.median(centred, axis=1)
    order = [int(i) for i in np.argsort(scores, kind="stable")]
    ranking = [names[i] for i in order]
    pairs = [(order[a], order[b]) for a in range(len(order)) for b in range(a + 1, len(order))]
    interval_alpha = alpha_look / len(pairs)  # Bonferroni for the intervals, Holm for the tests
    analyses = [
        stats.analyse_log_ratios(logs[slow] - logs[fast], alpha=interval_alpha, margin=margin) for fast, slow in pairs
    ]
    adjusted = stats.holm([a.p_value for a in analyses])
    results = [
        PairwiseResult(
            faster=names[fast],
            slower=names[slow],
            verdict=stats.decide(p, a.ci, alpha_look, margin),
            speedup=a.speedup,
            ci=a.ci,
            p_value=p,
            p_value_raw=a.p_value,
        )
        for (fast, slow), a, p in zip(pairs, analyses, adjusted)
    ]
    return ranking, results


def tournament_variants(variants: Any) -> tuple[list[str], list[Callable[..., Any]]]:
    """The names (as text, as reports and ranges show them) and callables of a tournament's variants; ``ValueError``
    unless there are at least two, named apart as text, each its own callable object. Timed and profiled
    tournaments both take their variants through here, so a profile run refuses what the timed run would.

    >>> tournament_variants({1: len, "1": str})
    Traceback (most recent call last):
    ...
    ValueError: tournament variant names must be distinct as text, got ['1', '1']
    """
    if not isinstance(variants, Mapping) or len(variants) < 2:
        what = f"{len(variants)} variant(s)" if isinstance(variants, Mapping) else owned_inputs.brief(variants)
        raise ValueError(f"a tournament needs a mapping of at least two named callables, got {what}")
    names = [str(n) for n in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"tournament variant names must be distinct as text, got {names}")
    fns = list(variants.values())
    if len({id(f) for f in fns}) != len(fns):
        raise ValueError("each tournament variant must be its own callable object (wrap repeats in a lambda)")
    return names, fns


def run_tournament(
    variants: Mapping[str, Callable[[], Any]],
    budget: Any = None,
    *,
    name: str = "tournament",
    ceilings: throughput.CeilingMeter | None = None,
    **keywords: Any,
) -> TournamentResult:
    """Rank several zero-argument callables on one input by rounds of calls in random order.

    Stops when every pair involving the current best has a verdict, or when the budget is spent. ``flops`` and
    ``bytes``: numbers per call for every variant, or mappings of variant names to theirs (see
    :func:`run_comparison`). ``inputs`` and ``check``: as there; every variant's output on fresh inputs is
    checked against the first variant's.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).random(20_000)
    >>> t = run_tournament({"one": lambda: np.sort(x), "two": lambda: np.sort(np.concatenate([x, x]))},
    ...                    Budget(max_time=0.3))
    >>> t.best, t.ranking
    ('one', ['one', 'two'])
    """
    import numpy as np

    spec = ABSpec.build(budget, **keywords)
    budget, inputs, check, dtype = spec.budget, spec.inputs.make, spec.inputs.check, spec.work.dtype
    flops, bytes = spec.work.flops, spec.work.bytes  # noqa: A001
    mode = _one_mode(spec, "tournament")
    names, fns = tournament_variants(variants)
    flops_of = throughput.per_variant(flops, names, "flops")
    bytes_of = throughput.per_variant(bytes, names, "bytes")
    work = {n: throughput.Work.of(flops_of[n], bytes_of[n], what=f"variant {n!r}: ") for n in names}
    looks = budget.planned_looks
    alpha_look = budget.alpha / looks
    latest: dict[str, Any] = {}

    def on_look(samples: timing.RoundSamples) -> bool:
        for name, times in zip(names, samples.times):
            positive_times(times, f"variant {name!r}")
        ranking, pairwise = _tournament_look(names, samples.times, alpha_look, budget.margin)
        latest["ranking"], latest["pairwise"] = ranking, pairwise
        return all(p.verdict != "inconclusive" for p in pairwise if p.faster == ranking[0])

    measured = measure_rounds(fns, [f"variant {n!r}" for n in names], budget, timer_for_mode(spec.timer, mode),
                              on_look, ceiling_source(any(w.given for w in work.values()), dtype, ceilings),
                              make_inputs=inputs, mode=mode)
    if inputs is not None:
        for variant, fn in zip(names[1:], fns[1:]):
            owned_inputs.check_fresh_outputs(fn, fns[0], inputs, check, candidate_side=f"variant {variant!r}",
                                             baseline_side=f"variant {names[0]!r}")
        measured.notes.append(_fresh_note(check, f"variant {names[0]!r}'s"))

    ranking, pairwise = latest["ranking"], latest["pairwise"]
    if measured.unresolved:  # as for a comparison: no pair is told apart on samples within a few ticks
        pairwise = [dataclasses.replace(pair, verdict="inconclusive") for pair in pairwise]
        measured.notes.append(measured.unresolved)
    best = ranking[0]
    separated = {p.slower for p in pairwise if p.faster == best and p.verdict == "win"}
    median_ms = {n: float(np.median(t)) * 1e3 for n, t in zip(names, measured.samples.times)}
    rates = {n: throughput.achieved(work[n], median_ms[n] / 1e3, measured.ceiling) for n in names}
    return TournamentResult(
        name=name,
        ranking=ranking,
        best=best,
        indistinguishable_from_best=[v for v in ranking if v not in separated],
        median_ms=median_ms,
        pairwise=pairwise,
        n_rounds=measured.samples.n_rounds,
        method=measured.method,
        calls_per_sample=measured.calls_per_sample,
        alpha=budget.alpha,
        margin=budget.margin,
        ci_level=1 - alpha_look / max(1, len(pairwise)),
        looks_planned=looks,
        looks_done=measured.looks_done,
        stop_reason=measured.stop_reason,
        elapsed_s=measured.elapsed_s,
        device=measured.device,
        clock=measured.clock,
        throttled=measured.throttled,
        samples_ms={n: [t * 1e3 for t in times] for n, times in zip(names, measured.samples.times)},
        orders=[[names[i] for i in order] for order in measured.samples.orders],
        notes=measured.notes,
        throughput={n: r for n, r in rates.items() if r is not None},
        ceiling=measured.ceiling,
        input_sets=measured.input_sets,
    )


def run_measurement(
    fn: Callable[[], Any],
    budget: Any = None,
    *,
    name: str = "measurement",
    ceilings: throughput.CeilingMeter | None = None,
    **keywords: Any,
) -> MeasureResult:
    """Time one zero-argument callable alone, with the timers, warm-up and batching of comparisons.

    ``inputs``: as for :func:`run_comparison`, the input sets rotate between calls (there is no baseline to
    check the output against).

    Samples are taken until, at a look (20, 40, 80, ... samples), the interval for the median call time is
    within the margin (its upper end at most ``1 + margin`` times its lower end), or until the budget is spent.
    The interval is the order-statistic one of :func:`pytest_kernelcheck.speed.stats.median_interval` at
    ``alpha / planned looks``. Unlike a comparison this is an absolute time, so drift between runs is not
    cancelled: compare two functions with :func:`run_comparison`.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).random(20_000)
    >>> m = run_measurement(lambda: np.sort(x), Budget(max_time=0.2), flops=20_000 * 15)
    >>> m.ci_ms[0] <= m.median_ms <= m.ci_ms[1], m.throughput.tflops > 0
    (True, True)
    """
    import numpy as np

    spec = ABSpec.build(budget, **keywords)
    if spec.inputs.check is not None:
        raise TypeError("check= does not apply to a measurement: there is no baseline to compare the output with")
    budget, inputs, dtype = spec.budget, spec.inputs.make, spec.work.dtype
    mode = _one_mode(spec, "measurement")
    work = throughput.Work.of(spec.work.flops, spec.work.bytes)
    looks = budget.planned_looks
    alpha_look = budget.alpha / looks

    def on_look(samples: timing.RoundSamples) -> bool:
        low, high = stats.median_interval(positive_times(samples.times[0], "the measured function"), alpha_look)
        return math.isfinite(low) and math.isfinite(high) and high <= low * (1 + budget.margin)

    measured = measure_rounds([fn], ["the measured function"], budget, timer_for_mode(spec.timer, mode), on_look,
                              ceiling_source(work.given, dtype, ceilings), make_inputs=inputs, mode=mode)
    if measured.unresolved:  # the interval of samples within a few ticks is the clock's rounding, not the call's
        measured.notes.append(measured.unresolved)
    seconds = measured.samples.times[0]
    median_s = float(np.median(seconds))
    low, high = stats.median_interval(seconds, alpha_look)
    return MeasureResult(
        name=name, median_ms=median_s * 1e3, ci_ms=(low * 1e3, high * 1e3), ci_level=1 - alpha_look,
        n_samples=len(seconds), samples_ms=[t * 1e3 for t in seconds], method=measured.method,
        calls_per_sample=measured.calls_per_sample, alpha=budget.alpha, margin=budget.margin, looks_planned=looks,
        looks_done=measured.looks_done,
        stop_reason="precise" if measured.stop_reason == "decided" else measured.stop_reason,
        elapsed_s=measured.elapsed_s, device=measured.device, clock=measured.clock, throttled=measured.throttled,
        notes=measured.notes, throughput=throughput.achieved(work, median_s, measured.ceiling),
        ceiling=measured.ceiling, input_sets=measured.input_sets,
    )
