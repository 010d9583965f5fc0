"""The measurement modes of a report as text and on the plot: one row per comparison and mode (time, speedup,
interval, verdict, host overhead per call), rows whose verdicts disagree across modes flagged.

Only comparisons measured in some mode other than throughput alone have mode rows (:class:`.records.ModeRecord`);
a report without them shows nothing here, as every earlier report did.

>>> from pytest_kernelcheck.results.build import build_report
>>> row = {"kind": "comparison", "name": "attn", "verdict": "win", "speedup": 1.03, "ci": [1.01, 1.05],
...        "mode": "throughput", "modes": [
...            {"mode": "throughput", "verdict": "win", "speedup": 1.03, "ci": [1.01, 1.05],
...             "candidate_ms": 0.14, "baseline_ms": 0.144, "p_value": 0.001},
...            {"mode": "latency", "verdict": "loss", "speedup": 0.885, "ci": [0.86, 0.9], "candidate_ms": 0.159,
...             "baseline_ms": 0.141, "candidate_device_ms": 0.12, "baseline_device_ms": 0.125, "p_value": 0.001},
...            {"mode": "graph", "unavailable": "not available on the CPU"}]}
>>> for line in terminal_lines(build_report([row], settings={})): print(line)
Measurement modes (verdict of each; the row's verdict is its first mode's; host overhead = latency - device time):
comparison  mode        cand ms  base ms  speedup [CI]           p      verdict  host us cand/base
attn        throughput  0.14     0.144    1.030x [1.010, 1.050]  0.001  win      -
attn        latency     0.159    0.141    0.885x [0.860, 0.900]  0.001  loss     39 / 16
attn        graph       -        -        -                      -      n/a      not available on the CPU
MODES DISAGREE in 1 comparison(s): attn (throughput win, latency loss); the mode that matches how the code is called decides
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..speed import stats
from .records import ComparisonRecord
from .report_record import ABReport

HEADER = ["comparison", "mode", "cand ms", "base ms", "speedup [CI]", "p", "verdict", "host us cand/base"]
TITLE = ("Measurement modes (verdict of each; the row's verdict is its first mode's; host overhead = latency - "
         "device time):")
DISAGREE_MARK = "modes disagree"


def _typed(report: ABReport | Mapping[str, Any]) -> ABReport:
    return report if isinstance(report, ABReport) else ABReport.from_json(report)


def _number(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _end(value: float | None) -> str:
    return "inf" if value is None else stats.decimals(value)


def mode_rows(report: ABReport | Mapping[str, Any]) -> list[list[str]]:
    """One text row per comparison and mode, for the comparisons with mode rows."""
    rows = []
    for record in _typed(report).comparisons:
        for mode in record.modes:
            if not mode.available:
                rows.append([record.name, mode.mode, "-", "-", "-", "-", "n/a", str(mode.unavailable)])
                continue
            speed = "-" if mode.speedup is None else (
                f"{stats.decimals(mode.speedup)}x [{_end(mode.ci[0])}, {_end(mode.ci[1])}]")
            host = "-"
            if mode.candidate_host_ms is not None and mode.baseline_host_ms is not None:
                host = f"{mode.candidate_host_ms * 1e3:.3g} / {mode.baseline_host_ms * 1e3:.3g}"
            rows.append([record.name, mode.mode, _number(mode.candidate_ms, ".4g"), _number(mode.baseline_ms, ".4g"),
                         speed, _number(mode.p_value, ".2g"), str(mode.verdict), host])
    return rows


def disagreeing(report: ABReport | Mapping[str, Any]) -> list[ComparisonRecord]:
    """The comparisons whose modes reached different decided verdicts."""
    return [record for record in _typed(report).comparisons if record.modes_disagree]


def _disagreement_line(records: Sequence[ComparisonRecord]) -> str:
    named = "; ".join(
        f"{r.name} (" + ", ".join(f"{m.mode} {m.verdict}" for m in r.modes if m.available) + ")" for r in records)
    return (f"MODES DISAGREE in {len(records)} comparison(s): {named}; the mode that matches how the code is called "
            "decides")


def terminal_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """The mode table as aligned text lines, and the line that names disagreeing rows; empty without mode rows."""
    rows = mode_rows(report)
    if not rows:
        return []
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    lines = [TITLE] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [HEADER, *rows]]
    flagged = disagreeing(report)
    return lines + ([_disagreement_line(flagged)] if flagged else [])


def markdown_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """The mode table in markdown, with the disagreement line in bold; empty without mode rows.

    >>> markdown_lines({"schema": "pytest-kernelcheck/ab-report", "comparisons": []})
    []
    """
    rows = mode_rows(report)
    if not rows:
        return []
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines = ["## Measurement modes", "", TITLE, "", "| " + " | ".join(HEADER) + " |",
             "|" + "---|" * len(HEADER)] + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    flagged = disagreeing(report)
    return lines + (["", f"**{_disagreement_line(flagged)}**"] if flagged else []) + [""]


def mark_plot(axes: Any, records: Sequence[ComparisonRecord], positions: Sequence[float], axis: str = "x") -> Any:
    """Mark on ``axes`` each record whose modes disagree, at its ``position`` along the comparisons' ``axis``
    ("x": one comparison per x position, speedups up the y axis; "y": one per row); returns the legend handle of
    the mark, or None when no record is marked."""
    flagged = [(p, r) for p, r in zip(positions, records) if r.modes_disagree and r.speedup]
    style = dict(marker="D", markersize=11, markerfacecolor="none", markeredgecolor="tab:purple",
                 markeredgewidth=1.8, linestyle="")
    for position, record in flagged:
        where = (position, float(record.speedup)) if axis == "x" else (float(record.speedup), position)
        axes.plot(*where, zorder=5, **style)
    if not flagged:
        return None
    import matplotlib.lines

    return matplotlib.lines.Line2D([], [], label=DISAGREE_MARK + " (see the modes table)", **style)
