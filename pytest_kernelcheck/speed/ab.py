"""A/B speed comparisons: the ``kernel_ab`` fixture object and the orchestration behind it.

``run_comparison``, ``run_tournament`` and ``run_measurement`` do the work and need no pytest: check the
callables, call each once (keeping its output), pick a timer, take the device lock, warm up, choose calls per
sample (or a CUDA graph), on CUDA check that the events see the callables' work (:mod:`.escape`), sample rounds
in random order with looks at 20, 40, 80, ... rounds until a verdict is clear (a measurement: until its interval
is within the margin) or the budget is spent, reading the SM clock between chunks of rounds and flagging,
dropping or failing on throttled rounds (:mod:`.clocks`), then check that every output is unchanged and, given
``flops``/``bytes``, fetch this device's ceiling (:mod:`.throughput`).
:class:`KernelAB` wraps them for tests: defaults from the command line, names, shapes, records for the report,
and assertion helpers.
"""
from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..results.records import (
    ABRecord,
    CeilingRecord,
    ClockRecord,
    ComparisonRecord,
    MeasurementRecord,
    PairwiseRecord,
    RunDetails,
    ThroughputRecord,
    TournamentRecord,
    finite_interval,
)
from . import clocks, escape, outputs, stats, throughput, timer_resolution, timing
from . import inputs as owned_inputs
from .gpu_lock import device_lock
from .stats import Verdict

__all__ = [
    "Budget",
    "ComparisonResult",
    "KernelAB",
    "KernelABAssertionError",
    "MeasureResult",
    "PairwiseResult",
    "TournamentResult",
    "run_comparison",
    "run_measurement",
    "run_tournament",
]

# Seconds of sampling (per comparison) that fit a default A/B budget: thousands of pairs for kernels under 1 ms.
DEFAULT_MAX_TIME_S = 2.0
# How long each look's chunk of rounds may run before the budget is checked again.
CHUNK_SECONDS = 0.05


