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
from . import inputs as owned_inputs
from . import models, throughput, timing
from .ab_results import (
    ComparisonResult,
    MeasureResult,
    PairwiseResult,
    TournamentResult,
)
from .budget import Budget
from .modes import DEFAULT_MODES, ModeUnavailable, parse_modes
from .runs import (
    run_comparison,
    run_measurement,
    run_tournament,
)
from .spec import ABSpec

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


# What the plugin raises about the test's own arguments and outputs: each message names what is wrong and how to
# fix it, so these reach the test without the plugin's frames.
REFUSALS = (TypeError, ValueError, owned_inputs.OutputMismatch, ModeUnavailable)


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
        modes: Any = DEFAULT_MODES,
    ) -> None:
        self.defaults = defaults or Budget()
        self.modes = parse_modes(modes, "the default modes")  # --kernel-ab-modes, or a kernel_ab_modes marker
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

    def spec(self, **keywords: Any) -> ABSpec:
        """The spec of a run from this test's defaults (budget, modes) and ``keywords``, checked once.

        >>> kernel_ab.spec(modes="latency", max_time=0.5).modes  # doctest: +SKIP
        ('latency',)
        """
        return ABSpec.build(ABSpec(budget=self.defaults, modes=self.modes), **keywords)

    def _run(
        self,
        record_type: type[ABRecord],
        name: str | None,
        work: Callable[[ABSpec, str, Any], Any],
        keywords: dict[str, Any],
        one_mode: bool = False,
        after: Callable[[Any], None] | None = None,
    ) -> Any:
        __tracebackhide__ = True
        spec = keywords.pop("spec", None)
        if spec is not None and not isinstance(spec, ABSpec):
            raise TypeError(f"spec must be an ABSpec (kernel_ab.spec(...)), got {type(spec).__name__}")
        if one_mode and keywords.get("modes") is None and (spec is None or len(spec.modes) > 1):
            keywords["modes"] = (spec or self).modes[:1]  # tournaments and measurements: the first default mode
        # Checked before anything runs: a refused call claims no name and records nothing.
        settings = ABSpec.build(spec or ABSpec(budget=self.defaults, modes=self.modes), **keywords)
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
            if isinstance(exc, REFUSALS):
                # The message says everything; the plugin's frames would only add their arguments, which pytest
                # prints in full (a tensor passed for a callable filled a hundred lines, twice).
                raise exc.with_traceback(None)
            raise
        result.nodeid, result.shape = self._nodeid, shape
        if after is not None:  # what a model comparison adds to the result before its row is recorded
            after(result)
        self.results.append(result)
        self._record(result.to_record().to_json())
        return result

    def compare(
        self,
        candidate: Callable[[], Any],
        baseline: Callable[[], Any],
        *,
        name: str | None = None,
        **keywords: Any,
    ) -> ComparisonResult:
        """Time ``candidate`` against ``baseline`` (zero-argument callables); never fails on the verdict.

        Keywords (checked once, as an :class:`.spec.ABSpec`; ``spec=kernel_ab.spec(...)`` passes one built
        before): ``modes`` (``"throughput"``, ``"latency"``, ``"graph"`` or several, e.g.
        ``modes=("throughput", "latency")``; default ``--kernel-ab-modes``, else throughput alone): each mode gets
        its own samples and verdict (``result.modes``), the first that could run gives ``result.verdict``.
        ``check``: the outputs of both sides' first calls are compared before timing whenever both return tensors
        or arrays (the policy of the output's dtype; a policy name or dtype, a callable ``(candidate_out,
        baseline_out)`` that raises, or ``check=False`` to time callables whose outputs differ by design).
        ``inputs=make_inputs`` (a zero-argument callable returning a tuple of arguments or a dict of keyword
        arguments): the callables take the inputs, the plugin rotates several sets of them so every timed call
        starts cold, and after timing the outputs on fresh inputs must match under ``check``.

        ``name`` labels the result in the report (default: the test's name); each comparison, tournament and
        measurement of one test needs its own, and a name used twice raises ``ValueError``. ``flops`` and
        ``bytes``: the work of one call (numbers, or callables of the test's ``shape``), the same for both
        sides; they add TFLOP/s, GB/s and the share of this device's ceiling for ``dtype`` (default: the shape's
        dtype). ``timer``: "auto", "cpu", "cuda", a timer object, or a mapping of mode names to timers. Budget
        keywords: max_time, min_pairs, max_pairs, alpha, margin, flush_l2, hold_gpu, calls_per_sample,
        use_cuda_graph, warmup, check_output, seed, throttle, check_escape.

        >>> result = kernel_ab.compare(lambda: new(x), lambda: old(x), max_time=1.0,  # doctest: +SKIP
        ...                            flops=lambda s: 2 * s.M * s.N * s.K, modes=("throughput", "latency"))
        >>> result.verdict, result.modes["latency"].verdict, result.modes_disagree  # doctest: +SKIP
        ('win', 'loss', True)
        >>> make = lambda: (torch.randn(4096, 4096, device="cuda"),)  # doctest: +SKIP
        >>> kernel_ab.compare(new, old, inputs=make, check="fp32").input_sets  # doctest: +SKIP
        4
        """

        def work(spec: ABSpec, label: str, shape: Any) -> ComparisonResult:
            counts = throughput.Work.of(spec.work.flops, spec.work.bytes, shape)
            spec = spec.with_work(counts.flops, counts.bytes, throughput.dtype_name(spec.work.dtype, shape))
            return run_comparison(candidate, baseline, spec, name=label, ceilings=self._ceilings)

        __tracebackhide__ = True  # the candidate and baseline are this frame's arguments: never print them
        return self._run(ComparisonRecord, name, work, keywords)

    def assert_faster(
        self, candidate: Callable[[], Any], baseline: Callable[[], Any], *, name: str | None = None,
        mode: str | None = None, **keywords: Any
    ) -> ComparisonResult:
        """Compare, and fail unless the candidate is significantly faster (verdict "win") in ``mode``.

        ``mode``: the mode the assertion reads; default the comparison's own verdict, that of its first mode
        (``modes=``, else ``--kernel-ab-modes``, else throughput): the one the report row and the gate show, so a
        test and its report never disagree. A ``mode`` not among ``modes`` is measured as well.

        >>> kernel_ab.assert_faster(lambda: new(x), lambda: old(x))  # doctest: +SKIP
        >>> kernel_ab.assert_faster(lambda: new(x), lambda: old(x), mode="latency")  # doctest: +SKIP
        """
        __tracebackhide__ = True
        result = self.compare(candidate, baseline, name=name, **self._with_mode(mode, keywords))
        verdict, where = self._verdict_in(result, mode)
        if verdict != "win":
            raise KernelABAssertionError(
                f"{result.name}: candidate is not faster than baseline{where}; {result.describe()}")
        return result

    def assert_not_slower(
        self, candidate: Callable[[], Any], baseline: Callable[[], Any], *, name: str | None = None,
        mode: str | None = None, **keywords: Any
    ) -> ComparisonResult:
        """Compare, and fail only when the candidate is significantly slower (verdict "loss") in ``mode``
        (default as for :meth:`assert_faster`).

        >>> kernel_ab.assert_not_slower(lambda: dispatch(x), lambda: sdpa(x), mode="latency")  # doctest: +SKIP
        """
        __tracebackhide__ = True
        result = self.compare(candidate, baseline, name=name, **self._with_mode(mode, keywords))
        verdict, where = self._verdict_in(result, mode)
        if verdict == "loss":
            raise KernelABAssertionError(
                f"{result.name}: candidate is slower than baseline{where}; {result.describe()}")
        return result

    def _with_mode(self, mode: str | None, keywords: dict[str, Any]) -> dict[str, Any]:
        """``keywords`` with ``mode`` among the modes measured (added after the others)."""
        if mode is None:
            return keywords
        (mode,) = parse_modes((mode,), "mode")
        spec = keywords.get("spec")
        modes = parse_modes(keywords["modes"]) if keywords.get("modes") is not None else (spec or self).modes
        return {**keywords, "modes": modes if mode in modes else (*modes, mode)}

    @staticmethod
    def _verdict_in(result: ComparisonResult, mode: str | None) -> tuple[str, str]:
        if mode is None or mode == result.mode:
            return result.verdict, "" if list(result.modes) in ([], ["throughput"]) else f" ({result.mode})"
        record = result.in_mode(mode)
        if not record.available:
            return "unavailable", f" in {mode} mode, which is not available: {record.unavailable}"
        return str(record.verdict), f" in {mode} mode"

    def _compare_pair(self, pair: Any, name: str | None, keywords: dict[str, Any],
                      after: Callable[[ComparisonResult], None] | None = None) -> ComparisonResult:
        """Compare a :class:`.models.ModelPair`: its keywords under the caller's, its notes on the row."""

        def add_notes(result: ComparisonResult) -> None:
            result.notes[:0] = list(pair.notes)
            if after is not None:
                after(result)

        def work(spec: ABSpec, label: str, shape: Any) -> ComparisonResult:
            counts = throughput.Work.of(spec.work.flops, spec.work.bytes, shape)
            spec = spec.with_work(counts.flops, counts.bytes, throughput.dtype_name(spec.work.dtype, shape))
            return run_comparison(pair.candidate, pair.baseline, spec, name=label, ceilings=self._ceilings)

        __tracebackhide__ = True
        return self._run(ComparisonRecord, name, work, {**pair.keywords, **keywords}, after=add_notes)

    def compare_modules(self, model_a: Any, model_b: Any, inputs: Any, *, name: str | None = None,
                        grad: bool = False, **keywords: Any) -> ComparisonResult:
        """Compare the forward pass of two ``nn.Module``s (candidate ``model_a``, baseline ``model_b``) on the same
        ``inputs`` (a tensor, a tuple of arguments or a dict of keyword arguments), under ``torch.no_grad()``
        unless ``grad``. Their outputs are compared before timing under the policy of the output's dtype
        (``check=`` another policy, a callable, or ``False``). Every keyword of :meth:`compare` applies
        (``modes=``, ``flops=``, ``bytes=``, budget keywords).

        >>> model.eval(); fused = copy.deepcopy(model); fused.attn.backend = "flashlite"  # doctest: +SKIP
        >>> r = kernel_ab.compare_modules(fused, model, (ids,), modes=("throughput", "latency"))  # doctest: +SKIP
        >>> r.verdict, r.modes["latency"].verdict  # doctest: +SKIP
        ('win', 'loss')
        """
        __tracebackhide__ = True
        return self._compare_pair(models.forward_pair(model_a, model_b, inputs, grad=grad), name, keywords)

    def compare_training_steps(self, model_a: Any, model_b: Any, inputs: Any, *, loss: Callable[[Any], Any],
                               optimizer: Callable[[Any], Any] | None = None, name: str | None = None,
                               **keywords: Any) -> ComparisonResult:
        """Compare one training step (forward, ``loss(output)``, backward, optimizer step) of two modules; times
        are per step. Each side trains its own deep copy of its module with its own optimizer
        (``optimizer(parameters)``, default SGD lr 1e-3), so the steps never interfere and ``model_a`` and
        ``model_b`` are left unchanged. The first steps' losses are compared before timing (two configurations
        of one model agree on them; ``check=False`` for different models).

        >>> r = kernel_ab.compare_training_steps(  # doctest: +SKIP
        ...     fused, model, (x,), loss=lambda out: F.cross_entropy(out, y),
        ...     optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
        >>> r.candidate_ms, r.baseline_ms  # per step  # doctest: +SKIP
        (41.2, 44.9)
        """
        __tracebackhide__ = True
        pair = models.training_pair(model_a, model_b, inputs, loss, optimizer)
        return self._compare_pair(pair, name, keywords)

    def compare_generation(self, generate_a: Callable[[], Any], generate_b: Callable[[], Any], *, tokens: int,
                           name: str | None = None, **keywords: Any) -> ComparisonResult:
        """Compare generation of ``tokens`` new tokens a call (each callable owns its model and KV cache); the
        result's ``tokens_per_s`` is (candidate, baseline) and its speedup their ratio. Generated ids are
        compared before timing (``check=False`` for sampling).

        >>> gen = lambda m: (lambda: m.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False))
        >>> r = kernel_ab.compare_generation(gen(fast_model), gen(model), tokens=64)  # doctest: +SKIP
        >>> r.tokens_per_s, r.speedup  # doctest: +SKIP
        ((812.0, 640.5), 1.268)
        """
        pair = models.generation_pair(generate_a, generate_b, tokens)

        def rates(result: ComparisonResult) -> None:
            candidate, baseline = models.tokens_per_second(tokens, result.candidate_ms, result.baseline_ms)
            result.tokens_per_s = candidate, baseline
            result.notes.append(f"tokens per second: candidate {candidate:.4g}, baseline {baseline:.4g} (ratio "
                                f"{candidate / baseline:.3f})")

        return self._compare_pair(pair, name, keywords, after=rates)

    def tournament(
        self,
        variants: Mapping[str, Callable[[], Any]],
        *,
        name: str | None = None,
        **keywords: Any,
    ) -> TournamentResult:
        """Rank named variants on one input; says which cannot be told apart from the best.

        ``name`` follows the rule of :meth:`compare`: unique among the test's comparisons and tournaments. A
        tournament runs in one mode (``modes="latency"``; default: the first of the test's default modes).
        ``flops`` and ``bytes``: as for :meth:`compare`, one value for every variant or a mapping of variant
        names to their own (a number or a callable of the shape each). ``inputs`` and ``check``: as for
        :meth:`compare`; each variant's output on fresh inputs is checked against the first variant's.

        >>> t = kernel_ab.tournament({"a": lambda: a(x), "b": lambda: b(x), "c": lambda: c(x)},  # doctest: +SKIP
        ...                          flops=2 * n**3, bytes={"a": 6 * n**2, "b": 6 * n**2, "c": 8 * n**2})
        >>> t.best, t.indistinguishable_from_best, t.throughput["b"].tflops  # doctest: +SKIP
        ('b', ['b', 'c'], 310.2)
        """
        def work(spec: ABSpec, label: str, shape: Any) -> TournamentResult:
            names = [str(n) for n in variants] if isinstance(variants, Mapping) else []
            counts = {n: throughput.Work.of(f, b, shape, what=f"variant {n!r}: ") for n, f, b in zip(
                names, throughput.per_variant(spec.work.flops, names, "flops").values(),
                throughput.per_variant(spec.work.bytes, names, "bytes").values())}
            spec = spec.with_work({n: c.flops for n, c in counts.items()}, {n: c.bytes for n, c in counts.items()},
                                  throughput.dtype_name(spec.work.dtype, shape))
            return run_tournament(variants, spec, name=label, ceilings=self._ceilings)

        return self._run(TournamentRecord, name, work, keywords, one_mode=True)

    def measure(
        self,
        fn: Callable[[], Any],
        *,
        name: str | None = None,
        **keywords: Any,
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
        def work(spec: ABSpec, label: str, shape: Any) -> MeasureResult:
            counts = throughput.Work.of(spec.work.flops, spec.work.bytes, shape)
            spec = spec.with_work(counts.flops, counts.bytes, throughput.dtype_name(spec.work.dtype, shape))
            return run_measurement(fn, spec, name=label, ceilings=self._ceilings)

        return self._run(MeasurementRecord, name, work, keywords, one_mode=True)


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


