"""Build the typed A/B report from the records of a run: Benjamini-Hochberg columns, totals, ceilings, and the
match with an earlier report. The plugin keeps the typed report (:func:`assemble_report`) until it writes it;
:func:`build_report` gives its JSON form."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping, Sequence

from ..speed import stats
from .environment import utc_now
from .records import (
    BASELINE_MOVE,
    ABRecord,
    CeilingRecord,
    ComparisonRecord,
    LastRun,
    MeasurementRecord,
    TournamentRecord,
    record_from_json,
)
from .report_record import ABReport, ReportSummary, RunEnvironment
from .storage import machine_differences as differences
from .unmatched import vanished_rows


def build_report(
    records: Sequence[Mapping[str, Any] | ABRecord],
    *,
    settings: Mapping[str, Any],
    environment: Mapping[str, Any] | None = None,
    previous: ABReport | Mapping[str, Any] | None = None,
    finished: bool = True,
) -> dict[str, Any]:
    """The report of :func:`assemble_report` in its JSON form, for callers that write or send it (the plugin
    itself keeps the typed report until it writes the file).

    >>> r = build_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
    ...                    "speedup": 1.2, "ci": [1.1, 1.3], "p_value": 0.001}], settings={"alpha": 0.05})
    >>> r["summary"]["win"], r["comparisons"][0]["verdict_bh"]
    (1, 'win')
    """
    return assemble_report(records, settings=settings, environment=environment, previous=previous,
                           finished=finished).to_json()


def assemble_report(
    records: Sequence[Mapping[str, Any] | ABRecord],
    *,
    settings: Mapping[str, Any],
    environment: Mapping[str, Any] | None = None,
    previous: ABReport | Mapping[str, Any] | None = None,
    finished: bool = True,
) -> ABReport:
    """Assemble the typed report from the run's records (typed, or in their JSON form as they cross the xdist
    hop): comparisons with Benjamini-Hochberg columns, tournaments, totals, and regressions against ``previous``
    (an earlier report: typed, as :func:`.report_files.read_report` returns it, or its JSON); where ``previous``
    was measured on another machine than ``environment`` says (:func:`storage.machine_differences`), the
    report's ``machine_differences`` says how, and :func:`machine_lines` warns of it.
    ``finished=False`` marks the report of a run still going (see :class:`ProgressWriter`).

    >>> r = assemble_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
    ...                       "speedup": 1.2, "ci": [1.1, 1.3], "p_value": 0.001}], settings={"alpha": 0.05})
    >>> r.summary.win, r.comparisons[0].verdict_bh
    (1, 'win')
    """
    alpha = float(settings.get("alpha", 0.05))
    typed = [record if isinstance(record, (ComparisonRecord, TournamentRecord, MeasurementRecord)) else record_from_json(record) for record in records]
    comparisons = sorted((r for r in typed if isinstance(r, ComparisonRecord)), key=lambda r: r.nodeid)
    tournaments = sorted((r for r in typed if isinstance(r, TournamentRecord)), key=lambda r: r.nodeid)
    measurements = sorted((r for r in typed if isinstance(r, MeasurementRecord)), key=lambda r: r.nodeid)
    comparisons = _with_benjamini_hochberg(comparisons, alpha)
    regressions = None
    machine_differences: tuple[str, ...] = ()
    vanished: tuple[ComparisonRecord, ...] = ()
    if previous is not None:
        earlier = previous if isinstance(previous, ABReport) else ABReport.from_json(previous)
        comparisons, regressions = _mark_against_previous(comparisons, earlier.comparisons)
        vanished = vanished_rows(earlier.comparisons, comparisons)
        machine_differences = differences(earlier.environment, environment or {})
    tested = [r for r in comparisons if _tested(r)]
    speedups = [float(r.speedup) for r in tested if r.speedup]
    count = collections.Counter(r.verdict for r in comparisons)
    summary = ReportSummary(
        comparisons=len(comparisons),
        win=count["win"],
        loss=count["loss"],
        tie=count["tie"],
        inconclusive=count["inconclusive"],
        error=count["error"],
        geomean_speedup=stats.geometric_mean(speedups) if speedups else None,
        bh_alpha=alpha,
        bh_win=sum(r.verdict_bh == "win" for r in tested),
        bh_loss=sum(r.verdict_bh == "loss" for r in tested),
        throttled=sum(r.run.throttled for r in comparisons),
        tournaments=len(tournaments),
        measurements=len(measurements),
        regressions=regressions,
        modes_disagree=sum(r.modes_disagree for r in comparisons),
    )
    report = ABReport(
        created=utc_now(),
        settings=dict(settings),
        environment=_with_ceilings(dict(environment or {}), [*comparisons, *tournaments, *measurements], settings),
        summary=summary,
        comparisons=tuple(comparisons),
        tournaments=tuple(tournaments),
        measurements=tuple(measurements),
        finished=finished,
        machine_differences=machine_differences,
        vanished=vanished,
    )
    return report


def _with_ceilings(environment: dict[str, Any], records: Sequence[Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The environment with a ``ceilings`` block when any record gave flops or bytes: whether ceilings were
    measured (``--kernel-ab-ceilings``) and each device's and dtype's ceiling once, as the records carry them
    (so the ceilings of pytest-xdist workers are listed too)."""
    def has_work(record: Any) -> bool:
        if isinstance(record, ComparisonRecord):
            return record.candidate_throughput is not None
        return bool(record.throughput)

    if not any(has_work(record) for record in records):
        return environment
    found: dict[tuple[str, str | None], CeilingRecord] = {}
    for record in records:
        if record.ceiling is not None:
            found.setdefault(record.ceiling.key, record.ceiling)
    typed = dataclasses.replace(RunEnvironment.from_json(environment),
                                ceilings_enabled=settings.get("ceilings", "on") != "off",
                                ceilings=tuple(found.values()))
    return {**environment, "ceilings": typed.to_json()["ceilings"]}


