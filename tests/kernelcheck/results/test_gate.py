"""The A/B gate's rules: parsing expressions, and each rule judged against built reports."""
from __future__ import annotations

import re

import numpy as np
import pytest

from pytest_kernelcheck.results import gate, report

SETTINGS = {"alpha": 0.05, "margin": 0.02}


def row(name, verdict, speedup, ci, p=0.001):
    return {"kind": "comparison", "nodeid": f"t.py::{name}", "name": name, "shape": {"S": 128},
            "verdict": verdict, "speedup": speedup, "ci": list(ci), "p_value": p}


def built(now, earlier=None):
    previous = report.build_report(earlier, settings=SETTINGS) if earlier is not None else None
    return report.build_report(now, settings=SETTINGS, previous=previous)


@pytest.mark.parametrize(
    "text, rule",
    [
        ("verdict", gate.VerdictRule()),
        ("  LOSS ", gate.LossRule()),
        ("speedup:5%", gate.SpeedupRule(5.0, "speedup:5%")),
        ("speedup:2.5%", gate.SpeedupRule(2.5, "speedup:2.5%")),
        ("speedup:0%", gate.SpeedupRule(0.0, "speedup:0%")),
    ],
)
def test_expressions_parse_into_typed_rules(text, rule):
    assert gate.parse_rule(text) == rule


@pytest.mark.parametrize("text", ["verdicts", "speedup", "speedup:5", "speedup:-5%", "speedup:x%", ""])
def test_bad_expressions_name_the_option_and_the_accepted_forms(text):
    with pytest.raises(gate.GateError, match=r"--kernel-ab-compare-fail / kernel_ab_compare_fail: .* is not a rule; "
                                             r"accepted: 'verdict', 'speedup:X%'.* or 'loss'"):
        gate.parse_rule(text)


def test_parse_rules_skips_blank_lines_and_duplicates():
    assert gate.parse_rules(["verdict", "", "  ", "verdict", "loss"]) == (gate.VerdictRule(), gate.LossRule())
    # One percentage written two ways is one rule: it was kept twice, and each regression listed twice.
    assert gate.parse_rules(["speedup:5%", "speedup:5.0%", "SPEEDUP:05%"]) == (gate.SpeedupRule(5.0, "speedup:5%"),)


@pytest.mark.parametrize("text", ["speedup:100%", "speedup:250%"])
def test_a_speedup_rule_that_could_never_fire_says_why(text):
    with pytest.raises(gate.GateError, match=r"X must be below 100, since no speedup falls by .*% or more"):
        gate.parse_rule(text)


def test_rules_that_need_an_earlier_run_refuse_to_run_without_one():
    gate.check_rules([gate.LossRule()], comparing=False)
    gate.check_rules([gate.VerdictRule(), gate.SpeedupRule(5, "speedup:5%")], comparing=True)
    with pytest.raises(gate.GateError, match="speedup:5% needs --kernel-ab-compare"):
        gate.check_rules([gate.SpeedupRule(5, "speedup:5%")], comparing=False)


@pytest.mark.parametrize(
    "earlier, now, worse",
    [
        ("win", "tie", True), ("win", "inconclusive", True), ("win", "loss", True), ("win", "win", False),
        ("tie", "loss", True), ("inconclusive", "loss", True), ("tie", "inconclusive", False),
        ("inconclusive", "tie", False), ("loss", "tie", False), ("loss", "win", False),
        ("error", "loss", False), ("win", "error", False), (None, "loss", False),
    ],
)
def test_verdict_order(earlier, now, worse):
    assert gate.verdict_got_worse(earlier, now) is worse


def test_verdict_rule_fails_only_rows_whose_verdict_got_worse():
    now = [row("a", "tie", 1.0, (0.99, 1.01), 0.9), row("b", "win", 1.2, (1.1, 1.3)),
           row("c", "loss", 0.8, (0.7, 0.9)), row("new", "loss", 0.5, (0.4, 0.6))]
    earlier = [row("a", "win", 1.2, (1.1, 1.3)), row("b", "win", 1.5, (1.4, 1.6)), row("c", "tie", 1.0, (0.99, 1.01))]
    found = gate.evaluate([gate.VerdictRule()], built(now, earlier))
    assert [(r.record.name, r.reason) for r in found] == [
        ("a", "verdict went from win to tie"), ("c", "verdict went from tie to loss")]
    assert found[0].earlier.speedup == 1.2 and found[0].rule == "verdict"


