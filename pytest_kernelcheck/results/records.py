"""Typed A/B records and their JSON form: the one place that writes and reads the dicts of an A/B report.

A comparison or tournament leaves one record, made where it ran (from its result, or from the error it raised):
:class:`ComparisonRecord` or :class:`TournamentRecord`. Records travel as JSON (pytest-xdist carries them to the
controller as text on the test report) and the report is a JSON file, so each record type has ``to_json()``
and ``from_json()``; ``from_json`` gives every missing key its default, so reports written by earlier versions
still load, and refuses with :class:`DamagedReport` a field no run writes (an unknown or missing verdict, a speedup
that is not a finite number above 0, an interval that is not two ordered ends), since such a row would be shown but
never judged, or crash the run that reads it. The report fills in Benjamini-Hochberg columns and the match with
an earlier run (:class:`LastRun`); :class:`ABReport` is the whole document, :class:`ReportSummary` its totals,
:class:`RunEnvironment` where the numbers came from; :class:`ClockRecord` is the SM clock of one run (in
:class:`RunDetails`).

>>> row = ComparisonRecord.from_json({"kind": "comparison", "name": "fused", "verdict": "win", "speedup": 1.2})
>>> row.speedup, row.ci, row.failed
(1.2, (None, None), False)
>>> record_from_json(row.to_json()) == row
True
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, TypeVar, get_args

from .fields import (  # re-exported: the errors and intervals every reader of a record meets
    UNBOUNDED,
    DamagedReport,
    Interval,
    checked_number,
    interval_from_json,
)
from .fields import NotAReport as NotAReport  # re-exported for readers
from .fields import finite_interval as finite_interval
from .measured import (  # re-exported: the records a report row carries
    CeilingRecord,
    ClockRecord,
    GpuIdentity,
    ModeRecord,
    ThroughputRecord,
    _ceiling_from_json,
    _throughput_from_json,
    modes_disagree,
)

SCHEMA = "pytest-kernelcheck/ab-report"
SCHEMA_VERSION = 1

# The candidate's verdict, from stats.decide.
Verdict = Literal["win", "loss", "tie", "inconclusive"]
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
# A record's verdict: the candidate's (see stats.decide), or "error" when the comparison raised.
Outcome = Literal["win", "loss", "tie", "inconclusive", "error"]


# What a comparison's verdict may be: stats.decide's verdicts, and "error" for a comparison that raised.
OUTCOMES: tuple[str, ...] = ("win", "loss", "tie", "inconclusive", "error")


def _failure_json(
    kind: str, name: str, nodeid: str, shape: Any, error: str | None, elapsed_s: float | None,
    gpu: "GpuIdentity | None" = None,
) -> dict[str, Any]:
    """The row of a comparison or tournament that raised: the comparison columns, empty, and the error (and the
    GPU of the worker it raised on, under ``--kernel-gpus``)."""
    data = {
        "kind": kind, "name": name, "nodeid": nodeid, "shape": copy.deepcopy(shape), "verdict": "error",
        "error": error, "speedup": None, "ci": [None, None], "p_value": None, "candidate_ms": None,
        "baseline_ms": None, "n_pairs": 0, "method": None, "elapsed_s": elapsed_s,
    }
    if gpu is not None:
        data["gpu"] = gpu.to_json()
    return data


def describe_error(error: BaseException) -> str:
    """How a record names what a comparison raised.

    >>> describe_error(ValueError("bad shape"))
    'ValueError: bad shape'
    """
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class RunDetails:
    """How a comparison or tournament was measured and decided: the columns both kinds of record share.

    >>> RunDetails.from_json({"method": "events", "looks_done": 2}).method
    'events'
    """

    method: str | None = None  # the timer, and batching or CUDA graph ("events-batched x20")
    calls_per_sample: int | None = None
    alpha: float | None = None
    margin: float | None = None
    ci_level: float | None = None
    looks_planned: int | None = None
    looks_done: int | None = None
    stop_reason: str | None = None  # "decided", "max_time" or "max_pairs"
    elapsed_s: float | None = None
    device: str | None = None
    clock: ClockRecord = ClockRecord()  # clocks.ClockMonitor.record()
    throttled: bool = False
    notes: tuple[str, ...] = ()
    input_sets: int | None = None  # inputs= given: the sets the plugin built and rotated (None: the test's own)
    gpu: GpuIdentity | None = None  # the worker's GPU under --kernel-gpus; None: not pinned (every earlier report)

    @property
    def inputs_owned(self) -> bool:
        return self.input_sets is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method, "calls_per_sample": self.calls_per_sample, "alpha": self.alpha,
            "margin": self.margin, "ci_level": self.ci_level, "looks_planned": self.looks_planned,
            "looks_done": self.looks_done, "stop_reason": self.stop_reason, "elapsed_s": self.elapsed_s,
            "device": self.device, "clock": self.clock.to_json(), "throttled": self.throttled,
            "notes": list(self.notes),
            # Only rows whose inputs the plugin owned carry the key: other rows keep the layout of every report.
            **({"input_sets": self.input_sets} if self.input_sets is not None else {}),
            # Likewise only rows of a worker pinned to a GPU name it.
            **({"gpu": self.gpu.to_json()} if self.gpu is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RunDetails":
        return cls(
            method=data.get("method"), calls_per_sample=data.get("calls_per_sample"), alpha=data.get("alpha"),
            margin=data.get("margin"), ci_level=data.get("ci_level"), looks_planned=data.get("looks_planned"),
            looks_done=data.get("looks_done"), stop_reason=data.get("stop_reason"),
            elapsed_s=data.get("elapsed_s"), device=data.get("device"), clock=ClockRecord.from_json(data.get("clock")),
            throttled=bool(data.get("throttled", False)), notes=tuple(data.get("notes") or ()),
            input_sets=data.get("input_sets"), gpu=GpuIdentity.from_json(data.get("gpu")),
        )


# How far a baseline's time per call may move between two runs before the report says so: a baseline (the code a
# candidate is compared with, usually unchanged) repeats within a few percent from run to run on a quiet GPU; host-
# bound calls moved by 20-90% between processes on a shared host (flashlite's compiled-layer runs on an H200,
# benchmarks/results/h200-2026-12-04-c/ at commit 8ca4529), and there a speedup's change says little about the
# candidate's code.
BASELINE_MOVE = 0.15


@dataclass(frozen=True)
class LastRun:
    """A comparison's row in an earlier report (``--kernel-ab-compare``) and whether this run regressed from it.

    A regression: the speedup interval now sits entirely below the earlier one, or the verdict went from win
    to loss; ``reason`` says which. ``timing_change`` says when the two rows were timed differently (another
    timer or number of calls per sample: a sample's fixed cost weighs more with fewer calls, which pulls short
    calls' speedups toward 1), so that a change may be the method's rather than the code's. ``baseline_change``
    says when the baseline's own time per call moved by more than ``BASELINE_MOVE`` between the runs: the machine
    (its load, clocks or host) or the baseline itself changed, so the candidate's code may not be what moved.

    >>> LastRun.from_json({"speedup": 1.5, "ci": [1.4, 1.6], "verdict": "win", "regression": False}).ci
    (1.4, 1.6)
    """

    speedup: float | None
    ci: Interval
    verdict: Outcome | None
    ratio: float | None  # speedup now / speedup then
    regression: bool
    reason: str | None
    timing_change: str | None = None  # "timed by events-batched x7 then, by events now"
    baseline_change: str | None = None  # "baseline 0.329 ms a call then, 0.613 ms now (1.86x)"

    def to_json(self) -> dict[str, Any]:
        return {"speedup": self.speedup, "ci": list(self.ci), "verdict": self.verdict, "ratio": self.ratio,
                "regression": self.regression, "reason": self.reason, "timing_change": self.timing_change,
                "baseline_change": self.baseline_change}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "LastRun":
        return cls(speedup=data.get("speedup"), ci=interval_from_json(data.get("ci")), verdict=data.get("verdict"),
                   ratio=data.get("ratio"), regression=bool(data.get("regression", False)), reason=data.get("reason"),
                   timing_change=data.get("timing_change"), baseline_change=data.get("baseline_change"))


@dataclass(frozen=True)
class ComparisonRecord:
    """One comparison's row: speedup is baseline time / candidate time and the verdict is the candidate's;
    verdict "error" means it raised, and ``error`` says what. The report fills in ``p_bh`` and ``verdict_bh``
    (Benjamini-Hochberg across the run) and ``vs_last`` (the earlier run's row).

    >>> ComparisonRecord.of_error("fused", RuntimeError("no kernel image")).to_json()["error"]
    'RuntimeError: no kernel image'
    """

    name: str
    verdict: Outcome
    nodeid: str = ""
    shape: Mapping[str, Any] | None = None
    error: str | None = None
    speedup: float | None = None
    ci: Interval = UNBOUNDED
    p_value: float | None = None  # corrected for the looks, comparable with alpha
    p_value_raw: float | None = None
    n_pairs: int = 0
    candidate_ms: float | None = None  # median per call
    baseline_ms: float | None = None
    flush_l2: bool = False
    run: RunDetails = RunDetails()
    candidate_samples_ms: tuple[float, ...] = ()
    baseline_samples_ms: tuple[float, ...] = ()
    candidate_first: tuple[bool, ...] = ()  # per pair: whether the candidate ran first
    p_bh: float | None = None
    verdict_bh: Verdict | None = None
    vs_last: LastRun | None = None
    candidate_throughput: ThroughputRecord | None = None  # given flops= or bytes=
    baseline_throughput: ThroughputRecord | None = None
    ceiling: CeilingRecord | None = None  # this device's, for the percentages
    mode: str | None = None  # the mode the verdict above is of; None: throughput alone (every earlier report)
    modes: tuple[ModeRecord, ...] = ()  # every mode measured, the verdict's first; empty: throughput alone

    @property
    def failed(self) -> bool:
        return self.verdict == "error"

    @property
    def modes_disagree(self) -> bool:
        """Two measured modes reached different decided verdicts (see :func:`.measured.modes_disagree`)."""
        return modes_disagree({m.mode: m.verdict for m in self.modes if m.available})

    @classmethod
    def of_error(cls, name: str, error: BaseException, *, nodeid: str = "", shape: Mapping[str, Any] | None = None,
                 elapsed_s: float | None = None) -> "ComparisonRecord":
        """The row of a comparison that raised ``error``."""
        return cls(name=name, verdict="error", nodeid=nodeid, shape=shape, error=describe_error(error),
                   run=RunDetails(elapsed_s=elapsed_s))

    def to_json(self, *, with_last_run: bool = False) -> dict[str, Any]:
        """The JSON row; ``with_last_run`` adds ``vs_last`` (null for a row new in this run), as a report
        compared with an earlier one has on every row."""
        if self.failed:
            data = _failure_json("comparison", self.name, self.nodeid, self.shape, self.error, self.run.elapsed_s,
                                 self.run.gpu)
        else:
            data = {
                "kind": "comparison", "error": self.error, "name": self.name, "verdict": self.verdict,
                "speedup": self.speedup, "ci": list(self.ci), "p_value": self.p_value,
                "p_value_raw": self.p_value_raw, "n_pairs": self.n_pairs, "candidate_ms": self.candidate_ms,
                "baseline_ms": self.baseline_ms, "flush_l2": self.flush_l2, **self.run.to_json(),
                "nodeid": self.nodeid, "shape": copy.deepcopy(self.shape),
                "samples": {
                    "candidate_ms": list(self.candidate_samples_ms),
                    "baseline_ms": list(self.baseline_samples_ms),
                    "candidate_first": list(self.candidate_first),
                },
            }
            if self.candidate_throughput is not None:  # rows without flops= or bytes= keep the first layout
                data["throughput"] = {
                    "candidate": self.candidate_throughput.to_json(),
                    "baseline": self.baseline_throughput.to_json() if self.baseline_throughput else None,
                }
            if self.ceiling is not None:
                data["ceiling"] = self.ceiling.to_json()
            if self.modes:  # rows of throughput alone keep the first layout
                data.update(mode=self.mode, modes=[m.to_json() for m in self.modes],
                            modes_disagree=self.modes_disagree)
        if self.p_bh is not None:
            data["p_bh"] = self.p_bh
        if self.verdict_bh is not None:
            data["verdict_bh"] = self.verdict_bh
        if with_last_run:
            data["vs_last"] = self.vs_last.to_json() if self.vs_last is not None else None
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ComparisonRecord":
        """The row of a JSON row; ``DamagedReport`` naming the field when it holds what no run writes.

        The verdict is required: every version of the report wrote one, and a row without one (or with one
        outside :data:`OUTCOMES`, such as "WIN") would be shown but never judged by the gate.

        >>> ComparisonRecord.from_json({"kind": "comparison", "name": "a", "verdict": "WIN"})
        Traceback (most recent call last):
        ...
        pytest_kernelcheck.results.fields.DamagedReport: field 'verdict': 'WIN' is refused; accepted: 'win', 'loss', \
'tie', 'inconclusive', 'error'
        """
        if data.get("verdict") not in OUTCOMES:
            found = f": {data['verdict']!r} is refused" if "verdict" in data else " is missing"
            raise DamagedReport(f"field 'verdict'{found}; accepted: {', '.join(map(repr, OUTCOMES))}")
        samples = data.get("samples") or {}
        vs_last = data.get("vs_last")
        throughput = data.get("throughput") or {}
        return cls(
            name=data.get("name", ""), verdict=data["verdict"], nodeid=data.get("nodeid") or "",
            shape=data.get("shape"), error=data.get("error"), speedup=checked_number(data, "speedup", positive=True),
            ci=interval_from_json(data.get("ci")), p_value=checked_number(data, "p_value", at_most=1),
            p_value_raw=data.get("p_value_raw"), n_pairs=data.get("n_pairs", 0),
            candidate_ms=checked_number(data, "candidate_ms"), baseline_ms=checked_number(data, "baseline_ms"),
            flush_l2=bool(data.get("flush_l2", False)), run=RunDetails.from_json(data),
            candidate_samples_ms=tuple(samples.get("candidate_ms") or ()),
            baseline_samples_ms=tuple(samples.get("baseline_ms") or ()),
            candidate_first=tuple(samples.get("candidate_first") or ()),
            p_bh=data.get("p_bh"), verdict_bh=data.get("verdict_bh"),
            vs_last=LastRun.from_json(vs_last) if vs_last else None,
            candidate_throughput=_throughput_from_json(throughput.get("candidate")),
            baseline_throughput=_throughput_from_json(throughput.get("baseline")),
            ceiling=_ceiling_from_json(data.get("ceiling")), mode=data.get("mode"),
            modes=tuple(ModeRecord.from_json(m) for m in data.get("modes") or ()),
        )


@dataclass(frozen=True)
class PairwiseRecord:
    """One pair of a tournament: ``speedup`` is ``slower``'s time over ``faster``'s; the verdict is ``faster``'s.

    >>> PairwiseRecord.from_json({"faster": "a", "slower": "b", "verdict": "win", "speedup": 1.3}).to_json()["ci"]
    [None, None]
    """

    faster: str
    slower: str
    verdict: Verdict | None
    speedup: float | None
    ci: Interval
    p_value: float | None  # Holm-adjusted across all pairs and corrected for the looks
    p_value_raw: float | None

    def to_json(self) -> dict[str, Any]:
        return {"faster": self.faster, "slower": self.slower, "verdict": self.verdict, "speedup": self.speedup,
                "ci": list(self.ci), "p_value": self.p_value, "p_value_raw": self.p_value_raw}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "PairwiseRecord":
        return cls(faster=data.get("faster", ""), slower=data.get("slower", ""), verdict=data.get("verdict"),
                   speedup=data.get("speedup"), ci=interval_from_json(data.get("ci")), p_value=data.get("p_value"),
                   p_value_raw=data.get("p_value_raw"))


_Row = TypeVar("_Row", bound="_FailsByError")


class _FailsByError:
    """``failed`` and ``of_error`` of the rows whose ``error`` field marks a failure (tournaments, measurements;
    a comparison's failure is its verdict "error")."""

    @property
    def failed(self) -> bool:
        return self.error is not None  # type: ignore[attr-defined]  (a field of every subclass)

    @classmethod
    def of_error(cls: type[_Row], name: str, error: BaseException, *, nodeid: str = "",
                 shape: Mapping[str, Any] | None = None, elapsed_s: float | None = None) -> _Row:
        """The row of a run that raised ``error``."""
        return cls(name=name, nodeid=nodeid, shape=shape, error=describe_error(error),  # type: ignore[call-arg]
                   run=RunDetails(elapsed_s=elapsed_s))


@dataclass(frozen=True)
class TournamentRecord(_FailsByError):
    """One tournament's row: the ranking (best first), every pair's result, and the samples; or, with ``error``
    set, what it raised.

    >>> TournamentRecord.of_error("variants", ValueError("no variants")).to_json()["verdict"]
    'error'
    """

    name: str
    nodeid: str = ""
    shape: Mapping[str, Any] | None = None
    error: str | None = None
    ranking: tuple[str, ...] = ()
    best: str = ""
    indistinguishable_from_best: tuple[str, ...] = ()
    median_ms: Mapping[str, float] = field(default_factory=dict)
    pairwise: tuple[PairwiseRecord, ...] = ()
    n_rounds: int = 0
    run: RunDetails = RunDetails()
    samples_ms: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    orders: tuple[tuple[str, ...], ...] = ()  # per round: the variants in the order they ran
    throughput: Mapping[str, ThroughputRecord] = field(default_factory=dict)  # per variant given flops/bytes
    ceiling: CeilingRecord | None = None


    def versus_best(self, variant: str) -> PairwiseRecord | None:
        """The pair of the best variant and ``variant``, when the tournament tested it."""
        for pair in self.pairwise:
            if pair.faster == self.best and pair.slower == variant:
                return pair
        return None

    def to_json(self) -> dict[str, Any]:
        if self.failed:
            return _failure_json("tournament", self.name, self.nodeid, self.shape, self.error, self.run.elapsed_s,
                                 self.run.gpu)
        data = {
            "kind": "tournament", "error": None, "name": self.name, "ranking": list(self.ranking), "best": self.best,
            "indistinguishable_from_best": list(self.indistinguishable_from_best), "median_ms": dict(self.median_ms),
            "pairwise": [pair.to_json() for pair in self.pairwise], "n_rounds": self.n_rounds,
            **self.run.to_json(), "nodeid": self.nodeid, "shape": copy.deepcopy(self.shape),
            "samples": {
                "ms": {variant: list(times) for variant, times in self.samples_ms.items()},
                "orders": [list(order) for order in self.orders],
            },
        }
        if self.throughput:  # as for comparisons: rows without flops= or bytes= keep the first layout
            data["throughput"] = {variant: rates.to_json() for variant, rates in self.throughput.items()}
        if self.ceiling is not None:
            data["ceiling"] = self.ceiling.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TournamentRecord":
        samples = data.get("samples") or {}
        # Only a failed tournament's row has a verdict ("error"); its message is shown as written, even if null.
        error = str(data.get("error")) if data.get("verdict") == "error" else None
        return cls(
            name=data.get("name", ""), nodeid=data.get("nodeid") or "", shape=data.get("shape"), error=error,
            ranking=tuple(data.get("ranking") or ()), best=data.get("best", ""),
            indistinguishable_from_best=tuple(data.get("indistinguishable_from_best") or ()),
            median_ms=data.get("median_ms") or {},
            pairwise=tuple(PairwiseRecord.from_json(pair) for pair in data.get("pairwise") or ()),
            n_rounds=data.get("n_rounds", 0), run=RunDetails.from_json(data),
            samples_ms={variant: tuple(times) for variant, times in (samples.get("ms") or {}).items()},
            orders=tuple(tuple(order) for order in samples.get("orders") or ()),
            throughput={variant: ThroughputRecord.from_json(rates)
                        for variant, rates in (data.get("throughput") or {}).items()},
            ceiling=_ceiling_from_json(data.get("ceiling")),
        )


@dataclass(frozen=True)
class MeasurementRecord(_FailsByError):
    """One function timed alone (``kernel_ab.measure``): its median time per call with an exact order-statistic
    interval, the samples, and its throughput; or, with ``error`` set, what it raised.

    >>> row = MeasurementRecord("copy", median_ms=1.5, ci_ms=(1.4, 1.6), n_samples=40)
    >>> MeasurementRecord.from_json(row.to_json()).ci_ms, row.to_json()["kind"]
    ((1.4, 1.6), 'measurement')
    """

    name: str
    nodeid: str = ""
    shape: Mapping[str, Any] | None = None
    error: str | None = None
    median_ms: float | None = None  # per call
    ci_ms: Interval = UNBOUNDED  # at run.ci_level
    n_samples: int = 0
    run: RunDetails = RunDetails()
    samples_ms: tuple[float, ...] = ()
    throughput: ThroughputRecord | None = None
    ceiling: CeilingRecord | None = None


    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "measurement", "error": self.error, "name": self.name, "nodeid": self.nodeid,
            "shape": copy.deepcopy(self.shape), "median_ms": self.median_ms, "ci_ms": list(self.ci_ms),
            "n_samples": self.n_samples, **self.run.to_json(), "samples": {"ms": list(self.samples_ms)},
            "throughput": self.throughput.to_json() if self.throughput else None,
            "ceiling": self.ceiling.to_json() if self.ceiling else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "MeasurementRecord":
        return cls(
            name=data.get("name", ""), nodeid=data.get("nodeid") or "", shape=data.get("shape"),
            error=data.get("error"), median_ms=data.get("median_ms"),
            ci_ms=interval_from_json(data.get("ci_ms"), "ci_ms"),
            n_samples=data.get("n_samples", 0), run=RunDetails.from_json(data),
            samples_ms=tuple((data.get("samples") or {}).get("ms") or ()),
            throughput=_throughput_from_json(data.get("throughput")), ceiling=_ceiling_from_json(data.get("ceiling")),
        )


ABRecord = ComparisonRecord | TournamentRecord | MeasurementRecord


def record_from_json(data: Mapping[str, Any]) -> ABRecord | None:
    """The typed record of a JSON record, by its ``kind``; None for a kind this version does not know.

    >>> record_from_json({"kind": "tournament", "name": "variants", "best": "a"}).best
    'a'
    """
    kind = data.get("kind")
    if kind == "comparison":
        return ComparisonRecord.from_json(data)
    if kind == "tournament":
        return TournamentRecord.from_json(data)
    if kind == "measurement":
        return MeasurementRecord.from_json(data)
    return None


