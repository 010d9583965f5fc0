"""Typed A/B records: the JSON layout they write, the round trip, and rows of older reports with keys missing."""
from __future__ import annotations

import json
import math

import pytest

from pytest_kernelcheck import Budget, KernelAB
from pytest_kernelcheck.results import records
from pytest_kernelcheck.results.records import (
    ComparisonRecord,
    LastRun,
    PairwiseRecord,
    RunDetails,
    TournamentRecord,
    record_from_json,
)
from pytest_kernelcheck.results.report_record import (
    ABReport,
    ReportSummary,
    RunEnvironment,
)
from pytest_kernelcheck.speed.timing import SimulatedTimer

# The keys a comparison's row has had since the first report version (its JSON layout).
COMPARISON_KEYS = {
    "kind", "error", "name", "verdict", "speedup", "ci", "ci_level", "p_value", "p_value_raw", "n_pairs",
    "candidate_ms", "baseline_ms", "method", "calls_per_sample", "flush_l2", "alpha", "margin", "looks_planned",
    "looks_done", "stop_reason", "elapsed_s", "device", "clock", "throttled", "notes", "nodeid", "shape", "samples",
}
TOURNAMENT_KEYS = {
    "kind", "error", "name", "ranking", "best", "indistinguishable_from_best", "median_ms", "pairwise", "n_rounds",
    "method", "calls_per_sample", "alpha", "margin", "ci_level", "looks_planned", "looks_done", "stop_reason",
    "elapsed_s", "device", "clock", "throttled", "notes", "nodeid", "shape", "samples",
}
FAILURE_KEYS = {
    "kind", "name", "nodeid", "shape", "verdict", "error", "speedup", "ci", "p_value", "candidate_ms",
    "baseline_ms", "n_pairs", "method", "elapsed_s",
}


def fixture_records() -> list[dict]:
    """The JSON records a test's kernel_ab leaves: a comparison, a tournament and one of each that raised."""
    left = []
    ab = KernelAB(Budget(max_time=0.05, seed=0), nodeid="t.py::test_x", test_name="test_x",
                  shape=lambda: {"S": 64}, record=left.append)
    a, b = (lambda: None), (lambda: None)
    timer = SimulatedTimer({a: lambda rng, now: 1e-3, b: lambda rng, now: 2e-3})
    ab.compare(a, b, timer=timer, name="compared")
    ab.tournament({"a": a, "b": b}, timer=timer, name="ranked")

    def broken():
        raise RuntimeError("no kernel image")

    for call in (lambda: ab.compare(broken, b, name="broken"), lambda: ab.tournament({"x": broken, "b": b})):
        with pytest.raises(Exception):
            call()
    return left


def test_fixture_records_keep_the_report_layout_and_are_plain_json():
    compared, ranked, broken, broken_tournament = fixture_records()
    assert set(compared) == COMPARISON_KEYS
    assert set(compared["samples"]) == {"candidate_ms", "baseline_ms", "candidate_first"}
    assert set(ranked) == TOURNAMENT_KEYS and set(ranked["samples"]) == {"ms", "orders"}
    assert set(ranked["pairwise"][0]) == {"faster", "slower", "verdict", "speedup", "ci", "p_value", "p_value_raw"}
    assert set(broken) == set(broken_tournament) == FAILURE_KEYS
    assert (broken["kind"], broken_tournament["kind"]) == ("comparison", "tournament")
    assert broken["error"] == "CallableFailed: candidate raised RuntimeError during its first call: no kernel image"
    assert json.loads(json.dumps([compared, ranked, broken, broken_tournament])) == [
        compared, ranked, broken, broken_tournament
    ]