def test_speedup_rule_fails_when_the_interval_lies_wholly_below_the_line():
    # Earlier speedup 2.0; with 5% the line is 1.9.
    now = [row("below", "win", 1.8, (1.7, 1.89)), row("touching", "win", 1.8, (1.7, 1.91)),
           row("unbounded", "inconclusive", 1.0, (0.5, None), 0.5)]
    earlier = [row(name, "win", 2.0, (1.9, 2.1)) for name in ("below", "touching", "unbounded")]
    found = gate.evaluate([gate.parse_rule("speedup:5%")], built(now, earlier))
    assert [r.record.name for r in found] == ["below"]
    assert "more than 5% below the earlier speedup (1.890 < 1.900)" in found[0].reason


def test_loss_rule_needs_no_earlier_run_and_ignores_errors():
    now = [row("lost", "loss", 0.5, (0.4, 0.6)), row("won", "win", 2.0, (1.9, 2.1)),
           {"kind": "comparison", "nodeid": "t.py::x", "name": "x", "verdict": "error", "error": "boom"}]
    found = gate.evaluate([gate.LossRule()], built(now))
    assert [r.record.name for r in found] == ["lost"] and found[0].earlier is None


def test_regression_lines_show_both_runs():
    now, earlier = [row("a", "loss", 0.5, (0.4, 0.6))], [row("a", "win", 2.0, (1.9, 2.1))]
    found = gate.evaluate([gate.VerdictRule(), gate.LossRule()], built(now, earlier))
    assert gate.regression_lines(found) == [
        "t.py::a / a (S=128) [verdict]: verdict went from win to loss",
        "  was 2.000x [1.900, 2.100] win",
        "  now 0.500x [0.400, 0.600] loss",
        "t.py::a / a (S=128) [loss]: this run's verdict is loss",
        "  was 2.000x [1.900, 2.100] win",
        "  now 0.500x [0.400, 0.600] loss",
    ]


def test_rows_timed_differently_say_so_beside_the_earlier_run_and_in_the_regression_lines():
    # A sample's fixed cost weighs more with fewer calls per sample, so a method change alone can move a short
    # call's speedup: the report and the gate name both methods and how to time both runs alike.
    earlier = [row("a", "win", 1.203, (1.134, 1.361)) | {"method": "events-batched x7"},
               row("b", "win", 1.5, (1.4, 1.6)) | {"method": "events"}]
    now = [row("a", "win", 1.053, (1.012, 1.092)) | {"method": "events"},
           row("b", "win", 1.5, (1.4, 1.6)) | {"method": "events"}]
    report_now = built(now, earlier)
    changes = [r["vs_last"]["timing_change"] for r in report_now["comparisons"]]
    assert changes == ["timed by events-batched x7 then, by events now", None]
    found = gate.evaluate([gate.SpeedupRule(5.0, "speedup:5%")], report_now)
    assert gate.regression_lines(found) == [
        "t.py::a / a (S=128) [speedup:5%]: interval wholly more than 5% below the earlier speedup "
        "(1.092 < 1.143)",
        "  was 1.203x [1.134, 1.361] win",
        "  timed by events-batched x7 then, by events now: pin --kernel-ab-calls-per-sample to time both alike",
        "  now 1.053x [1.012, 1.092] win",
    ]
    header, rows = report.table_rows(report_now)  # the terminal's and the markdown's table
    assert header[-1] == "vs last run"
    assert rows[0][-1] == ("REGRESSION: was 1.203x win (timed by events-batched x7 then, by events now); interval "
                           "now below the last run's (1.092 < 1.134)")
    assert rows[1][-1] == "was 1.500x win"


