"""The A/B session keeps its report typed from the records' arrival to the files: JSON only on the xdist hop (the
test report's attribute), on disk, and when an earlier report is read."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from pytest_kernelcheck import ab_session, plugin_ab
from pytest_kernelcheck.results import gate, report
from pytest_kernelcheck.results.records import ComparisonRecord
from pytest_kernelcheck.results.report_record import ABReport
from pytest_kernelcheck.speed.throughput import CeilingMeter


def _row(name: str, speedup: float, rng: random.Random) -> dict:
    spread = rng.uniform(0.01, 0.05)
    verdict = "win" if speedup > 1.1 else "loss" if speedup < 0.9 else "tie"
    return {"kind": "comparison", "nodeid": f"t.py::{name}", "name": name, "verdict": verdict, "speedup": speedup,
            "ci": [speedup - spread, speedup + spread], "p_value": rng.uniform(1e-6, 1e-3) if verdict != "tie" else 0.6,
            "baseline_ms": rng.uniform(0.1, 2.0), "candidate_ms": rng.uniform(0.1, 2.0), "n_samples": 31}


def test_a_run_builds_judges_and_writes_the_typed_report_without_parsing_json_back(tmp_path, monkeypatch):
    rng = random.Random(45)
    earlier_path = tmp_path / "earlier.json"
    report.write_json(report.build_report([_row("fused", 1.6, rng), _row("split", 1.3, rng)], settings={}),
                      earlier_path)
    previous = report.read_report(earlier_path)  # JSON read from disk becomes the typed report here
    assert isinstance(previous, ABReport)
    session = ab_session.ABSession(True, {"alpha": 0.05}, str(tmp_path / "ab.json"), previous,
                                   rules=gate.parse_rules(["loss", "verdict"]), ceilings=CeilingMeter(enabled=False))
    collector = plugin_ab._Collector(session)
    # The records cross the hop as the JSON string a worker attaches to its test report.
    payload = json.dumps([_row("fused", 0.61, rng), _row("split", 1.31, rng)])
    collector.pytest_runtest_logreport(SimpleNamespace(**{plugin_ab.RECORDS_ATTRIBUTE: payload}))
    assert all(isinstance(record, ComparisonRecord) for record in session.records)

    def no_parsing(data):
        raise AssertionError("the in-process report was parsed back from JSON")

    monkeypatch.setattr(ABReport, "from_json", classmethod(lambda cls, data: no_parsing(data)))
    ab_session.finish(session)

    assert isinstance(session.built, ABReport)
    assert [r.reason for r in session.regressions] == ["this run's verdict is loss",
                                                       "verdict went from win to loss"]
    monkeypatch.undo()
    on_disk = report.load_report(tmp_path / "ab.json")
    assert on_disk == json.loads(json.dumps(session.built.to_json()))
    assert [row["vs_last"]["verdict"] for row in on_disk["comparisons"]] == ["win", "win"]
    assert (tmp_path / "ab.md").read_text().count("REGRESSION") == 1


def test_build_report_stays_the_json_form_of_the_typed_report():
    rng = random.Random(7)
    rows = [_row(name, rng.uniform(0.5, 2.0), rng) for name in ("a", "b", "c")]
    typed = report.assemble_report(rows, settings={"alpha": 0.05})
    as_json = report.build_report(rows, settings={"alpha": 0.05})
    assert {**as_json, "created": None} == {**typed.to_json(), "created": None}
    # Typed records and typed earlier reports are taken as they are.
    again = report.assemble_report(list(typed.comparisons), settings={"alpha": 0.05}, previous=typed)
    assert [r.vs_last.speedup for r in again.comparisons] == [r.speedup for r in typed.comparisons]


def test_read_report_names_a_missing_file(tmp_path):
    with pytest.raises(report.ReportError, match="does not exist"):
        report.read_report(tmp_path / "none.json")
