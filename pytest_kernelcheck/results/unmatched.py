"""Rows that ``--kernel-ab-compare`` could not pair: the earlier run's rows missing from this run, and this run's new ones.

Rows are paired by test id and comparison name (:func:`pytest_kernelcheck.results.report.build_report`). A comparison
renamed, removed, deselected (``-k``) or skipped in this run leaves its earlier row unpaired: it is *vanished*, and
this run's row under the new name is *new*. Neither can be judged against the other, so both are said aloud: the
report lists vanished rows (terminal, markdown and the JSON's ``vanished`` list), the table marks new rows "new (not
checked)", and :mod:`.gate` fails a vanished row that had a verdict whenever a rule needs the earlier run.

>>> from .records import ComparisonRecord
>>> earlier = [ComparisonRecord(name="fused", verdict="win", nodeid="t.py::a", speedup=1.3, ci=(1.2, 1.4))]
>>> [row.name for row in vanished_rows(earlier, [ComparisonRecord(name="fused_v2", verdict="tie", nodeid="t.py::a")])]
['fused']
"""
from __future__ import annotations

from typing import Sequence

from ..speed.stats import decimals
from ..visible_text import visible
from .records import ComparisonRecord

NEW_ROW = "new (not checked)"  # the "vs last run" cell of a row the earlier run did not have


def vanished_rows(earlier: Sequence[ComparisonRecord], now: Sequence[ComparisonRecord]) -> tuple[ComparisonRecord, ...]:
    """The earlier rows whose test id and name no row of this run has, in their earlier order.

    A key that this run has at least once is not vanished even if the earlier run held it more often (a rerun
    test writes a row per attempt): the comparison is still there, and its rows were paired.
    """
    present = {(row.nodeid, row.name) for row in now}
    return tuple(row for row in earlier if (row.nodeid, row.name) not in present)


def describe(row: ComparisonRecord) -> str:
    """One line naming a vanished row and what it measured then.

    >>> describe(ComparisonRecord(name="fused", verdict="win", nodeid="t.py::a", speedup=1.3, ci=(1.2, 1.4)))
    't.py::a / fused: was 1.300x [1.200, 1.400] win'
    """
    if row.failed:
        was = f"was an error ({row.error})" if row.error else "was an error"
    else:
        low, high = row.ci
        number = "-" if row.speedup is None else decimals(float(row.speedup))
        low_text = "0" if low is None else decimals(float(low))
        high_text = "inf" if high is None else decimals(float(high))
        was = f"was {number}x [{low_text}, {high_text}] {row.verdict}"
    return f"{visible(row.nodeid or '-')} / {visible(row.name)}: {visible(was)}"


def vanished_lines(vanished: Sequence[ComparisonRecord]) -> list[str]:
    """The report's lines on vanished rows: a heading line, then one line each; none when every row was paired.

    >>> vanished_lines([ComparisonRecord(name="a", verdict="tie", nodeid="t.py::a", speedup=1.0, ci=(0.99, 1.01))])
    ['1 comparison(s) of the compared run are missing from this run (renamed, removed, deselected or skipped; not \
checked):', '  t.py::a / a: was 1.000x [0.990, 1.010] tie']
    """
    if not vanished:
        return []
    return [f"{len(vanished)} comparison(s) of the compared run are missing from this run (renamed, removed, "
            f"deselected or skipped; not checked):", *(f"  {describe(row)}" for row in vanished)]


def new_rows(now: Sequence[ComparisonRecord]) -> tuple[ComparisonRecord, ...]:
    """This run's rows that had no earlier row (``vs_last`` empty and the row did not raise)."""
    return tuple(row for row in now if row.vs_last is None and not row.failed)
