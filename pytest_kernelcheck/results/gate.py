"""The A/B gate: ``--kernel-ab-compare-fail`` expressions parsed into typed rules, and the regressions they find.

Three rules, each written as one expression:

- ``verdict``: a comparison's verdict got worse than in the compared run. Verdicts are ranked
  ``win`` (2) > ``tie`` = ``inconclusive`` (1) > ``loss`` (0), see :data:`VERDICT_RANK`; worse means a lower
  rank, so win -> tie, inconclusive or loss and tie or inconclusive -> loss fail, while tie <-> inconclusive
  does not (neither shows a difference, and which one a run reports depends on its sample size).
- ``speedup:X%``: this run's speedup interval lies wholly more than X percent below the earlier speedup,
  i.e. ``ci_high < earlier_speedup * (1 - X/100)``; a noisy run whose interval still reaches that line passes.
- ``loss``: any comparison of this run lost (needs no earlier run).

``verdict`` and ``speedup`` read each row's ``vs_last`` (the earlier row that :mod:`.report` matched by test and
name), so they need ``--kernel-ab-compare``; rows that raised (their test fails on its own) are not judged. What
the rules cannot pair is never passed in silence (:mod:`.unmatched`): a row of the compared run that this run lacks
(renamed, removed, deselected, skipped) and that had a verdict fails the gate as *missing* whenever a rule needs the
earlier run, and rows new in this run are listed as not checked. Everything here is a pure function of the built
report.

>>> rules = parse_rules(["verdict", "speedup:5%"])
>>> [rule.expression for rule in rules]
['verdict', 'speedup:5%']
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..speed.stats import decimals, decimals_apart
from ..visible_text import visible
from .records import ComparisonRecord, LastRun
from .report_record import ABReport
from .unmatched import new_rows

OPTION = "--kernel-ab-compare-fail"
ACCEPTED_FORMS = "'verdict', 'speedup:X%' (X a percentage such as 5 or 2.5) or 'loss'"

# Higher is better. tie and inconclusive rank alike: both say "no difference shown".
VERDICT_RANK: Mapping[str, int] = {"win": 2, "tie": 1, "inconclusive": 1, "loss": 0}

_SPEEDUP = re.compile(r"speedup:([0-9]+(?:\.[0-9]*)?|\.[0-9]+)%")


class GateError(ValueError):
    """An expression that is not one of the accepted forms; the message names the option and the forms."""


@dataclass(frozen=True)
class VerdictRule:
    """Fails a comparison whose verdict ranks below the earlier run's (see :data:`VERDICT_RANK`)."""

    expression: str = "verdict"
    needs_previous: bool = True


@dataclass(frozen=True)
class SpeedupRule:
    """Fails a comparison whose interval lies wholly more than ``percent`` below the earlier speedup."""

    percent: float
    expression: str
    needs_previous: bool = True


@dataclass(frozen=True)
class LossRule:
    """Fails on any loss in this run."""

    expression: str = "loss"
    needs_previous: bool = False


Rule = VerdictRule | SpeedupRule | LossRule


@dataclass(frozen=True)
class Regression:
    """One comparison that a rule failed: the row now, its earlier row (None for ``loss``) and why."""

    rule: str  # the expression as written; "missing" for an earlier row this run lacks
    record: ComparisonRecord  # for "missing": the earlier run's row
    earlier: LastRun | None
    reason: str
    missing: bool = False  # the compared run's row has no row in this run: the rules could not check it


def parse_rule(text: str) -> Rule:
    """The rule an expression stands for; ``GateError`` naming the option and the accepted forms otherwise.

    >>> parse_rule(" speedup:2.5% ")
    SpeedupRule(percent=2.5, expression='speedup:2.5%', needs_previous=True)
    >>> parse_rule("faster")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.gate.GateError: --kernel-ab-compare-fail / kernel_ab_compare_fail: 'faster' is not a rule; \
accepted: 'verdict', 'speedup:X%' (X a percentage such as 5 or 2.5) or 'loss'
    """
    expression = text.strip().lower()
    if expression == "verdict":
        return VerdictRule()
    if expression == "loss":
        return LossRule()
    match = _SPEEDUP.fullmatch(expression)
    if match:
        percent = float(match.group(1))
        if percent >= 100:  # the line would sit at or below zero, where no interval lies: the rule could never fire
            raise GateError(f"{OPTION} / kernel_ab_compare_fail: {text!r}: X must be below 100, since no speedup "
                            f"falls by {percent:g}% or more (speedups are above 0), so the rule could never fire")
        # Written one way (5.0% and 05% are 5%), so that one rule given twice is kept, and reported, once.
        return SpeedupRule(percent=percent, expression=f"speedup:{percent:g}%")
    raise GateError(f"{OPTION} / kernel_ab_compare_fail: {text!r} is not a rule; accepted: {ACCEPTED_FORMS}")


