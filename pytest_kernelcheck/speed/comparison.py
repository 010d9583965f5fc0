"""A comparison of two callables without pytest: their outputs compared first, then, for each measurement mode
(:mod:`.modes`), its own paired, interleaved samples, statistics and verdict; the first mode that could run gives
the comparison's verdict."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from ..results.records import ModeRecord, finite_interval
from . import inputs as owned_inputs
from . import stats, throughput, timing
from .ab_results import ComparisonResult
from .budget import Budget  # noqa: F401  (the doctest's)
from .modes import ModeUnavailable, modes_disagree, timer_for_mode
from .sampling import Measurement, ceiling_source, log_ratios, measure_rounds
from .spec import ABSpec


def run_comparison(
    candidate: Callable[[], Any],
    baseline: Callable[[], Any],
    budget: Any = None,
    *,
    name: str = "comparison",
    ceilings: throughput.CeilingMeter | None = None,
    **keywords: Any,
) -> ComparisonResult:
    """Time two zero-argument callables in interleaved pairs and return the verdict for the candidate.

    ``budget``: a :class:`.budget.Budget` or an :class:`.spec.ABSpec`; ``keywords`` are the spec's (``timer``,
    ``flops``, ``bytes``, ``dtype``, ``inputs``, ``check``, ``modes``) and the budget's, checked once by
    :meth:`.spec.ABSpec.build`.

    Before timing, the first outputs are compared whenever both sides return tensors or arrays (``check``: the
    policy of the output's dtype by default, a policy, a callable that raises, or ``False`` to skip), raising
    :class:`pytest_kernelcheck.speed.inputs.OutputMismatch`. ``inputs``: a zero-argument callable returning a
    tuple of arguments or a dict of keyword arguments; the callables then take them, the plugin rotates several
    input sets and, after timing, checks the outputs on fresh inputs under ``check``
    (:class:`pytest_kernelcheck.speed.inputs.FreshOutputMismatch`).

    ``modes``: ``throughput`` (default), ``latency``, ``graph`` or several (:mod:`.modes`); each gets its own
    samples and verdict in ``result.modes``, and the first that could run gives ``result.verdict``. ``timer``:
    ``None``/``"auto"`` (CUDA events when outputs live on a GPU, else the CPU clock), ``"cpu"``, ``"cuda"``, an
    object following :class:`pytest_kernelcheck.speed.timing.Timer`, or a mapping of mode names to such timers.
    ``flops`` and ``bytes`` (per call, the same for both sides) give both sides' TFLOP/s and GB/s, rated against
    the ``dtype`` ceiling of ``ceilings`` when given.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).random(20_000)
    >>> r = run_comparison(lambda: np.sort(x), lambda: np.sort(np.concatenate([x, x]))[::2], Budget(max_time=0.3),
    ...                    check=False)
    >>> r.verdict
    'win'
    >>> rng = np.random.default_rng(1)
    >>> r = run_comparison(np.sort, lambda v: np.sort(np.concatenate([v, v]))[::2], Budget(max_time=0.3),
    ...                    inputs=lambda: (rng.random(20_000),))
    >>> r.verdict, r.input_sets
    ('win', 3)
    """
    spec = ABSpec.build(budget, **keywords)
    inputs, check = spec.inputs.make, spec.inputs.check
    work = throughput.Work.of(spec.work.flops, spec.work.bytes)
    first_check_notes: list[str] = []

    def check_first(first_outputs: Any) -> None:
        first_check_notes.append(owned_inputs.check_first_outputs(first_outputs[0], first_outputs[1], check))

    ran: dict[str, tuple[stats.PairedAnalysis, Measurement]] = {}
    records: dict[str, ModeRecord] = {}
    for mode in spec.modes:
        try:
            analysis, measured = _sample_mode(
                candidate, baseline, spec, mode, name, work, ceilings,
                check_first if inputs is None and not first_check_notes else None)
        except ModeUnavailable as exc:
            records[mode] = ModeRecord(mode, unavailable=str(exc))
            continue
        ran[mode] = analysis, measured
        records[mode] = _mode_record(mode, analysis, measured, spec.budget.planned_looks)
    if not ran:
        raise ModeUnavailable("no requested mode could measure this comparison: " + "; ".join(
            f"{mode}: {record.unavailable}" for mode, record in records.items()))
    mode = next(iter(ran))
    analysis, measured = ran[mode]
    notes = first_check_notes + list(measured.notes)
    for other, (_, other_measured) in ran.items():
        if other != mode:
            notes += [f"[{other}] {note}" for note in other_measured.notes if note not in measured.notes]
    notes += [f"[{m}] not available: {r.unavailable}" for m, r in records.items() if not r.available]
    if modes_disagree({m: r.verdict for m, r in records.items() if r.available}):
        notes.append("verdicts disagree across modes: " + ", ".join(
            f"{m} {r.verdict}" for m, r in records.items() if r.available)
            + "; the mode that matches how the code is called decides (latency: one call from an idle GPU; "
            "throughput: back to back; graph: captured)")
    if inputs is not None:
        owned_inputs.check_fresh_outputs(candidate, baseline, inputs, check)
        notes.append(_fresh_note(check, "the baseline's"))
    budget = spec.budget
    candidate_ms, baseline_ms = records[mode].candidate_ms, records[mode].baseline_ms
    return ComparisonResult(
        name=name, verdict=analysis.verdict, speedup=analysis.speedup, ci=analysis.ci, ci_level=analysis.level,
        p_value=min(1.0, analysis.p_value * budget.planned_looks), p_value_raw=analysis.p_value,
        n_pairs=analysis.n_pairs, candidate_ms=candidate_ms, baseline_ms=baseline_ms, method=measured.method,
        calls_per_sample=measured.calls_per_sample,
        flush_l2=budget.flush_l2 and measured.method.startswith(("events", "cuda-graph")),
        alpha=budget.alpha, margin=budget.margin, looks_planned=budget.planned_looks, looks_done=measured.looks_done,
        stop_reason=measured.stop_reason, elapsed_s=sum(m.elapsed_s for _, m in ran.values()),
        device=measured.device, clock=measured.clock, throttled=measured.throttled,
        candidate_samples_ms=[t * 1e3 for t in measured.samples.times[0]],
        baseline_samples_ms=[t * 1e3 for t in measured.samples.times[1]],
        candidate_first=[order[0] == 0 for order in measured.samples.orders], notes=notes,
        candidate_throughput=throughput.achieved(work, candidate_ms / 1e3, measured.ceiling),
        baseline_throughput=throughput.achieved(work, baseline_ms / 1e3, measured.ceiling),
        ceiling=measured.ceiling, input_sets=measured.input_sets, mode=mode, modes=records,
    )


def _sample_mode(
    candidate: Callable[..., Any], baseline: Callable[..., Any], spec: ABSpec, mode: str, name: str,
    work: throughput.Work, ceilings: throughput.CeilingMeter | None, check_first: Any,
) -> tuple[stats.PairedAnalysis, Measurement]:
    """One mode's samples and their analysis at the last look (inconclusive where the timer cannot resolve them)."""
    budget = spec.budget
    looks = budget.planned_looks
    alpha_look = budget.alpha / looks
    latest: dict[str, Any] = {}

    def on_look(samples: timing.RoundSamples) -> bool:
        if not all(t > 0 for times in samples.times for t in times):
            # A sample read as 0 s: the calls took less than one tick. More samples cannot help; after sampling,
            # a coarse timer makes this inconclusive (timer_resolution) and an exact one an error.
            latest["below_a_tick"] = samples
            latest["analysis"] = stats.PairedAnalysis(samples.n_rounds, math.nan, (0.0, math.inf), 1.0,
                                                      1 - alpha_look, "inconclusive")
            return True
        d = log_ratios(samples.times[1], samples.times[0], ("baseline", "candidate"))
        latest["analysis"] = stats.analyse_log_ratios(d, alpha=alpha_look, margin=budget.margin)
        return latest["analysis"].verdict != "inconclusive"

    measured = measure_rounds([candidate, baseline], ["candidate", "baseline"], budget,
                              timer_for_mode(spec.timer, mode), on_look,
                              ceiling_source(work.given, spec.work.dtype, ceilings), make_inputs=spec.inputs.make,
                              mode=mode, check_first=check_first)
    analysis = latest["analysis"]
    if "below_a_tick" in latest and not measured.unresolved:  # an exact clock read 0 s: the timer is wrong
        zero = latest["below_a_tick"]
        log_ratios(zero.times[1], zero.times[0], ("baseline", "candidate"))  # raises, naming the side
    if measured.unresolved:  # samples within a few ticks: no verdict the timer could not have seen
        analysis = dataclasses.replace(analysis, verdict="inconclusive")
        measured.notes.append(measured.unresolved)
    return analysis, measured


