"""The gate and the report on rows --kernel-ab-compare cannot pair: an earlier comparison renamed or removed in this
run is listed as missing (terminal, markdown, JSON) and fails the gate; a new one is listed as not checked."""
from __future__ import annotations

import json
import re

import pytest

from pytest_kernelcheck.results import gate, report

pytest_plugins = ["pytester"]

FAST = ["--kernel-ab", "--kernel-ab-max-time", "0.2", "-p", "no:cacheprovider"]
SETTINGS = {"alpha": 0.05, "margin": 0.02}

# Simulated timers: the candidate takes CANDIDATE_MS, the baseline 2 ms (speedup 2 / CANDIDATE_MS).
SIMULATED = """
from pytest_kernelcheck.speed.timing import SimulatedTimer

def candidate():
    pass

def baseline():
    pass

def test_fused(kernel_ab):
    timer = SimulatedTimer({{candidate: lambda rng, now: {candidate_ms} * 1e-3 * (1 + 0.01 * rng.random()),
                            baseline: lambda rng, now: 2e-3 * (1 + 0.01 * rng.random())}})
    kernel_ab.compare(candidate, baseline, name={name!r}, timer=timer)
"""


def row(name, verdict, speedup, ci, p=0.001):
    return {"kind": "comparison", "nodeid": f"t.py::{name}", "name": name, "shape": {"S": 128},
            "verdict": verdict, "speedup": speedup, "ci": list(ci), "p_value": p}


def test_a_winning_comparison_renamed_to_a_tie_fails_the_gate_as_missing_end_to_end(pytester):
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0, name="fused"))
    pytester.runpytest(*FAST, "--kernel-ab-report", "first.json").assert_outcomes(passed=1)
    assert json.loads((pytester.path / "first.json").read_text())["comparisons"][0]["verdict"] == "win"
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=2.0, name="fused | v`2`"))
    result = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json", "--kernel-ab-compare-fail", "verdict",
                                "--kernel-ab-report", "second.json")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # it exited 0: the vanished row was never mentioned
    result.stdout.fnmatch_lines([
        "fused | v`2`*new (not checked)",
        "*; 1 missing from this run",
        "1 comparison(s) of the compared run are missing from this run (renamed, removed, deselected or skipped; "
        "not checked):",
        "  test_sim.py::test_fused / fused: was *x [[]*[]] win",
        "1 comparison(s) new in this run, not checked by verdict (no earlier row): test_sim.py::test_fused / "
        "fused | v`2`",
        "*= kernelcheck: regressions =*",
        "test_sim.py::test_fused / fused [[]missing[]]: in the compared run but not in this run (renamed, removed, "
        "deselected or skipped), so verdict could not check it*",
        "  was *x [[]*[]] win",
        "  now not in this run",
        "the gate fails the session (--kernel-ab-compare-fail): 1 finding(s) of its rules: missing 1 (in the "
        "compared run, missing from this run)",
    ])
    data = json.loads((pytester.path / "second.json").read_text())
    assert [(r["name"], r["verdict"]) for r in data["vanished"]] == [("fused", "win")]
    assert data["comparisons"][0]["vs_last"] is None
    markdown = (pytester.path / "second.md").read_text()
    assert "1 comparison(s) of the compared run are missing from this run" in markdown
    assert re.search(r"test_sim\.py::test_fused / fused: was \d\.\d+x \[\S+, \S+\] win", markdown)
    assert "fused \\| v`2`" in markdown and "new (not checked)" in markdown


def test_without_a_gate_the_missing_row_is_listed_and_the_session_passes(pytester):
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0, name="fused"))
    pytester.runpytest(*FAST, "--kernel-ab-report", "first.json").assert_outcomes(passed=1)
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0, name="renamed"))
    result = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["  test_sim.py::test_fused / fused: was *x [[]*[]] win"])
    assert "kernelcheck: regressions" not in result.stdout.str()


def test_the_loss_rule_alone_judges_this_run_only_and_ignores_missing_rows():
    now, earlier = [row("b", "win", 1.5, (1.4, 1.6))], [row("a", "win", 1.5, (1.4, 1.6))]
    built = report.build_report(now, settings=SETTINGS, previous=report.build_report(earlier, settings=SETTINGS))
    assert gate.evaluate([gate.LossRule()], built) == ()
    assert gate.unchecked_lines([gate.LossRule()], built) == []
    found = gate.evaluate([gate.LossRule(), gate.parse_rule("speedup:5%")], built)
    assert [(r.rule, r.record.name, r.missing) for r in found] == [("missing", "a", True)]
    assert "so speedup:5% could not check it" in found[0].reason


def test_an_earlier_row_that_raised_is_listed_missing_but_not_failed_and_a_rerun_key_is_not_missing():
    error = {"kind": "comparison", "nodeid": "t.py::x", "name": "x", "verdict": "error", "error": "boom"}
    earlier = [error, row("a", "win", 1.5, (1.4, 1.6)), row("a", "win", 1.4, (1.3, 1.5))]  # "a" ran twice then
    now = [row("a", "win", 1.5, (1.4, 1.6))]
    built = report.build_report(now, settings=SETTINGS, previous=report.build_report(earlier, settings=SETTINGS))
    assert [r["name"] for r in built["vanished"]] == ["x"]
    assert gate.evaluate([gate.VerdictRule()], built) == ()
    assert report.summary_line(built).endswith("; 1 missing from this run")


def test_a_report_compared_with_nothing_missing_says_so_in_its_json():
    rows = [row("a", "win", 1.5, (1.4, 1.6))]
    built = report.build_report(rows, settings=SETTINGS, previous=report.build_report(rows, settings=SETTINGS))
    assert built["vanished"] == [] and "missing" not in report.summary_line(built)
    assert "vanished" not in report.build_report(rows, settings=SETTINGS)  # not compared: no such list