@dataclass(frozen=True)
class Budget:
    """How long and how strictly one comparison samples; every field is a keyword of ``compare``.

    >>> Budget().replace(max_time=0.5, alpha=0.01).max_time
    0.5
    >>> Budget().replace(max_tme=1)
    Traceback (most recent call last):
    ...
    TypeError: unknown budget keyword 'max_tme'; expected one of: alpha, calls_per_sample, check_escape, check_output, flush_l2, hold_gpu, margin, max_pairs, max_time, min_pairs, seed, throttle, use_cuda_graph, warmup
    """

    max_time: float = DEFAULT_MAX_TIME_S  # seconds of sampling, after warm-up; min_pairs overrides it
    min_pairs: int = 20  # first look; never stop before it (20 pairs can reach p ~ 2e-6)
    max_pairs: int = 10_240  # last look (10 looks in all with min_pairs 20)
    alpha: float = 0.05  # false win/loss rate over all looks
    margin: float = 0.02  # equivalence margin: a speedup inside [1/1.02, 1.02] can be a tie
    flush_l2: bool = False  # CUDA only: overwrite twice the device's L2 before each sample
    hold_gpu: bool = False  # CUDA only: hold the GPU while a round is queued, so events time device work alone
    calls_per_sample: int | str = "auto"  # "auto": batch calls shorter than 50 us
    use_cuda_graph: bool | str = False  # True: always replay a graph; "auto": when calls are batched
    warmup: float = 0.025  # seconds of warm-up rounds (at least 3) before sampling
    check_output: bool = True  # outputs after timing must equal the first call's
    seed: int | None = None  # seeds the random order inside rounds
    throttle: str = "flag"  # rounds taken with the SM clock >10% below the session's highest: flag, discard, fail
    check_escape: bool = True  # CUDA only: fail when the events miss most of the work (see escape.py)

    def replace(self, **changes: Any) -> "Budget":
        known = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in known:
                raise TypeError(f"unknown budget keyword {key!r}; expected one of: {', '.join(sorted(known))}")
        budget = dataclasses.replace(self, **changes)
        budget.validate()
        return budget

    def validate(self) -> None:
        def positive_number(name: str, value: Any, allow_zero: bool = False) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"budget {name} must be a finite number of seconds, got {value!r}")
            if value < 0 or (value == 0 and not allow_zero):
                raise ValueError(f"budget {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")

        def positive_int(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"budget {name} must be a positive integer, got {value!r}")

        positive_number("max_time", self.max_time)
        positive_number("warmup", self.warmup, allow_zero=True)
        positive_int("min_pairs", self.min_pairs)
        positive_int("max_pairs", self.max_pairs)
        if self.max_pairs < self.min_pairs:
            raise ValueError(f"budget max_pairs ({self.max_pairs}) must be >= min_pairs ({self.min_pairs})")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < 1:
            raise ValueError(f"budget alpha must be between 0 and 1 (exclusive), got {self.alpha!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"budget margin must be in [0, 1) (0.02 means 2%), got {self.margin!r}")
        if self.calls_per_sample != "auto":
            positive_int("calls_per_sample", self.calls_per_sample)
        if self.use_cuda_graph not in (True, False, "auto"):
            raise ValueError(f"budget use_cuda_graph must be True, False or 'auto', got {self.use_cuda_graph!r}")
        clocks.check_policy(self.throttle)
        for name in ("flush_l2", "hold_gpu", "check_output", "check_escape"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"budget {name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"budget seed must be an integer or None, got {self.seed!r}")

    @property
    def planned_looks(self) -> int:
        return len(stats.look_schedule(self.min_pairs, self.max_pairs))


@dataclass
class ComparisonResult:
    """Outcome of ``compare``: speedup is baseline time / candidate time, verdicts are the candidate's."""

    name: str
    verdict: Verdict
    speedup: float
    ci: tuple[float, float]
    ci_level: float
    p_value: float  # corrected for the looks (Bonferroni), comparable with alpha
    p_value_raw: float  # signed-rank p-value at the last look
    n_pairs: int
    candidate_ms: float  # median per call
    baseline_ms: float
    method: str
    calls_per_sample: int
    flush_l2: bool
    alpha: float
    margin: float
    looks_planned: int
    looks_done: int
    stop_reason: str
    elapsed_s: float
    device: str
    clock: dict[str, Any]
    throttled: bool
    candidate_samples_ms: list[float]
    baseline_samples_ms: list[float]
    candidate_first: list[bool]
    notes: list[str] = field(default_factory=list)
    nodeid: str = ""
    shape: dict[str, Any] | None = None
    candidate_throughput: ThroughputRecord | None = None  # with flops= or bytes=
    baseline_throughput: ThroughputRecord | None = None
    ceiling: CeilingRecord | None = None
    input_sets: int | None = None  # with inputs=: how many sets the plugin built and rotated

    def describe(self) -> str:
        """One line with every number behind the verdict.

        >>> r = ComparisonResult("x", "win", 1.1, (1.05, 1.15), 0.995, 1e-4, 1e-5, 80, 1.0, 1.1, "cpu-clock", 1,
        ...     False, 0.05, 0.02, 11, 3, "decided", 0.2, "cpu", {}, False, [], [], [])
        >>> r.describe()
        'verdict win: speedup 1.100x, 99.5% CI [1.050, 1.150], p=0.0001, n=80 pairs, candidate 1 ms, baseline 1.1 ms (cpu-clock)'
        """
        return (
            f"verdict {self.verdict}: speedup {stats.decimals(self.speedup)}x, {_percent(self.ci_level)} CI "
            f"[{stats.decimals(self.ci[0])}, {stats.decimals(self.ci[1])}], p={self.p_value:.2g}, "
            f"n={self.n_pairs} pairs, "
            f"candidate {self.candidate_ms:.4g} ms, baseline {self.baseline_ms:.4g} ms ({self.method})"
            + _rates_text(self.candidate_throughput, "candidate")
        )

    def to_record(self) -> ComparisonRecord:
        """The report's row for this comparison (infinite interval ends become ``None``).

        >>> r = ComparisonResult("x", "tie", 1.0, (0.0, math.inf), 0.995, 0.5, 0.1, 20, 1.0, 1.0, "cpu-clock", 1,
        ...     False, 0.05, 0.02, 11, 1, "max_time", 0.2, "cpu", {}, False, [], [], [])
        >>> r.to_record().ci, r.to_record().to_json()["kind"]
        ((0.0, None), 'comparison')
        """
        return ComparisonRecord(
            # A speedup the timer could not read (samples of 0 s, timer_resolution) is NaN here and null in the row.
            self.name, self.verdict, nodeid=self.nodeid, shape=self.shape,
            speedup=self.speedup if math.isfinite(self.speedup) else None, ci=finite_interval(self.ci), p_value=self.p_value, p_value_raw=self.p_value_raw, n_pairs=self.n_pairs,
            candidate_ms=self.candidate_ms, baseline_ms=self.baseline_ms, flush_l2=self.flush_l2,
            run=_run_details(self), candidate_samples_ms=tuple(self.candidate_samples_ms),
            baseline_samples_ms=tuple(self.baseline_samples_ms), candidate_first=tuple(self.candidate_first),
            candidate_throughput=self.candidate_throughput, baseline_throughput=self.baseline_throughput,
            ceiling=self.ceiling,
        )


@dataclass
class PairwiseResult:
    """One pair of a tournament: ``speedup`` is ``slower``'s time over ``faster``'s (so >= 1 means as ranked)."""

    faster: str
    slower: str
    verdict: Verdict  # from ``faster``'s side: "win" means ``faster`` is significantly faster
    speedup: float
    ci: tuple[float, float]
    p_value: float  # Holm-adjusted across all pairs and corrected for the looks
    p_value_raw: float


@dataclass
class TournamentResult:
    """Outcome of ``tournament``: ranking best first and the variants the data cannot tell from the best."""

    name: str
    ranking: list[str]
    best: str
    indistinguishable_from_best: list[str]
    median_ms: dict[str, float]
    pairwise: list[PairwiseResult]
    n_rounds: int
    method: str
    calls_per_sample: int
    alpha: float
    margin: float
    ci_level: float
    looks_planned: int
    looks_done: int
    stop_reason: str
    elapsed_s: float
    device: str
    clock: dict[str, Any]
    throttled: bool
    samples_ms: dict[str, list[float]]
    orders: list[list[str]]
    notes: list[str] = field(default_factory=list)
    nodeid: str = ""
    shape: dict[str, Any] | None = None
    throughput: dict[str, ThroughputRecord] = field(default_factory=dict)  # variants given flops= or bytes=
    ceiling: CeilingRecord | None = None
    input_sets: int | None = None  # with inputs=: how many sets the plugin built and rotated

    def versus(self, a: str, b: str) -> PairwiseResult:
        """The pairwise result for two variant names, in either order."""
        for pair in self.pairwise:
            if {pair.faster, pair.slower} == {a, b}:
                return pair
        raise KeyError(f"no pairwise result for {a!r} and {b!r}; variants: {', '.join(self.ranking)}")

    def describe(self) -> str:
        parts = []
        for variant in self.ranking:
            text = f"{variant} {self.median_ms[variant]:.4g} ms"
            if variant != self.best:
                pair = self.versus(self.best, variant)
                text += (f" ({stats.decimals(pair.speedup)}x [{stats.decimals(pair.ci[0])}, "
                         f"{stats.decimals(pair.ci[1])}] vs best, {pair.verdict})")
            parts.append(text)
        return (
            f"best {self.best}; indistinguishable from best: {', '.join(self.indistinguishable_from_best)}; "
            f"ranking: {' > '.join(parts)}; n={self.n_rounds} rounds ({self.method})"
        )

    def to_record(self) -> TournamentRecord:
        """The report's row for this tournament (infinite interval ends become ``None``).

        >>> one, two = (lambda: None), (lambda: None)
        >>> timer = timing.SimulatedTimer({one: lambda rng, now: 1e-3, two: lambda rng, now: 2e-3})
        >>> record = run_tournament({"one": one, "two": two}, Budget(max_time=0.05), timer=timer).to_record()
        >>> record.best, record.pairwise[0].verdict
        ('one', 'win')
        """
        pairwise = tuple(
            PairwiseRecord(pair.faster, pair.slower, pair.verdict, pair.speedup, finite_interval(pair.ci),
                           pair.p_value, pair.p_value_raw)
            for pair in self.pairwise
        )
        return TournamentRecord(
            self.name, nodeid=self.nodeid, shape=self.shape, ranking=tuple(self.ranking), best=self.best,
            indistinguishable_from_best=tuple(self.indistinguishable_from_best), median_ms=dict(self.median_ms),
            pairwise=pairwise, n_rounds=self.n_rounds, run=_run_details(self),
            samples_ms={variant: tuple(times) for variant, times in self.samples_ms.items()},
            orders=tuple(tuple(order) for order in self.orders), throughput=dict(self.throughput),
            ceiling=self.ceiling,
        )


@dataclass
class MeasureResult:
    """Outcome of ``measure``: one function's median time per call, with an exact distribution-free interval.

    ``ci_ms`` covers the median call time with probability ``ci_level`` (order statistics, as the speedup
    intervals of comparisons; the level is ``1 - alpha / planned looks``).
    """

    name: str
    median_ms: float
    ci_ms: tuple[float, float]
    ci_level: float
    n_samples: int
    samples_ms: list[float]
    method: str
    calls_per_sample: int
    alpha: float
    margin: float
    looks_planned: int
    looks_done: int
    stop_reason: str  # "precise": the interval's ends lie within the margin of each other
    elapsed_s: float
    device: str
    clock: dict[str, Any]
    throttled: bool
    notes: list[str] = field(default_factory=list)
    nodeid: str = ""
    shape: dict[str, Any] | None = None
    throughput: ThroughputRecord | None = None
    ceiling: CeilingRecord | None = None
    input_sets: int | None = None  # with inputs=: how many sets the plugin built and rotated

    def describe(self) -> str:
        """One line: median, interval, samples and method, and the rates when work was given.

        >>> MeasureResult("copy", 2.0, (1.9, 2.1), 0.995, 40, [], "cpu-clock", 1, 0.05, 0.02, 10, 1, "precise",
        ...               0.1, "cpu", {}, False).describe()
        'copy: median 2 ms, 99.5% CI [1.9, 2.1] ms, n=40 samples (cpu-clock)'
        """
        return (f"{self.name}: median {self.median_ms:.4g} ms, {_percent(self.ci_level)} CI "
                f"[{self.ci_ms[0]:.4g}, {self.ci_ms[1]:.4g}] ms, n={self.n_samples} samples ({self.method})"
                + _rates_text(self.throughput, ""))

    def to_record(self) -> MeasurementRecord:
        """The report's row for this measurement.

        >>> fn = lambda: None
        >>> timer = timing.SimulatedTimer({fn: lambda rng, now: 1e-3})
        >>> run_measurement(fn, Budget(max_time=0.05), timer=timer, flops=1e9).to_record().throughput.tflops
        1.0
        """
        return MeasurementRecord(
            self.name, nodeid=self.nodeid, shape=self.shape, median_ms=self.median_ms,
            ci_ms=finite_interval(self.ci_ms), n_samples=self.n_samples, run=_run_details(self),
            samples_ms=tuple(self.samples_ms), throughput=self.throughput, ceiling=self.ceiling,
        )


def _rates_text(rates: ThroughputRecord | None, side: str) -> str:
    """``; candidate 412 TFLOP/s (55% of ceiling), 3.1e+03 GB/s`` for a describe line; empty without rates."""
    if rates is None:
        return ""
    parts = []
    for value, unit, share in ((rates.tflops, "TFLOP/s", rates.tflops_pct), (rates.gbps, "GB/s", rates.gbps_pct)):
        if value is not None:
            parts.append(f"{value:.4g} {unit}" + (f" ({share:.0f}% of ceiling)" if share is not None else ""))
    return f"; {side + ' ' if side else ''}{', '.join(parts)}" if parts else ""


def _run_details(result: ComparisonResult | TournamentResult | MeasureResult) -> RunDetails:
    """The columns a comparison's and a tournament's records share."""
    return RunDetails(
        method=result.method, calls_per_sample=result.calls_per_sample, alpha=result.alpha, margin=result.margin,
        ci_level=result.ci_level, looks_planned=result.looks_planned, looks_done=result.looks_done,
        stop_reason=result.stop_reason, elapsed_s=result.elapsed_s, device=result.device,
        clock=ClockRecord.from_json(result.clock),
        throttled=result.throttled, notes=tuple(result.notes), input_sets=result.input_sets,
    )


class KernelABAssertionError(AssertionError):
    """``assert_faster`` / ``assert_not_slower`` failed; the message carries the numbers."""


@dataclass
class _Measurement:
    samples: timing.RoundSamples  # the rounds the verdict used (throttle="discard" drops some)
    method: str
    calls_per_sample: int
    clock: dict[str, Any]  # clocks.ClockMonitor.summary()
    throttled: bool  # the SM clock fell below 90% of the session's highest (clocks.ClockMonitor.throttled)
    elapsed_s: float
    stop_reason: str
    looks_done: int
    device: str
    notes: list[str]
    ceiling: CeilingRecord | None = None
    input_sets: int | None = None
    unresolved: str | None = None  # why the timer cannot resolve the samples (timer_resolution); None when it can


# What a run asks for a ceiling: given the timer that timed it, the ceiling of that device (or None).
CeilingSource = Callable[[Any], "CeilingRecord | None"]


def _ceiling_source(
    work_given: bool, dtype: str | None, ceilings: throughput.CeilingMeter | None
) -> CeilingSource | None:
    """Ask ``ceilings`` only when there is work to rate against it."""
    if not work_given or ceilings is None:
        return None
    return lambda timer: ceilings.ceiling_for(timer, dtype)


def _resolve_timer(timer: Any, first_outputs: Sequence[Any], budget: Budget) -> timing.Timer:
    if timer not in (None, "auto", "cpu", "cuda"):
        if not hasattr(timer, "time_calls") or not hasattr(timer, "now"):
            raise TypeError(
                f"timer must be 'auto', 'cpu', 'cuda' or an object with time_calls() and now(), got {timer!r}"
            )
        return timer
    if timer == "cpu":
        return timing.CpuTimer()
    torch = sys.modules.get("torch")
    if timer == "cuda":
        return timing.CudaEventTimer(None, flush_l2=budget.flush_l2, hold_gpu=budget.hold_gpu)
    # "auto": outputs on a GPU mean GPU work; outputs of None mean in-place work, on the GPU when there is one.
    for output in first_outputs:
        device = owned_inputs.cuda_device(output)
        if device is not None:
            return timing.CudaEventTimer(device, flush_l2=budget.flush_l2, hold_gpu=budget.hold_gpu)
    if all(o is None for o in first_outputs) and torch is not None and torch.cuda.is_available():
        return timing.CudaEventTimer(None, flush_l2=budget.flush_l2, hold_gpu=budget.hold_gpu)
    return timing.CpuTimer()


def _measure(
    fns: Sequence[Callable[[], Any]],
    sides: Sequence[str],
    budget: Budget,
    timer: Any,
    on_look: Callable[[timing.RoundSamples], bool],
    ceiling: CeilingSource | None = None,
    make_inputs: Any = None,
) -> _Measurement:
    """Everything between "these callables" and "these samples": the shared engine of compare, tournament and
    measure. ``ceiling`` is asked for this device's ceiling inside the device lock, after sampling.

    With ``make_inputs`` the callables take the inputs: each timed call runs on the next of several input sets
    (:mod:`.inputs`), and the first call and the same-output check after timing run on the first set.

    Before sampling, a CUDA comparison checks that the events see the callables' work (:mod:`.escape`); during
    sampling the SM clock is read after each chunk of rounds and ``budget.throttle`` applies (:mod:`.clocks`)."""
    owned = None
    if make_inputs is not None:
        owned = owned_inputs.build_input_sets(make_inputs)
        pinned = [owned.pinned(fn) for fn in fns]
        fns = owned_inputs.bind_all(owned, fns, sides)
    for fn, side in zip(fns, sides):
        timing.require_zero_arguments(fn, side)
    pinned = pinned if owned is not None else list(fns)
    first_outputs = [outputs.snapshot(timing.call_once(fn, side, "its first call")) for fn, side in zip(pinned, sides)]
    for output, side in zip(first_outputs, sides):
        # Whatever check_output says: the time of a lazy output is the time of making it, never of its work.
        lazy = outputs.lazy_output(output)
        if lazy:
            raise outputs.LazyOutput(
                f"{side} returned {lazy} which does its work only when consumed or awaited, so timing it would time "
                "making it; return the results instead (list(...), a tensor, asyncio.run(...) inside the callable)"
            )
    if budget.check_output:
        for output, side in zip(first_outputs, sides):
            # Compared with itself, only NaN can differ; a type the check cannot compare is refused here, before
            # any time is spent, rather than reported as a change after timing.
            problem = _output_difference(output, output, side)
            if problem:
                raise ValueError(f"{side} {problem}")
    timer = _resolve_timer(timer, first_outputs, budget)
    is_cuda = isinstance(timer, timing.CudaEventTimer)
    notes: list[str] = [owned.note] if owned is not None else []
    if budget.flush_l2 and not is_cuda:
        notes.append("flush_l2 ignored: it applies to CUDA event timing only")
    if budget.hold_gpu and not is_cuda:
        notes.append("hold_gpu ignored: it applies to CUDA event timing only")
    if budget.flush_l2 and is_cuda and getattr(timer, "flush_note", None):
        notes.append(timer.flush_note)
    with device_lock(timer.lock_key) as locked:
        if not locked:
            notes.append("ran without a device lock (no fcntl on this platform)")
        warm = timing.warm_up(timer, fns, sides, budget.warmup)
        if is_cuda and timer.hold_gpu:
            timer.holds = timer.short_holds = 0  # the hold adapts during warm-up; count sampling rounds only
        if budget.calls_per_sample == "auto":
            single = timing.calibrated_single_call(warm)
            calls = timer_resolution.calls_for(timer, single, timing.choose_calls_per_sample(single),
                                               timing.MAX_CALLS_PER_SAMPLE)
        else:
            calls = int(budget.calls_per_sample)
        timed_fns, repeat, method = _timed_callables(timer, fns, calls, budget, notes)
        probe = escape.probe_for(timer) if budget.check_escape else None
        if probe is not None:  # before sampling: a comparison the events cannot see fails before it spends its budget
            escape.check_escaping_work(probe, timed_fns, sides, repeat)
        source, no_clock = clocks.clock_for(timer, is_cuda)
        monitor = clocks.ClockMonitor(source, reason=no_clock, policy=budget.throttle)
        start = timer.now()
        taken, samples, looks_done, stop_reason = _sample_with_looks(
            timer, timed_fns, sides, repeat, calls, warm, budget, on_look, monitor
        )
        elapsed = timer.now() - start
        throttle_note = monitor.note(taken)
        if throttle_note:
            notes.append(throttle_note)
        # Per sample as the timer read it: per-call times times the calls a sample held (one graph replay of them).
        unresolved = timer_resolution.unresolved(timer, [[t * calls for t in times] for times in samples.times])
        if not is_cuda:  # on a GPU the spread is the clock's and the throttling flag's business
            notes.extend(n for n in (stats.spread_note(times, side) for times, side in zip(samples.times, sides)) if n)
        if is_cuda and timer.hold_gpu and timer.short_holds:
            notes.append(f"the GPU hold ended before the host had queued the round in {timer.short_holds} of "
                         f"{timer.holds} sequences: those samples may include launch gaps")
        if budget.check_output:
            for fn, side, first in zip(pinned, sides, first_outputs):
                again = timing.call_once(fn, side, "the output check after timing")
                difference = _output_difference(first, again, side)
                if difference:
                    raise outputs.OutputChanged(
                        f"{side} output is not the same after timing as on its first call: {difference}. "
                        "Callables must return the same result on every call (pass check_output=False for "
                        "kernels that are nondeterministic by design, e.g. atomics)"
                    )
        found_ceiling = ceiling(timer) if ceiling is not None else None
    device = f"{timer.device} ({timer.device_name})" if is_cuda else timer.name
    return _Measurement(
        samples, method, calls, monitor.summary(), monitor.throttled, elapsed, stop_reason, looks_done, device, notes,
        found_ceiling, len(owned) if owned is not None else None, unresolved,
    )


def _output_difference(first: Any, again: Any, side: str) -> str | None:
    """``outputs.output_difference``, with the side and the way out in the message of an uncomparable output."""
    try:
        return outputs.output_difference(first, again)
    except outputs.OutputNotComparable as exc:
        raise outputs.OutputNotComparable(
            f"{side} {exc}; return such values, or pass check_output=False to skip the output check"
        ) from None


def _timed_callables(
    timer: Any, fns: Sequence[Callable[[], Any]], calls: int, budget: Budget, notes: list[str]
) -> tuple[list[Callable[[], Any]], int, str]:
    """What one sample runs: the callables ``calls`` times each, or one replay of a CUDA graph of them."""
    method = timer.name if calls == 1 else f"{timer.name}-batched x{calls}"
    want_graph = budget.use_cuda_graph is True or (budget.use_cuda_graph == "auto" and calls > 1)
    if not want_graph:
        return list(fns), calls, method
    if not isinstance(timer, timing.CudaEventTimer):
        notes.append("use_cuda_graph ignored: not a CUDA comparison")
        return list(fns), calls, method
    try:
        return [timing.capture_cuda_graph(fn, calls) for fn in fns], 1, f"cuda-graph x{calls}"
    except Exception as exc:  # capture is fragile (host syncs, allocations): batching still measures
        notes.append(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); timed batched calls instead")
        return list(fns), calls, method


def _sample_with_looks(
    timer: Any,
    timed_fns: Sequence[Callable[[], Any]],
    sides: Sequence[str],
    repeat: int,
    calls: int,
    warm: Sequence[Sequence[float]],
    budget: Budget,
    on_look: Callable[[timing.RoundSamples], bool],
    monitor: clocks.ClockMonitor,
) -> tuple[int, timing.RoundSamples, int, str]:
    """Sample rounds in chunks, looking at the data at each scheduled count, until decided or out of budget.

    Returns the rounds taken, the samples the last look used, the looks and why sampling stopped. The clock is
    read after each chunk. The schedule counts the rounds the verdict may use: with ``throttle="discard"`` those
    not taken while throttled, so each look judges as many pairs as planned; the time budget counts every round.
    """
    rng = random.Random(budget.seed)
    samples = timing.RoundSamples.empty(len(timed_fns))
    usable = samples
    start = timer.now()
    looks_done, last_look = 0, 0
    for look_at in stats.look_schedule(budget.min_pairs, budget.max_pairs):
        out_of_time = False
        while usable.n_rounds < look_at:
            spent = timer.now() - start
            if spent >= budget.max_time and samples.n_rounds >= budget.min_pairs:
                out_of_time = True
                break
            round_s = _round_seconds(samples, warm, calls)
            chunk = max(1, min(look_at - usable.n_rounds, int(CHUNK_SECONDS / round_s) if round_s > 0 else 64))
            if samples.n_rounds >= budget.min_pairs and round_s > 0:
                chunk = max(1, min(chunk, int((budget.max_time - spent) / round_s) + 1))
            timing.sample_rounds(timer, timed_fns, sides, chunk, repeat, rng, samples, calls_per_sample=calls)
            monitor.after_chunk(samples.n_rounds)  # with throttle="fail", raises here
            kept = monitor.kept_rounds(samples.n_rounds)
            usable = samples if kept is None else samples.select(kept)
        if samples.n_rounds > last_look and usable.n_rounds:  # a look only when there is new data
            monitor.at_look()
            looks_done, last_look = looks_done + 1, samples.n_rounds
            if on_look(usable):
                return samples.n_rounds, usable, looks_done, "decided"
        if out_of_time:
            break
    if not usable.n_rounds:  # discard dropped every round: there is nothing to decide on
        raise monitor.nothing_left(samples.n_rounds)
    return samples.n_rounds, usable, looks_done, "max_time" if out_of_time else "max_pairs"


def _round_seconds(samples: timing.RoundSamples, warm: Sequence[Sequence[float]], calls: int) -> float:
    """Expected seconds per round, from the latest samples (or the warm-up before there are any)."""
    source = samples.times if samples.n_rounds else warm
    return sum(sorted(times[-16:])[len(times[-16:]) // 2] for times in source) * calls


def _positive_times(times: Sequence[float], side: str) -> Any:
    import numpy as np

    values = np.asarray(times, dtype=float)
    if np.any(values <= 0):
        raise ValueError(
            f"the timer returned a zero duration for {side}: its calls are faster than the clock resolution; "
            "raise calls_per_sample"
        )
    return values


def _log_ratios(numerator: Sequence[float], denominator: Sequence[float], sides: tuple[str, str]) -> Any:
    import numpy as np

    return np.log(_positive_times(numerator, sides[0]) / _positive_times(denominator, sides[1]))


def run_comparison(
    candidate: Callable[[], Any],
    baseline: Callable[[], Any],
    budget: Budget | None = None,
    *,
    name: str = "comparison",
    timer: Any = None,
    flops: float | None = None,
    bytes: float | None = None,  # noqa: A002  (the keyword users write)
    dtype: str | None = None,
    ceilings: throughput.CeilingMeter | None = None,
    inputs: Any = None,
    check: Any = None,
) -> ComparisonResult:
    """Time two zero-argument callables in interleaved pairs and return the verdict for the candidate.

    ``inputs``: a zero-argument callable returning a tuple of arguments or a dict of keyword arguments; the
    callables then take them. The plugin builds and rotates several input sets (every timed call starts cold)
    and, after timing, checks the candidate's output against the baseline's on fresh inputs under ``check`` (a
    tolerance policy, a callable ``(candidate_out, baseline_out)`` that raises, or ``False``; default: the policy
    of the output's dtype), raising :class:`pytest_kernelcheck.speed.inputs.FreshOutputMismatch` on a mismatch.

    ``timer``: ``None``/``"auto"`` (CUDA events when outputs live on a GPU, else the CPU clock), ``"cpu"``,
    ``"cuda"``, or any object following :class:`pytest_kernelcheck.speed.timing.Timer`. ``flops`` and ``bytes`` (per
    call, the same for both sides: the problem's work) give both sides' TFLOP/s and GB/s, rated against the
    ``dtype`` ceiling of ``ceilings`` (a :class:`pytest_kernelcheck.speed.throughput.CeilingMeter`) when given.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).random(20_000)
    >>> r = run_comparison(lambda: np.sort(x), lambda: np.sort(np.concatenate([x, x])), Budget(max_time=0.3))
    >>> r.verdict
    'win'
    >>> rng = np.random.default_rng(1)
    >>> r = run_comparison(np.sort, lambda v: np.sort(np.concatenate([v, v]))[::2], Budget(max_time=0.3),
    ...                    inputs=lambda: (rng.random(20_000),))
    >>> r.verdict, r.input_sets
    ('win', 3)
    """
    import numpy as np

    budget = budget or Budget()
    budget.validate()
    check_owned_inputs(inputs, check)
    looks = budget.planned_looks
    alpha_look = budget.alpha / looks
    latest: dict[str, stats.PairedAnalysis] = {}

    def on_look(samples: timing.RoundSamples) -> bool:
        if not all(t > 0 for times in samples.times for t in times):
            # A sample read as 0 s: the calls took less than one tick. More samples cannot help; after sampling,
            # a coarse timer makes this inconclusive (timer_resolution) and an exact one an error.
            latest["below_a_tick"] = samples
            latest["analysis"] = stats.PairedAnalysis(samples.n_rounds, math.nan, (0.0, math.inf), 1.0,
                                                      1 - alpha_look, "inconclusive")
            return True
        d = _log_ratios(samples.times[1], samples.times[0], ("baseline", "candidate"))
        latest["analysis"] = stats.analyse_log_ratios(d, alpha=alpha_look, margin=budget.margin)
        return latest["analysis"].verdict != "inconclusive"

    work = throughput.Work.of(flops, bytes)
    measured = _measure([candidate, baseline], ["candidate", "baseline"], budget, timer, on_look,
                        _ceiling_source(work.given, dtype, ceilings), make_inputs=inputs)
    if inputs is not None:
        owned_inputs.check_fresh_outputs(candidate, baseline, inputs, check)
        measured.notes.append(_fresh_note(check, "the baseline's"))
    analysis = latest["analysis"]
    if "below_a_tick" in latest and not measured.unresolved:  # an exact clock read 0 s: the timer is wrong
        zero = latest["below_a_tick"]
        _log_ratios(zero.times[1], zero.times[0], ("baseline", "candidate"))  # raises, naming the side
    if measured.unresolved:  # samples within a few ticks: no verdict the timer could not have seen
        analysis = dataclasses.replace(analysis, verdict="inconclusive")
        measured.notes.append(measured.unresolved)
    candidate_ms = float(np.median(measured.samples.times[0])) * 1e3
    baseline_ms = float(np.median(measured.samples.times[1])) * 1e3

    return ComparisonResult(
        name=name,
        verdict=analysis.verdict,
        speedup=analysis.speedup,
        ci=analysis.ci,
        ci_level=analysis.level,
        p_value=min(1.0, analysis.p_value * looks),
        p_value_raw=analysis.p_value,
        n_pairs=analysis.n_pairs,
        candidate_ms=candidate_ms,
        baseline_ms=baseline_ms,
        method=measured.method,
        calls_per_sample=measured.calls_per_sample,
        flush_l2=budget.flush_l2 and measured.method.startswith(("events", "cuda-graph")),
        alpha=budget.alpha,
        margin=budget.margin,
        looks_planned=looks,
        looks_done=measured.looks_done,
        stop_reason=measured.stop_reason,
        elapsed_s=measured.elapsed_s,
        device=measured.device,
        clock=measured.clock,
        throttled=measured.throttled,
        candidate_samples_ms=[t * 1e3 for t in measured.samples.times[0]],
        baseline_samples_ms=[t * 1e3 for t in measured.samples.times[1]],
        candidate_first=[order[0] == 0 for order in measured.samples.orders],
        notes=measured.notes,
        candidate_throughput=throughput.achieved(work, candidate_ms / 1e3, measured.ceiling),
        baseline_throughput=throughput.achieved(work, baseline_ms / 1e3, measured.ceiling),
        ceiling=measured.ceiling,
        input_sets=measured.input_sets,
    )


def check_owned_inputs(inputs: Any, check: Any) -> None:
    """Refuse bad ``inputs=`` / ``check=`` before anything runs, naming the argument."""
    if inputs is None:
        if check is not None:
            raise TypeError("check= applies to inputs the plugin owns: pass inputs=make_inputs with it")
        return
    if not callable(inputs):
        raise TypeError(
            "inputs must be a zero-argument callable returning a tuple of arguments or a dict of keyword "
            f"arguments, got {type(inputs).__name__}: {inputs!r}"
        )
    owned_inputs.validate_check(check)


def _fresh_note(check: Any, against: str) -> str:
    if check is False:
        return "inputs owned by the plugin; the check on fresh inputs is off (check=False)"
    how = "a callable" if callable(check) and not isinstance(check, bool) else (
        "the policy of the output's dtype" if check in (None, True) else f"policy {check}")
    return f"inputs owned by the plugin; outputs on fresh inputs matched {against} ({how})"


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
        raise ValueError(f"a tournament needs a mapping of at least two named callables, got {variants!r}")
    names = [str(n) for n in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"tournament variant names must be distinct as text, got {names}")
    fns = list(variants.values())
    if len({id(f) for f in fns}) != len(fns):
        raise ValueError("each tournament variant must be its own callable object (wrap repeats in a lambda)")
    return names, fns


def run_tournament(
    variants: Mapping[str, Callable[[], Any]],
    budget: Budget | None = None,
    *,
    name: str = "tournament",
    timer: Any = None,
    flops: Any = None,
    bytes: Any = None,  # noqa: A002  (the keyword users write)
    dtype: str | None = None,
    ceilings: throughput.CeilingMeter | None = None,
    inputs: Any = None,
    check: Any = None,
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

    budget = budget or Budget()
    budget.validate()
    check_owned_inputs(inputs, check)
    names, fns = tournament_variants(variants)
    flops_of = throughput.per_variant(flops, names, "flops")
    bytes_of = throughput.per_variant(bytes, names, "bytes")
    work = {n: throughput.Work.of(flops_of[n], bytes_of[n], what=f"variant {n!r}: ") for n in names}
    looks = budget.planned_looks
    alpha_look = budget.alpha / looks
    latest: dict[str, Any] = {}

    def on_look(samples: timing.RoundSamples) -> bool:
        for name, times in zip(names, samples.times):
            _positive_times(times, f"variant {name!r}")
        ranking, pairwise = _tournament_look(names, samples.times, alpha_look, budget.margin)
        latest["ranking"], latest["pairwise"] = ranking, pairwise
        return all(p.verdict != "inconclusive" for p in pairwise if p.faster == ranking[0])

    measured = _measure(fns, [f"variant {n!r}" for n in names], budget, timer, on_look,
                        _ceiling_source(any(w.given for w in work.values()), dtype, ceilings), make_inputs=inputs)
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
    budget: Budget | None = None,
    *,
    name: str = "measurement",
    timer: Any = None,
    flops: float | None = None,
    bytes: float | None = None,  # noqa: A002  (the keyword users write)
    dtype: str | None = None,
    ceilings: throughput.CeilingMeter | None = None,
    inputs: Any = None,
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

    budget = budget or Budget()
    budget.validate()
    check_owned_inputs(inputs, None)
    work = throughput.Work.of(flops, bytes)
    looks = budget.planned_looks
    alpha_look = budget.alpha / looks

    def on_look(samples: timing.RoundSamples) -> bool:
        low, high = stats.median_interval(_positive_times(samples.times[0], "the measured function"), alpha_look)
        return math.isfinite(low) and math.isfinite(high) and high <= low * (1 + budget.margin)

    measured = _measure([fn], ["the measured function"], budget, timer, on_look,
                        _ceiling_source(work.given, dtype, ceilings), make_inputs=inputs)
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


class KernelAB:
    """The ``kernel_ab`` fixture: statistically tested speed comparisons inside a test.

    >>> def test_fused_is_faster(kernel_ab):  # doctest: +SKIP
    ...     x = torch.randn(4096, 4096, device="cuda")
    ...     kernel_ab.assert_faster(lambda: fused(x), lambda: unfused(x), name="fused vs unfused")
    """

    def __init__(
        self,
        defaults: Budget | None = None,
        *,
        nodeid: str = "",
        test_name: str = "comparison",
        shape: Callable[[], Any] = lambda: None,
        record: Callable[[dict[str, Any]], None] = lambda record: None,
        ceilings: throughput.CeilingMeter | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        self.defaults = defaults or Budget()
        self._cpu_threads = cpu_threads  # --kernel-ab-cpu-threads: torch's threads while a comparison runs
        self._nodeid = nodeid
        self._test_name = test_name
        self._shape = shape  # the test's shape as the test sees it: callables of flops= and bytes= get it
        self._record = record
        self._ceilings = ceilings
        self._unnamed = 0
        self._used_names: set[str] = set()
        self.results: list[ComparisonResult | TournamentResult | MeasureResult] = []

    def _name(self, name: str | None) -> str:
        """The given name, or the test's name (``test_x``, ``test_x #2``, ...) stepping over names already used."""
        if name is not None:
            label = str(name)
            # An empty or blank name made an unlabelled report row, matched to the earlier report by nothing
            # visible; a line break split the row of the markdown report and the summary line. splitlines knows
            # every line break (\v, \f, \x1c-\x1e, \x85, \u2028, \u2029 too), as every reader of the text does.
            if not label.strip() or label.splitlines() != [label]:
                raise ValueError(f"name must be a non-empty, one-line label for the comparison, got {name!r}")
            return label
        while True:
            self._unnamed += 1
            label = self._test_name if self._unnamed == 1 else f"{self._test_name} #{self._unnamed}"
            if label not in self._used_names:
                return label

    def _claim(self, label: str) -> None:
        """Refuse a name already used in this test: reports and ``--kernel-ab-compare`` key results by test and name.

        Two results under one name would be matched to one row of the earlier report, so a regression in either
        could hide behind the other. Comparisons and tournaments share the names; a failed one keeps its name, as
        its error row in the report carries it.
        """
        if label in self._used_names:
            raise ValueError(
                f"kernel_ab name {label!r} is already used in {self._nodeid or self._test_name}; give each "
                "comparison and tournament of a test its own name= (reports and --kernel-ab-compare tell results "
                "apart by test and name)"
            )
        self._used_names.add(label)

    def _run(
        self,
        record_type: type[ABRecord],
        name: str | None,
        work: Callable[[Budget, str, Any], Any],
        budget: dict[str, Any],
    ) -> Any:
        settings = self.defaults.replace(**budget)  # bad keywords fail before anything runs
        label = self._name(name)
        self._claim(label)  # before anything runs, too: a refused call records nothing
        shape_value = self._shape()
        shape = shape_record(shape_value)
        started = time.perf_counter()
        try:
            with timing.torch_threads(self._cpu_threads):
                result = work(settings, label, shape_value)
        except Exception as exc:
            # Recorded so the report keeps every other comparison and shows this one failed, then re-raised.
            failure = record_type.of_error(
                label, exc, nodeid=self._nodeid, shape=shape, elapsed_s=time.perf_counter() - started
            )
            self._record(failure.to_json())
            raise
        result.nodeid, result.shape = self._nodeid, shape
        self.results.append(result)
        self._record(result.to_record().to_json())
        return result

    def compare(
        self,
        candidate: Callable[[], Any],
        baseline: Callable[[], Any],
        *,
        name: str | None = None,
        timer: Any = None,
        flops: Any = None,
        bytes: Any = None,  # noqa: A002  (the keyword users write)
        dtype: Any = None,
        inputs: Any = None,
        check: Any = None,
        **budget: Any,
    ) -> ComparisonResult:
        """Time ``candidate`` against ``baseline`` (zero-argument callables); never fails on the verdict.

        ``inputs=make_inputs`` (a zero-argument callable returning a tuple of arguments or a dict of keyword
        arguments): the callables take the inputs, the plugin rotates several sets of them so every timed call
        starts cold, and after timing the candidate's output on fresh inputs must match the baseline's under
        ``check`` (a policy name or dtype for ``assert_close``, a callable ``(candidate_out, baseline_out)`` that
        raises, or ``False``; default: the policy of the output's dtype) or the comparison fails.

        ``name`` labels the result in the report (default: the test's name); each comparison, tournament and
        measurement of one test needs its own, and a name used twice raises ``ValueError``. ``flops`` and
        ``bytes``: the work of one call (numbers, or callables of the test's ``shape``), the same for both
        sides; they add TFLOP/s, GB/s and the share of this device's ceiling for ``dtype`` (default: the shape's
        dtype) to the result and the report. Budget keywords: max_time, min_pairs, max_pairs, alpha, margin,
        flush_l2, hold_gpu, calls_per_sample, use_cuda_graph, warmup, check_output, seed, throttle, check_escape.

        >>> result = kernel_ab.compare(lambda: new(x), lambda: old(x), max_time=1.0,  # doctest: +SKIP
        ...                            flops=lambda s: 2 * s.M * s.N * s.K, bytes=lambda s: 2 * s.M * s.N * 3)
        >>> result.verdict, result.speedup, result.candidate_throughput.tflops  # doctest: +SKIP
        ('win', 1.18, 412.5)
        >>> make = lambda: (torch.randn(4096, 4096, device="cuda"),)  # doctest: +SKIP
        >>> kernel_ab.compare(new, old, inputs=make, check="fp32").input_sets  # doctest: +SKIP
        4
        """
        check_owned_inputs(inputs, check)  # before the name is claimed: a refused call records nothing

        def work(settings: Budget, label: str, shape: Any) -> ComparisonResult:
            counts = throughput.Work.of(flops, bytes, shape)
            return run_comparison(candidate, baseline, settings, name=label, timer=timer, flops=counts.flops,
                                  bytes=counts.bytes, dtype=throughput.dtype_name(dtype, shape),
                                  ceilings=self._ceilings, inputs=inputs, check=check)

        return self._run(ComparisonRecord, name, work, budget)

    def assert_faster(
        self, candidate: Callable[[], Any], baseline: Callable[[], Any], *, name: str | None = None, **budget: Any
    ) -> ComparisonResult:
        """Compare, and fail unless the candidate is significantly faster (verdict "win").

        >>> kernel_ab.assert_faster(lambda: new(x), lambda: old(x))  # doctest: +SKIP
        """
        __tracebackhide__ = True
        result = self.compare(candidate, baseline, name=name, **budget)  # flops=, bytes=, dtype= pass through
        if result.verdict != "win":
            raise KernelABAssertionError(f"{result.name}: candidate is not faster than baseline; {result.describe()}")
        return result

    def assert_not_slower(
        self, candidate: Callable[[], Any], baseline: Callable[[], Any], *, name: str | None = None, **budget: Any
    ) -> ComparisonResult:
        """Compare, and fail only when the candidate is significantly slower (verdict "loss").

        >>> kernel_ab.assert_not_slower(lambda: dispatch(x), lambda: sdpa(x))  # doctest: +SKIP
        """
        __tracebackhide__ = True
        result = self.compare(candidate, baseline, name=name, **budget)
        if result.verdict == "loss":
            raise KernelABAssertionError(f"{result.name}: candidate is slower than baseline; {result.describe()}")
        return result

    def tournament(
        self,
        variants: Mapping[str, Callable[[], Any]],
        *,
        name: str | None = None,
        timer: Any = None,
        flops: Any = None,
        bytes: Any = None,  # noqa: A002  (the keyword users write)
        dtype: Any = None,
        inputs: Any = None,
        check: Any = None,
        **budget: Any,
    ) -> TournamentResult:
        """Rank named variants on one input; says which cannot be told apart from the best.

        ``name`` follows the rule of :meth:`compare`: unique among the test's comparisons and tournaments.
        ``flops`` and ``bytes``: as for :meth:`compare`, one value for every variant or a mapping of variant
        names to their own (a number or a callable of the shape each). ``inputs`` and ``check``: as for
        :meth:`compare`; each variant's output on fresh inputs is checked against the first variant's.

        >>> t = kernel_ab.tournament({"a": lambda: a(x), "b": lambda: b(x), "c": lambda: c(x)},  # doctest: +SKIP
        ...                          flops=2 * n**3, bytes={"a": 6 * n**2, "b": 6 * n**2, "c": 8 * n**2})
        >>> t.best, t.indistinguishable_from_best, t.throughput["b"].tflops  # doctest: +SKIP
        ('b', ['b', 'c'], 310.2)
        """
        check_owned_inputs(inputs, check)

        def work(settings: Budget, label: str, shape: Any) -> TournamentResult:
            names = [str(n) for n in variants] if isinstance(variants, Mapping) else []
            counts = {n: throughput.Work.of(f, b, shape, what=f"variant {n!r}: ") for n, f, b in zip(
                names, throughput.per_variant(flops, names, "flops").values(),
                throughput.per_variant(bytes, names, "bytes").values())}
            return run_tournament(variants, settings, name=label, timer=timer,
                                  flops={n: c.flops for n, c in counts.items()},
                                  bytes={n: c.bytes for n, c in counts.items()},
                                  dtype=throughput.dtype_name(dtype, shape), ceilings=self._ceilings,
                                  inputs=inputs, check=check)

        return self._run(TournamentRecord, name, work, budget)

    def measure(
        self,
        fn: Callable[[], Any],
        *,
        flops: Any = None,
        bytes: Any = None,  # noqa: A002  (the keyword users write)
        dtype: Any = None,
        name: str | None = None,
        timer: Any = None,
        inputs: Any = None,
        **budget: Any,
    ) -> MeasureResult:
        """Time one zero-argument callable alone: median per call with an exact interval, samples and throughput.

        Same timers and budget keywords as :meth:`compare`; ``flops``, ``bytes`` and ``dtype`` as there. The
        result is a row of the report's measurements table. Sampling stops once the interval's ends are within
        ``margin`` of each other (or the budget is spent). ``inputs``: as for :meth:`compare`, the sets rotate
        between calls (nothing to check the output against).

        >>> m = kernel_ab.measure(lambda: torch.mm(a, b), flops=2 * n**3, bytes=3 * n * n * 2)  # doctest: +SKIP
        >>> m.median_ms, m.ci_ms, m.throughput.tflops, m.throughput.tflops_pct  # doctest: +SKIP
        (1.52, (1.51, 1.53), 723.4, 91.0)
        """
        check_owned_inputs(inputs, None)

        def work(settings: Budget, label: str, shape: Any) -> MeasureResult:
            counts = throughput.Work.of(flops, bytes, shape)
            return run_measurement(fn, settings, name=label, timer=timer, flops=counts.flops, bytes=counts.bytes,
                                   dtype=throughput.dtype_name(dtype, shape), ceilings=self._ceilings,
                                   inputs=inputs)

        return self._run(MeasurementRecord, name, work, budget)


def shape_record(value: Any) -> dict[str, Any] | None:
    """The test's ``shape`` (a :class:`pytest_kernelcheck.Shape`, a dict or anything else) as a report's dict.

    >>> shape_record({"B": 1}), shape_record(None), shape_record(7)
    ({'B': 1}, None, {'shape': '7'})
    """
    if value is None:
        return None
    if hasattr(value, "as_dict"):
        return dict(value.as_dict())
    if isinstance(value, dict):
        return dict(value)
    return {"shape": str(value)}


def _percent(level: float) -> str:
    return f"{level * 100:.1f}%"