def _mode_record(mode: str, analysis: stats.PairedAnalysis, measured: Measurement, looks: int) -> ModeRecord:
    import numpy as np

    device = measured.device_ms or [None, None]
    return ModeRecord(
        mode, verdict=analysis.verdict, speedup=analysis.speedup if math.isfinite(analysis.speedup) else None,
        ci=finite_interval(analysis.ci), p_value=min(1.0, analysis.p_value * looks), p_value_raw=analysis.p_value,
        n_pairs=analysis.n_pairs, candidate_ms=float(np.median(measured.samples.times[0])) * 1e3,
        baseline_ms=float(np.median(measured.samples.times[1])) * 1e3, method=measured.method,
        candidate_device_ms=device[0], baseline_device_ms=device[1],
        candidate_samples_ms=tuple(t * 1e3 for t in measured.samples.times[0]),
        baseline_samples_ms=tuple(t * 1e3 for t in measured.samples.times[1]),
    )


def _fresh_note(check: Any, against: str) -> str:
    if check is False:
        return "inputs owned by the plugin; the check on fresh inputs is off (check=False)"
    how = "a callable" if callable(check) and not isinstance(check, bool) else (
        "the policy of the output's dtype" if check in (None, True) else f"policy {check}")
    return f"inputs owned by the plugin; outputs on fresh inputs matched {against} ({how})"