def test_every_record_survives_the_round_trip_through_json():
    for data in fixture_records():
        record = record_from_json(json.loads(json.dumps(data)))
        assert record_from_json(record.to_json()) == record
        assert record.to_json() == data
    last_run = LastRun(speedup=1.5, ci=(1.4, None), verdict="win", ratio=0.8, regression=True, reason="worse")
    row = ComparisonRecord("a", "tie", p_bh=0.3, verdict_bh="tie", vs_last=last_run)
    assert ComparisonRecord.from_json(row.to_json(with_last_run=True)) == row
    summary = ReportSummary(comparisons=2, win=1, error=1, regressions=("a",))
    assert ReportSummary.from_json(summary.to_json()) == summary
    environment = RunEnvironment(date="today", hostname="h", packages={"torch": "2.4"}, commit_info={"id": "abc"})
    assert RunEnvironment.from_json(environment.to_json()) == environment


def test_report_columns_are_written_only_where_the_report_filled_them_in():
    row = ComparisonRecord("a", "win", speedup=1.2)
    assert not {"p_bh", "verdict_bh", "vs_last"} & set(row.to_json())
    # Compared with an earlier report, every row says how it did; null for a row new in this run.
    assert row.to_json(with_last_run=True)["vs_last"] is None


def test_rows_with_keys_missing_get_defaults():
    row = ComparisonRecord.from_json({"kind": "comparison", "name": "old", "verdict": "win", "ci": None})
    assert (row.ci, row.p_value, row.run, row.candidate_samples_ms, row.vs_last) == (
        (None, None), None, RunDetails(), (), None
    )
    tournament = TournamentRecord.from_json({"kind": "tournament", "name": "t", "best": "a", "ranking": ["a", "b"],
                                             "pairwise": [{"faster": "a", "slower": "b", "verdict": "win"}]})
    assert tournament.versus_best("b") == PairwiseRecord("a", "b", "win", None, (None, None), None, None)
    assert not tournament.failed and tournament.run.method is None
    assert TournamentRecord.from_json({"kind": "tournament", "verdict": "error", "error": "boom"}).error == "boom"
    assert record_from_json({"kind": "something newer"}) is None
    summary = ReportSummary.from_json({"win": 3})
    assert (summary.win, summary.loss, summary.regressions) == (3, 0, None)


def test_a_report_row_as_the_first_version_wrote_it_reads_back_whole():
    written = {
        "kind": "comparison", "error": None, "name": "fwd", "verdict": "win", "speedup": 1.31, "ci": [1.2, 1.4],
        "ci_level": 0.995, "p_value": 1e-5, "p_value_raw": 1e-6, "n_pairs": 80, "candidate_ms": 1.0,
        "baseline_ms": 1.31, "method": "events", "calls_per_sample": 1, "flush_l2": False, "alpha": 0.05,
        "margin": 0.02, "looks_planned": 10, "looks_done": 3, "stop_reason": "decided", "elapsed_s": 0.4,
        "device": "cuda:0 (NVIDIA H200)", "clock": {"available": False, "reason": "no samples", "throttled": False},
        "throttled": False, "notes": [], "nodeid": "t.py::test_fwd", "shape": {"S": 128},
        "samples": {"candidate_ms": [1.0], "baseline_ms": [1.31], "candidate_first": [True]},
        "p_bh": 2e-5, "verdict_bh": "win",
    }
    row = ComparisonRecord.from_json(written)
    assert (row.run.device, row.run.looks_done, row.p_bh, row.candidate_first) == (
        "cuda:0 (NVIDIA H200)", 3, 2e-5, (True,)
    )
    assert row.to_json() == written


def test_intervals_keep_unbounded_ends_as_none():
    assert records.finite_interval((0.0, math.inf)) == (0.0, None)
    assert records.finite_interval((-math.inf, 2.0)) == (None, 2.0)


def test_a_mapping_without_our_schema_is_not_a_report():
    with pytest.raises(records.NotAReport, match="expected schema 'pytest-kernelcheck/ab-report'"):
        ABReport.from_json({"schema": records.SCHEMA, "comparisons": "none"})
    with pytest.raises(records.NotAReport):
        ABReport.from_json([])


