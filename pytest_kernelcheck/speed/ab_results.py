"""What an A/B run found: the results of a comparison, a tournament and a measurement, their one-line
descriptions and their typed records."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..results.records import (
    CeilingRecord,
    ClockRecord,
    ComparisonRecord,
    MeasurementRecord,
    ModeRecord,
    PairwiseRecord,
    RunDetails,
    ThroughputRecord,
    TournamentRecord,
    finite_interval,
)
from ..results.measured import modes_disagree
from ..results import reading
from . import stats
from .stats import Verdict


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
    mode: str = "throughput"  # the mode the fields above are of (the first requested that could run)
    modes: dict[str, ModeRecord] = field(default_factory=dict)  # every requested mode, in order
    tokens_per_s: tuple[float, float] | None = None  # compare_generation: (candidate, baseline)

    @property
    def modes_disagree(self) -> bool:
        """Two modes reached different decided verdicts (win, loss, tie): which is right depends on the use."""
        return modes_disagree({m.mode: m.verdict for m in self.modes.values() if m.available})

    def in_mode(self, mode: str) -> ModeRecord:
        """The result of one mode; ``KeyError`` naming the modes measured when it was not."""
        if mode not in self.modes:
            raise KeyError(f"mode {mode!r} was not measured; measured: {', '.join(self.modes) or self.mode} "
                           f"(ask for it with modes=)")
        return self.modes[mode]

    def describe(self) -> str:
        """One line with every number behind the verdict, the p-value labelled, the row's notes (why the medians
        disagree with the paired speedup, noise advice) as the report shows them (:mod:`..results.reading`), and,
        with several modes, each mode's.

        >>> r = ComparisonResult("x", "win", 1.1, (1.05, 1.15), 0.995, 1e-4, 1e-5, 80, 1.0, 1.1, "cpu-clock", 1,
        ...     False, 0.05, 0.02, 11, 3, "decided", 0.2, "cpu", {}, False, [], [], [])
        >>> r.describe()
        'verdict win: paired speedup 1.100x, 99.5% CI [1.050, 1.150], p=0.0001 (adjusted for 11 looks; raw 1e-05), n=80 pairs, median candidate 1 ms, baseline 1.1 ms (cpu-clock)'
        """
        record = self.to_record()
        return (
            f"verdict {self.verdict}: paired speedup {stats.decimals(self.speedup)}x, {percent(self.ci_level)} CI "
            f"[{stats.decimals(self.ci[0])}, {stats.decimals(self.ci[1])}], {reading.p_text(record)}, "
            f"n={self.n_pairs} pairs, "
            f"median candidate {self.candidate_ms:.4g} ms, baseline {self.baseline_ms:.4g} ms ({self.method})"
            + _rates_text(self.candidate_throughput, "candidate") + _modes_text(self)
            + "".join(f"; note: {note}" for note in reading.row_notes(record))
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
            run=run_details(self), candidate_samples_ms=tuple(self.candidate_samples_ms),
            baseline_samples_ms=tuple(self.baseline_samples_ms), candidate_first=tuple(self.candidate_first),
            candidate_throughput=self.candidate_throughput, baseline_throughput=self.baseline_throughput,
            ceiling=self.ceiling, **_mode_fields(self),
        )


def _mode_fields(result: ComparisonResult) -> dict[str, Any]:
    """The record's mode columns: none for throughput alone (the layout of every earlier report)."""
    if list(result.modes) in ([], ["throughput"]):
        return {}
    return {"mode": result.mode, "modes": tuple(result.modes.values())}


def _modes_text(result: ComparisonResult) -> str:
    """``; modes: throughput win 1.02x [1.01, 1.03]; latency loss 0.89x ... MODES DISAGREE`` (several modes)."""
    if list(result.modes) in ([], ["throughput"]):
        return ""
    parts = []
    for m in result.modes.values():
        if not m.available:
            parts.append(f"{m.mode} not available ({m.unavailable})")
            continue
        text = (f"{m.mode} {m.verdict} {stats.decimals(m.speedup) if m.speedup else 'n/a'}x "
                f"[{_end(m.ci[0])}, {_end(m.ci[1])}], candidate {m.candidate_ms:.4g} ms, "
                f"baseline {m.baseline_ms:.4g} ms")
        if m.candidate_host_ms is not None and m.baseline_host_ms is not None:
            text += f", host overhead {m.candidate_host_ms * 1e3:.3g} / {m.baseline_host_ms * 1e3:.3g} us a call"
        parts.append(text)
    flag = " -- MODES DISAGREE: the verdict depends on how the code is called" if result.modes_disagree else ""
    return f"; verdict of {result.mode}; modes: " + "; ".join(parts) + flag


def _end(value: float | None) -> str:
    return stats.decimals(value) if value is not None else "inf"


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
        >>> from pytest_kernelcheck.speed import timing
        >>> from pytest_kernelcheck.speed.runs import Budget, run_tournament
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
            pairwise=pairwise, n_rounds=self.n_rounds, run=run_details(self),
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
        return (f"{self.name}: median {self.median_ms:.4g} ms, {percent(self.ci_level)} CI "
                f"[{self.ci_ms[0]:.4g}, {self.ci_ms[1]:.4g}] ms, n={self.n_samples} samples ({self.method})"
                + _rates_text(self.throughput, ""))

    def to_record(self) -> MeasurementRecord:
        """The report's row for this measurement.

        >>> fn = lambda: None
        >>> from pytest_kernelcheck.speed import timing
        >>> from pytest_kernelcheck.speed.runs import Budget, run_measurement
        >>> timer = timing.SimulatedTimer({fn: lambda rng, now: 1e-3})
        >>> run_measurement(fn, Budget(max_time=0.05), timer=timer, flops=1e9).to_record().throughput.tflops
        1.0
        """
        return MeasurementRecord(
            self.name, nodeid=self.nodeid, shape=self.shape, median_ms=self.median_ms,
            ci_ms=finite_interval(self.ci_ms), n_samples=self.n_samples, run=run_details(self),
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


def run_details(result: ComparisonResult | TournamentResult | MeasureResult) -> RunDetails:
    """The columns a comparison's and a tournament's records share."""
    return RunDetails(
        method=result.method, calls_per_sample=result.calls_per_sample, alpha=result.alpha, margin=result.margin,
        ci_level=result.ci_level, looks_planned=result.looks_planned, looks_done=result.looks_done,
        stop_reason=result.stop_reason, elapsed_s=result.elapsed_s, device=result.device,
        clock=ClockRecord.from_json(result.clock),
        throttled=result.throttled, notes=tuple(result.notes), input_sets=result.input_sets,
    )


def percent(level: float) -> str:
    return f"{level * 100:.1f}%"