def parse_rules(texts: Iterable[str]) -> tuple[Rule, ...]:
    """Every expression's rule, blank ones skipped (an ini line list can hold them), duplicates once."""
    rules: list[Rule] = []
    for text in texts:
        if text.strip():
            rule = parse_rule(text)
            if rule not in rules:
                rules.append(rule)
    return tuple(rules)


def check_rules(rules: Sequence[Rule], *, comparing: bool) -> None:
    """``GateError`` when a rule needs an earlier run and none is compared with.

    >>> check_rules([LossRule()], comparing=False)
    >>> check_rules([VerdictRule()], comparing=False)
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.gate.GateError: --kernel-ab-compare-fail verdict needs --kernel-ab-compare (an earlier run)
    """
    for rule in rules:
        if rule.needs_previous and not comparing:
            raise GateError(f"{OPTION} {rule.expression} needs --kernel-ab-compare (an earlier run)")


def verdict_got_worse(earlier: str | None, now: str | None) -> bool:
    """Whether ``now`` ranks below ``earlier``; a verdict outside the ranking (an error) is never judged.

    >>> verdict_got_worse("win", "inconclusive"), verdict_got_worse("tie", "inconclusive")
    (True, False)
    """
    if earlier not in VERDICT_RANK or now not in VERDICT_RANK:
        return False
    return VERDICT_RANK[now] < VERDICT_RANK[earlier]


def _finding(rule: Rule, record: ComparisonRecord) -> str | None:
    """Why ``rule`` fails ``record``, or None when it passes."""
    if record.failed:
        return None
    if isinstance(rule, LossRule):
        return "this run's verdict is loss" if record.verdict == "loss" else None
    earlier = record.vs_last
    if earlier is None:  # new in this run: nothing to regress from
        return None
    if isinstance(rule, VerdictRule):
        if verdict_got_worse(earlier.verdict, record.verdict):
            return f"verdict went from {earlier.verdict} to {record.verdict}"
        return None
    high = record.ci[1]
    if earlier.speedup is None or high is None or not math.isfinite(float(high)):
        return None
    line = float(earlier.speedup) * (1 - rule.percent / 100)
    if float(high) < line:
        below, above = decimals_apart(float(high), line)  # "(1.175 < 1.175)" would contradict itself
        return f"interval wholly more than {rule.percent:g}% below the earlier speedup ({below} < {above})"
    return None


def evaluate(rules: Sequence[Rule], report: ABReport | Mapping[str, Any]) -> tuple[Regression, ...]:
    """Every (rule, comparison) pair that fails, in rule order then row order.

    >>> from .report import build_report
    >>> row = {"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "loss", "speedup": 0.5,
    ...        "ci": [0.4, 0.6], "p_value": 0.001}
    >>> [r.reason for r in evaluate([LossRule()], build_report([row], settings={}))]
    ["this run's verdict is loss"]
    """
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    found = []
    for rule in rules:
        for record in typed.comparisons:
            reason = _finding(rule, record)
            if reason is not None:
                found.append(Regression(rule=rule.expression, record=record, earlier=record.vs_last, reason=reason))
    return tuple(found) + _missing(rules, typed)


def _missing(rules: Sequence[Rule], typed: ABReport) -> tuple[Regression, ...]:
    """A finding for each earlier row with a verdict that this run lacks, when a rule needed the earlier run.

    An earlier row that raised had no verdict to keep, so its absence is listed in the report but not failed.
    """
    judging = [rule.expression for rule in rules if rule.needs_previous]
    if not judging:
        return ()
    reason = (f"in the compared run but not in this run (renamed, removed, deselected or skipped), so "
              f"{', '.join(judging)} could not check it; rerun it, or save a new run to compare with")
    return tuple(Regression(rule="missing", record=row, earlier=None, reason=reason, missing=True)
                 for row in typed.vanished if row.verdict in VERDICT_RANK)


def unchecked_lines(rules: Sequence[Rule], report: ABReport | Mapping[str, Any]) -> list[str]:
    """The line naming this run's rows that rules needing the earlier run could not check (no earlier row).

    >>> from .report import build_report
    >>> row = {"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "tie", "speedup": 1.0,
    ...        "ci": [0.99, 1.01], "p_value": 0.5}
    >>> unchecked_lines([VerdictRule()], build_report([row], settings={}, previous=build_report([], settings={})))
    ['1 comparison(s) new in this run, not checked by verdict (no earlier row): t.py::a / a']
    """
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    judging = [rule.expression for rule in rules if rule.needs_previous]
    fresh = new_rows(typed.comparisons) if typed.compared_with_last_run else ()
    if not judging or not fresh:
        return []
    names = "; ".join(f"{visible(row.nodeid or '-')} / {visible(row.name)}" for row in fresh)
    return [f"{len(fresh)} comparison(s) new in this run, not checked by {', '.join(judging)} (no earlier row): "
            f"{names}"]