def _comparison_row(**fields):
    row = {"kind": "comparison", "nodeid": "t.py::test_fused", "name": "fused", "verdict": "win", "speedup": 1.2,
           "ci": [1.1, 1.3], "p_value": 0.001, "candidate_ms": 1.0, "baseline_ms": 1.2}
    row.update(fields)
    return row


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"verdict": "WIN"}, "field 'verdict': 'WIN' is refused; accepted: 'win', 'loss', 'tie', 'inconclusive', "
                             "'error'"),
        ({"verdict": None}, "field 'verdict': None is refused"),
        ({"speedup": -3.0}, "field 'speedup': -3.0 is refused; accepted: a finite number above 0, or null"),
        ({"speedup": 0}, "field 'speedup': 0 is refused"),
        ({"speedup": "fast"}, "field 'speedup': 'fast' is refused"),
        ({"speedup": math.nan}, "field 'speedup': nan is refused"),
        ({"speedup": True}, "field 'speedup': True is refused"),
        ({"ci": [5.0, 1.0]}, r"field 'ci': \[5.0, 1.0\] is refused; accepted: \[low, high\] with low <= high"),
        ({"ci": [1.1]}, r"field 'ci': \[1.1\] is refused"),
        ({"ci": [-1.0, 1.0]}, r"field 'ci': \[-1.0, 1.0\] is refused"),
        ({"ci": [math.nan, 1.0]}, r"field 'ci': \[nan, 1.0\] is refused"),
        ({"ci": "1.1-1.3"}, "field 'ci': '1.1-1.3' is refused"),
        ({"p_value": 2.0}, "field 'p_value': 2.0 is refused; accepted: a finite number 0 or more and at most 1"),
        ({"baseline_ms": "slow"}, "field 'baseline_ms': 'slow' is refused"),
    ],
)
def test_a_comparison_field_no_run_writes_is_refused_naming_the_field(fields, message):
    with pytest.raises(records.DamagedReport, match=message):
        ComparisonRecord.from_json(_comparison_row(**fields))


def test_a_comparison_without_a_verdict_is_refused_not_read_as_inconclusive():
    # A row with only a name used to read as an inconclusive comparison that the gate never judged.
    with pytest.raises(records.DamagedReport, match="field 'verdict' is missing; accepted: 'win', "):
        ComparisonRecord.from_json({"kind": "comparison", "name": "fused"})


def test_unbounded_and_zero_interval_ends_still_read():
    # What runs do write: null ends (unbounded), a low end of 0 (exp of an unbounded log interval), an infinite
    # high end before finite_interval, and an error row's empty columns.
    assert ComparisonRecord.from_json(_comparison_row(ci=[0.0, None])).ci == (0.0, None)
    assert ComparisonRecord.from_json(_comparison_row(ci=[1.0, math.inf])).ci == (1.0, math.inf)
    assert ComparisonRecord.from_json(_comparison_row(ci=None, speedup=None)).ci == (None, None)
    failed = ComparisonRecord.from_json({"kind": "comparison", "name": "x", "verdict": "error", "error": "boom",
                                         "speedup": None, "ci": [None, None], "p_value": None})
    assert failed.failed and failed.speedup is None


def test_a_damaged_row_is_named_by_its_place_and_name_in_the_report():
    data = {"schema": records.SCHEMA, "version": 1,
            "comparisons": [_comparison_row(name="fine"), _comparison_row(name="fused", ci=[5.0, 1.0])]}
    with pytest.raises(records.DamagedReport, match=r"^comparisons\[1\] \('fused'\): field 'ci': \[5.0, 1.0\]"):
        ABReport.from_json(data)
    with pytest.raises(records.DamagedReport, match=r"^comparisons\[0\]: 'fused' is refused; accepted: a JSON "):
        ABReport.from_json({"schema": records.SCHEMA, "comparisons": ["fused"]})


@pytest.mark.parametrize("version", [99, 0, "1", None, True])
def test_a_report_of_another_layout_version_is_refused(version):
    with pytest.raises(records.DamagedReport, match=f"field 'version': {version!r} is refused; accepted: 1"):
        ABReport.from_json({"schema": records.SCHEMA, "version": version, "comparisons": []})
    # A report without the key predates it, and is of the first layout.
    assert ABReport.from_json({"schema": records.SCHEMA, "comparisons": []}).version == 1