def test_a_baseline_whose_time_moved_says_so_beside_the_earlier_run_and_in_the_regression_lines():
    # A baseline is usually unchanged code, so when its own time per call moved by more than BASELINE_MOVE the
    # machine (load, clocks, host) or the baseline changed, and the speedup's change may not be the candidate's.
    earlier = [row("a", "win", 1.4, (1.3, 1.5)) | {"baseline_ms": 0.3292},
               row("b", "win", 1.5, (1.4, 1.6)) | {"baseline_ms": 0.500},
               row("c", "win", 1.5, (1.4, 1.6)) | {"baseline_ms": 0.600},
               row("d", "win", 1.5, (1.4, 1.6))]
    now = [row("a", "win", 1.1, (1.05, 1.15)) | {"baseline_ms": 0.6128},
           row("b", "win", 1.5, (1.4, 1.6)) | {"baseline_ms": 0.570},  # 1.14x: inside the allowed move
           row("c", "win", 1.5, (1.4, 1.6)) | {"baseline_ms": 0.500},  # 0.83x: faster by more than it
           row("d", "win", 1.5, (1.4, 1.6)) | {"baseline_ms": 0.500}]  # no earlier time to compare with
    report_now = built(now, earlier)
    changes = [r["vs_last"]["baseline_change"] for r in report_now["comparisons"]]
    assert changes == ["baseline 0.3292 ms a call then, 0.6128 ms now (1.86x)", None,
                       "baseline 0.6 ms a call then, 0.5 ms now (0.83x)", None]
    found = gate.evaluate([gate.SpeedupRule(5.0, "speedup:5%")], report_now)
    assert gate.regression_lines(found) == [
        "t.py::a / a (S=128) [speedup:5%]: interval wholly more than 5% below the earlier speedup (1.150 < 1.330)",
        "  was 1.400x [1.300, 1.500] win",
        "  baseline 0.3292 ms a call then, 0.6128 ms now (1.86x): the machine or the baseline changed; compare both "
        "commits in one session to tell",
        "  now 1.100x [1.050, 1.150] win",
    ]
    _, rows = report.table_rows(report_now)
    assert rows[0][-1] == ("REGRESSION: was 1.400x win (baseline 0.3292 ms a call then, 0.6128 ms now (1.86x)); "
                           "interval now below the last run's (1.150 < 1.300)")
    assert rows[2][-1] == "was 1.500x win (baseline 0.6 ms a call then, 0.5 ms now (0.83x))"


def test_regression_lines_warn_when_the_earlier_run_was_of_another_machine():
    # A regression against another machine's run may be the machine's, so the gate's message says how it differs;
    # the loss rule judges this run alone and needs no such warning.
    now, earlier = [row("a", "loss", 0.5, (0.4, 0.6))], [row("a", "win", 2.0, (1.9, 2.1))]
    differences = ["GPU NVIDIA H100 then, NVIDIA H200 now", "torch 2.4.0 then, 2.5.0 now"]
    found = gate.evaluate([gate.VerdictRule()], built(now, earlier))
    assert gate.regression_lines(found, differences)[-1] == (
        "WARNING: compared with a run of another machine (GPU NVIDIA H100 then, NVIDIA H200 now; torch 2.4.0 then, "
        "2.5.0 now): a regression may be the machine's, not the code's")
    assert not any(line.startswith("WARNING") for line in gate.regression_lines(found))
    lost = gate.evaluate([gate.LossRule()], built(now))
    assert not any(line.startswith("WARNING") for line in gate.regression_lines(lost, differences))


def test_regression_lines_never_print_a_number_that_contradicts_the_finding():
    # Rounded to 3 decimals, a loss whose interval ends at 0.9996 read "now 1.000x [0.98, 1.000] loss", a win from
    # 1.0004 read "[1.000, ...] win", and an interval end a hair below the speedup rule's line read "(1.900 < 1.900)".
    rng = np.random.default_rng()
    for _ in range(50):
        gap, spread = float(rng.uniform(1e-7, 4.9e-4)), float(rng.uniform(1e-5, 0.05))
        earlier_speedup = float(rng.uniform(1.1, 3.0))
        line = earlier_speedup * 0.95
        now = [row("a", "loss", 1 - gap * 1.01, (1 - gap - spread, 1 - gap)),
               row("b", "win", line * (1 - gap * 1.01), (line * (1 - gap) - spread, line * (1 - gap)))]
        earlier = [row("a", "win", 1 + gap * 1.01, (1 + gap, 1 + gap + spread)),
                   row("b", "win", earlier_speedup, (earlier_speedup - spread, earlier_speedup + spread))]
        found = gate.evaluate([gate.VerdictRule(), gate.parse_rule("speedup:5%")], built(now, earlier))
        lines = gate.regression_lines(found)
        was = [line for line in lines if line.startswith("  was") and line.endswith("win")][0]
        now_line = [line for line in lines if line.startswith("  now") and line.endswith("loss")][0]
        speedup, low, _high = (float(n) for n in re.findall(r"\d+\.\d+", was))
        assert speedup > 1 and low > 1, was
        speedup, _low, high = (float(n) for n in re.findall(r"\d+\.\d+", now_line))
        assert speedup < 1 and high < 1, now_line
        reason = [r.reason for r in found if r.record.name == "b"][0]
        below, above = (float(n) for n in re.findall(r"\((\S+) < (\S+)\)", reason)[0])
        assert below < above, reason


@pytest.mark.parametrize("expression", ["speedup:٣%", "speedup:３%", "speedup:³%", "speedup:1٫5%"])
def test_a_speedup_rule_takes_ascii_digits_only(expression):
    # Python's \d matches every script's digits: "speedup:٣%" was read as a 3% rule.
    with pytest.raises(gate.GateError, match="speedup:X%"):
        gate.parse_rule(expression)
