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

import time
from typing import Any, Callable, Mapping

from ..results.records import (
    ABRecord,
    ComparisonRecord,
    MeasurementRecord,
    TournamentRecord,
)
from . import throughput, timing
from .ab_results import (
    ComparisonResult,
    MeasureResult,
    PairwiseResult,
    TournamentResult,
)
from .budget import Budget
from .runs import (
    check_owned_inputs,
    run_comparison,
    run_measurement,
    run_tournament,
)

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


class KernelABAssertionError(AssertionError):
    """``assert_faster`` / ``assert_not_slower`` failed; the message carries the numbers."""


# What a run asks for a ceiling: given the timer that timed it, the ceiling of that device (or None).


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