def _tested(record: ComparisonRecord) -> bool:
    """Whether a comparison has a p-value for Benjamini-Hochberg: it ran (did not fail) and tested something."""
    return not record.failed and record.p_value is not None


def _with_benjamini_hochberg(comparisons: list[ComparisonRecord], alpha: float) -> list[ComparisonRecord]:
    """Fill in ``p_bh`` and ``verdict_bh`` on the tested rows: a win or loss whose adjusted p-value is not below
    ``alpha`` becomes inconclusive."""
    marked = list(comparisons)
    tested = [i for i, record in enumerate(marked) if _tested(record)]
    for i, p_bh in zip(tested, stats.benjamini_hochberg([float(marked[i].p_value) for i in tested])):
        keep = marked[i].verdict not in ("win", "loss") or p_bh < alpha
        marked[i] = dataclasses.replace(marked[i], p_bh=p_bh, verdict_bh=marked[i].verdict if keep else "inconclusive")
    return marked


def _mark_against_previous(
    comparisons: list[ComparisonRecord], earlier_rows: Sequence[ComparisonRecord]
) -> tuple[list[ComparisonRecord], tuple[str, ...]]:
    """Fill in ``vs_last`` on each comparison found in the earlier report; also return the names that regressed.

    A regression: the speedup interval now sits entirely below the earlier one, or the verdict went from win
    to loss. Rows are matched by test and name; names are unique within a test now, but an earlier report (or
    a rerun test) can hold several rows under one key, and those are matched in order, one earlier row each, so
    that no row hides behind another's match.
    """
    earlier: dict[tuple[str, str], list[ComparisonRecord]] = {}
    for row in earlier_rows:
        earlier.setdefault((row.nodeid, row.name), []).append(row)
    marked, regressions = [], []
    for record in comparisons:
        candidates = earlier.get((record.nodeid, record.name)) or []
        # Never across GPU models: where both rows name their GPU's model (--kernel-gpus), it must be the same.
        # Rows that name none (one-GPU runs, earlier reports) were saved per machine slug, which holds the model.
        usable = [row for row in candidates if not _models_differ(row, record)]
        old = usable[0] if usable else None
        if old is not None:
            candidates.remove(old)
        last_run = None if old is None or record.failed else _last_run(record, old)
        marked.append(dataclasses.replace(record, vs_last=last_run))
        if last_run is not None and last_run.regression:
            regressions.append(record.name or record.nodeid)
    return marked, tuple(regressions)


def _models_differ(a: ComparisonRecord, b: ComparisonRecord) -> bool:
    model_a = a.run.gpu.model if a.run.gpu is not None else None
    model_b = b.run.gpu.model if b.run.gpu is not None else None
    return model_a is not None and model_b is not None and model_a != model_b


def _last_run(record: ComparisonRecord, old: ComparisonRecord) -> LastRun:
    old_low, new_high = old.ci[0], record.ci[1]
    reasons = []
    if old_low is not None and new_high is not None and new_high < old_low:
        below, above = stats.decimals_apart(float(new_high), float(old_low))  # never "(1.050 < 1.050)"
        reasons.append(f"interval now below the last run's ({below} < {above})")
    if old.verdict == "win" and record.verdict == "loss":
        reasons.append("verdict went from win to loss")
    ratio = float(record.speedup) / float(old.speedup) if old.speedup and record.speedup else None
    then, now = old.run.method, record.run.method
    return LastRun(
        speedup=old.speedup,
        ci=old.ci,
        verdict=old.verdict,
        ratio=ratio,
        regression=bool(reasons),
        reason="; ".join(reasons) or None,
        timing_change=f"timed by {then} then, by {now} now" if then and now and then != now else None,
        baseline_change=_baseline_change(old.baseline_ms, record.baseline_ms),
    )


def _baseline_change(then_ms: float | None, now_ms: float | None) -> str | None:
    """Says how the baseline's time per call moved between two runs, where it moved by more than BASELINE_MOVE.

    >>> _baseline_change(0.3292, 0.6128)
    'baseline 0.3292 ms a call then, 0.6128 ms now (1.86x)'
    >>> _baseline_change(0.5, 0.52) is None
    True
    """
    if not then_ms or not now_ms or then_ms <= 0 or now_ms <= 0:
        return None
    ratio = now_ms / then_ms
    if 1 / (1 + BASELINE_MOVE) <= ratio <= 1 + BASELINE_MOVE:
        return None
    return f"baseline {then_ms:.4g} ms a call then, {now_ms:.4g} ms now ({ratio:.2f}x)"