# What each rule's findings are, for the gate's last line: its count must not read as another count of the
# report (the summary's "vs last run" rows), so each names what it counted.
_FOUND = {"verdict": "verdict worse than in the compared run", "loss": "a loss in this run",
          "missing": "in the compared run, missing from this run"}


def _what(rule: str) -> str:
    if rule.startswith("speedup:"):
        return f"speedup more than {rule.removeprefix('speedup:')} below the compared run's"
    return _FOUND.get(rule, rule)


def failing_line(regressions: Sequence[Regression]) -> str:
    """The gate's last line: how many findings of its rules fail the session, counted per rule, each saying what
    it counted.

    >>> r = Regression("loss", ComparisonRecord(name="a", verdict="loss"), None, "this run's verdict is loss")
    >>> failing_line([r])
    'the gate fails the session (--kernel-ab-compare-fail): 1 finding(s) of its rules: loss 1 (a loss in this run)'
    """
    counts: dict[str, int] = {}
    for regression in regressions:
        counts[regression.rule] = counts.get(regression.rule, 0) + 1
    found = "; ".join(f"{rule} {count} ({_what(rule)})" for rule, count in counts.items())
    return f"the gate fails the session ({OPTION}): {len(regressions)} finding(s) of its rules: {found}"


def _speed(speedup: float | None, ci: Sequence[float | None], verdict: str | None) -> str:
    # Enough decimals that no number reads as on or across 1 when it is not (stats.decimals): "[1.000, ...] win".
    def number(value: float | None, missing: str) -> str:
        return missing if value is None else decimals(float(value))

    low, high = ci
    value = "-" if speedup is None else decimals(float(speedup))
    return f"{value}x [{number(low, '0')}, {number(high, 'inf')}] {verdict}"


def regression_lines(regressions: Sequence[Regression], machine_differences: Sequence[str] = ()) -> list[str]:
    """Text of the ``kernelcheck: regressions`` section: one line per regression, then the earlier and this run;
    last, when the earlier run was measured on another machine (the report's ``machine_differences``), how (not
    for ``loss`` alone, which judges this run only).

    >>> r = Regression("loss", ComparisonRecord(name="a", verdict="loss", nodeid="t.py::a", speedup=0.5,
    ...                                         ci=(0.4, 0.6)), None, "this run's verdict is loss")
    >>> regression_lines([r])
    ["t.py::a / a [loss]: this run's verdict is loss", '  now 0.500x [0.400, 0.600] loss']
    >>> was = LastRun(speedup=1.2, ci=(1.1, 1.3), verdict="win", ratio=None, regression=True, reason=None)
    >>> regression_lines([Regression("verdict", r.record, was, "verdict went from win to loss")],
    ...                  ["GPU NVIDIA H100 then, none now"])[-1]
    "WARNING: compared with a run of another machine (GPU NVIDIA H100 then, none now): a regression may be the \
machine's, not the code's"
    """
    lines = []
    for regression in regressions:
        record = regression.record
        shape = " ".join(f"{k}={v}" for k, v in (record.shape or {}).items())
        title = f"{visible(record.nodeid or '-')} / {visible(record.name)}" + (f" ({visible(shape)})" if shape else "")
        lines.append(f"{title} [{regression.rule}]: {regression.reason}")
        if regression.missing:
            lines += [f"  was {_speed(record.speedup, record.ci, record.verdict)}", "  now not in this run"]
            continue
        if regression.earlier is not None:
            earlier = regression.earlier
            lines.append(f"  was {_speed(earlier.speedup, earlier.ci, earlier.verdict)}")
            if earlier.timing_change:  # the method may explain the change: pin --kernel-ab-calls-per-sample
                lines.append(f"  {earlier.timing_change}: pin --kernel-ab-calls-per-sample to time both alike")
            if earlier.baseline_change:  # the machine or the baseline may explain it: rerun both in one session
                lines.append(f"  {earlier.baseline_change}: the machine or the baseline changed; compare both "
                             f"commits in one session to tell")
        lines.append(f"  now {_speed(record.speedup, record.ci, record.verdict)}")
    if machine_differences and any(regression.earlier is not None for regression in regressions):
        lines.append(f"WARNING: compared with a run of another machine ({'; '.join(machine_differences)}): a "
                     f"regression may be the machine's, not the code's")
    return lines
