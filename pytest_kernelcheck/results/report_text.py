"""The lines and table rows a report is shown as, in the terminal and in markdown."""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

from ..speed import stats
from ..speed.timer_resolution import UNRESOLVED_PREFIX
from ..visible_text import visible
from . import per_gpu, reading
from .records import ComparisonRecord, LastRun, ThroughputRecord, TournamentRecord
from .report_record import ABReport, RunEnvironment
from .unmatched import NEW_ROW


def _markdown_cell(cell: str) -> str:
    """A table cell's text: ``|`` escaped, and line breaks (which would end the row mid-cell) as spaces."""
    return _one_line(cell).replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(_markdown_cell(cell) for cell in row) + " |" for row in rows])


def fenced(lines: Sequence[str]) -> list[str]:
    """``lines`` as a markdown code block, shown as written: an error's own lines starting with ``-``, ``#`` or
    ``|`` would otherwise become a list, a heading or a table. The fence is longer than any run of backticks in
    them, so none closes it early."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, *lines, fence]


def history_lines(report: ABReport | Mapping[str, Any], history: Sequence[Any]) -> list[str]:
    """Markdown table of each comparison's speedup in earlier saved runs (oldest first) and in this run; rows are
    matched by test and name, as with --kernel-ab-compare, and ``-`` marks a run without the comparison.

    >>> from pytest_kernelcheck.results.build import build_report
    >>> from pytest_kernelcheck.results.storage import RunSpeedups
    >>> now = build_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
    ...                      "speedup": 1.5, "ci": [1.4, 1.6], "p_value": 0.001}], settings={})
    >>> history_lines(now, [RunSpeedups("0001_base", {("t.py::a", "a"): 1.25})])[2:]
    ['| comparison | shape | 0001_base | this run |', '|---|---|---|---|', '| a |  | 1.250x | 1.500x |']
    """
    typed = as_report(report)
    header = ["comparison", "shape", *(run.label for run in history), "this run"]
    lines = [f"## Speedup history: last {len(history)} saved run(s) of this machine", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in typed.comparisons:
        earlier = [run.speedups.get((record.nodeid, record.name)) for run in history]
        cells = [visible(record.name), format_shape(record.shape),
                 *(f"{_speedup(value)}x" if value is not None else "-" for value in earlier),
                 f"{_speedup(record.speedup)}x" if record.speedup is not None else "-"]
        lines.append("| " + " | ".join(_markdown_cell(cell) for cell in cells) + " |")
    return lines


def as_report(report: ABReport | Mapping[str, Any]) -> ABReport:
    """The typed report, from the JSON dict that :func:`build_report` and :func:`load_report` return."""
    return report if isinstance(report, ABReport) else ABReport.from_json(report)


def format_shape(shape: Any) -> str:
    """Compact text for a shape dict.

    >>> format_shape({"B": 1, "S": 128})
    'B=1 S=128'
    """
    if not shape:
        return ""
    if isinstance(shape, dict):
        return visible(" ".join(f"{k}={v}" for k, v in shape.items()))
    return visible(shape)


def _number(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def _speedup(value: Any) -> str:
    """A speedup or interval end: 3 decimals, or more where 3 would print it on 1 or across it
    (:func:`stats.decimals`), so that no printed number contradicts the verdict beside it."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return stats.decimals(float(value))


def _interval(ci: Any) -> str:
    low, high = ci or (None, None)
    return f"[{_speedup(low) if low is not None else '0'}, {_speedup(high) if high is not None else 'inf'}]"


SPEEDUP_HEADER = "paired speedup [CI]"


def table_rows(report: ABReport | Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and text rows of the comparison table (the terminal and markdown share them).

    The speedup is the paired one the verdict rests on (:mod:`.reading`); the p-value the one the verdict used,
    with the raw one in brackets; a ``notes`` column, when some row has notes, points at :func:`note_lines`.

    >>> from pytest_kernelcheck.results.build import build_report
    >>> table_rows(build_report([{"kind": "comparison", "name": "a", "verdict": "tie", "speedup": 1.0,
    ...                           "ci": [0.99, 1.01], "p_value": 0.5, "p_value_raw": 0.05}], settings={}))[1]
    [['a', '', '-', '-', '1.000x [0.990, 1.010]', '0.5 [0.05]', 'tie', '-']]
    """
    typed = as_report(report)
    rated = any(record.candidate_throughput is not None for record in typed.comparisons)
    header = ["comparison", "shape", "cand ms", "base ms", SPEEDUP_HEADER, reading.P_HEADER, "verdict", "method"]
    if rated:  # only when some comparison gave flops= or bytes=: the table stays narrow otherwise
        header[4:4] = ["TFLOP/s cand/base", "GB/s cand/base"]
    if typed.compared_with_last_run:
        header.append("vs last run")
    numbered = _numbered_notes(typed)
    noted = any(numbered)
    if noted:  # beside the verdict they qualify, so the columns after it stay where they were
        header.insert(header.index("verdict") + 1, "notes")
    rows = []
    for record, notes in zip(typed.comparisons, numbered):
        verdict = str(record.verdict)
        if record.run.throttled:
            verdict += " (throttled)"
        if record.verdict_bh and record.verdict_bh != record.verdict:
            verdict += " (not after BH)"
        if any(note.startswith(UNRESOLVED_PREFIX) for note in record.run.notes):  # the note says which timer
            verdict += " (below timer resolution)"
        if record.modes_disagree:  # the modes table below gives each mode's verdict
            verdict += " (modes disagree)"
        if reading.medians_disagree(record):  # the note says why, and what steadies the times
            verdict += " (medians disagree)"
        if record.failed:
            speed = _shorten(_one_line(str(record.error)), 40)
        else:
            speed = f"{_speedup(record.speedup)}x {_interval(record.ci)}"
        row = [
            visible(record.name),
            format_shape(record.shape),
            _number(record.candidate_ms, ".4g"),
            _number(record.baseline_ms, ".4g"),
            speed,
            reading.p_cell(record),
            verdict,
            str(record.run.method or "-"),
        ]
        if rated:
            candidate, baseline = record.candidate_throughput, record.baseline_throughput
            row[4:4] = [rate_pair(candidate, baseline, "tflops"), rate_pair(candidate, baseline, "gbps")]
        if typed.compared_with_last_run:
            row.append(_vs_last(record.vs_last))
        if noted:
            row.insert(header.index("notes"), ",".join(f"[{number}]" for number, _ in notes) or "-")
        rows.append(row)
    return header, rows


def _numbered_notes(typed: ABReport) -> list[list[tuple[int, str]]]:
    """Per comparison, its notes (:func:`reading.row_notes`) numbered across the table, from 1."""
    numbered, count = [], 0
    threads = (typed.environment or {}).get("cpu_threads")
    for record in typed.comparisons:
        notes = []
        for note in reading.row_notes(record, threads):
            count += 1
            notes.append((count, note))
        numbered.append(notes)
    return numbered


def note_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """The legend of the p column, then the numbered notes the table's ``notes`` column points at; why a row's
    medians disagree with its paired speedup, and what steadies noisy times, is said here.

    >>> from pytest_kernelcheck.results.build import build_report
    >>> row = {"kind": "comparison", "name": "a", "verdict": "inconclusive", "speedup": 1.086, "ci": [0.135, 3.561],
    ...        "p_value": 1.0, "p_value_raw": 0.36, "candidate_ms": 1.681, "baseline_ms": 0.7972,
    ...        "method": "cpu-clock"}
    >>> note_lines(build_report([row], settings={}))[1]  # doctest: +ELLIPSIS
    '[1] a: the medians (candidate 1.681 ms, baseline 0.7972 ms) give 0.474x but the paired speedup, ...'
    """
    typed = as_report(report)
    if not typed.comparisons:
        return []
    lines = [reading.P_LEGEND]
    for record, notes in zip(typed.comparisons, _numbered_notes(typed)):
        lines += [f"[{number}] {visible(record.name)}: {note}" for number, note in notes]
    return lines


def rate_pair(candidate: ThroughputRecord | None, baseline: ThroughputRecord | None, unit: str) -> str:
    """``candidate / baseline`` rates (``unit``: ``tflops`` or ``gbps``), with the candidate's share of the
    ceiling; ``-`` where a rate is missing.

    >>> rate_pair(ThroughputRecord(tflops=412.0, tflops_pct=55.2), ThroughputRecord(tflops=380.0), "tflops")
    '412 / 380 (55% of ceiling)'
    """
    def rate(record: ThroughputRecord | None) -> Any:
        return None if record is None else getattr(record, unit)

    if rate(candidate) is None:
        return "-"
    share = getattr(candidate, f"{unit}_pct")
    return (f"{_number(rate(candidate), '.3g')} / {_number(rate(baseline), '.3g')}"
            + (f" ({share:.0f}% of ceiling)" if share is not None else ""))


def measurement_rows(report: ABReport | Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and text rows of the measurements table (``kernel_ab.measure``), terminal and markdown alike.

    >>> from pytest_kernelcheck.results.build import build_report
    >>> measurement_rows(build_report([{"kind": "measurement", "name": "mm", "median_ms": 1.5,
    ...     "ci_ms": [1.4, 1.6], "n_samples": 40, "method": "events", "throughput": {"tflops": 700.0}}],
    ...     settings={}))[1]
    [['mm', '', '1.5', '[1.4, 1.6]', '40', '700', '-', 'events']]
    """
    header = ["measurement", "shape", "median ms", "CI ms", "n", "TFLOP/s", "GB/s", "method"]
    rows = []
    for record in as_report(report).measurements:
        if record.failed:
            rows.append([visible(record.name), format_shape(record.shape), _shorten(_one_line(str(record.error)), 40),
                         "-", "-", "-", "-", "-"])
            continue
        rates = record.throughput or ThroughputRecord()
        low, high = record.ci_ms
        interval = f"[{_number(low, '.4g') if low is not None else '0'}, " \
                   f"{_number(high, '.4g') if high is not None else 'inf'}]"
        rows.append([
            visible(record.name), format_shape(record.shape), _number(record.median_ms, ".4g"), interval,
            str(record.n_samples), _rate(rates.tflops, rates.tflops_pct), _rate(rates.gbps, rates.gbps_pct),
            str(record.run.method or "-"),
        ])
    return header, rows


def _rate(value: float | None, share: float | None) -> str:
    return _number(value, ".3g") + (f" ({share:.0f}% of ceiling)" if share is not None else "")


def ceiling_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """What the environment block says of ceilings, one line each; none when no comparison gave work.

    >>> from pytest_kernelcheck.results.records import SCHEMA
    >>> ceiling_lines({"schema": SCHEMA, "comparisons": [], "environment": {"ceilings": {"enabled": False}}})
    ['Ceilings: not measured (--kernel-ab-ceilings off)']
    """
    environment = RunEnvironment.from_json(as_report(report).environment)
    if environment.ceilings_enabled is None:
        return []
    if not environment.ceilings_enabled:
        return ["Ceilings: not measured (--kernel-ab-ceilings off)"]
    if not environment.ceilings:
        return ["Ceilings: none measured"]
    lines = []
    for ceiling in environment.ceilings:
        parts = []
        for value, unit, method in ((ceiling.tflops, "TFLOP/s", ceiling.flops_method),
                                    (ceiling.gbps, "GB/s", ceiling.bandwidth_method)):
            if value is not None:
                parts.append(f"{value:.4g} {unit}" + (f" ({method})" if method else ""))
        if ceiling.reason:
            parts.append(ceiling.reason)
        lines.append(f"Ceiling of {ceiling.device}, {ceiling.dtype or 'no dtype'}: {'; '.join(parts)}")
    return lines


def _vs_last(vs_last: LastRun | None) -> str:
    if vs_last is None:
        return NEW_ROW
    text = f"was {_speedup(vs_last.speedup)}x {vs_last.verdict}"
    notes = [note for note in (vs_last.timing_change, vs_last.baseline_change) if note]
    if notes:
        text += f" ({'; '.join(notes)})"
    return f"REGRESSION: {text}; {vs_last.reason}" if vs_last.regression else text


def _one_line(text: str) -> str:
    """``text`` with its line breaks as spaces: a table row is one line, and errors often span several (the full
    message follows the table)."""
    return " ".join(text.splitlines())


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def error_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """Full error messages of failed comparisons (the table shows them shortened).

    >>> from pytest_kernelcheck.results.build import build_report
    >>> error_lines(build_report([{"kind": "comparison", "name": "a", "verdict": "error", "error": "boom"}],
    ...                          settings={}))
    ['error in a: boom']
    """
    return [f"error in {visible(r.name)}: {r.error}" for r in as_report(report).comparisons if r.failed]


def gpu_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """Per-GPU totals and verdict-disagreement warnings of a run spread over GPUs (:mod:`.per_gpu`); none for a
    run whose rows name no GPU.

    >>> from pytest_kernelcheck.results.build import build_report
    >>> gpu = {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-b"}
    >>> gpu_lines(build_report([{"kind": "comparison", "name": "a", "verdict": "tie", "elapsed_s": 1.5,
    ...                          "gpu": gpu}], settings={}))
    ['Per GPU (1):', 'GPU 1 (NVIDIA H200, GPU-b): 1 comparison(s) (1 tie), 1.5 s timing']
    """
    typed = as_report(report)
    rows = [*typed.comparisons, *typed.tournaments, *typed.measurements]
    return per_gpu.summary_lines(rows) + per_gpu.disagreement_lines(typed.comparisons)


def machine_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """The warning of a report compared with a run measured on another machine; none otherwise.

    >>> from pytest_kernelcheck.results.records import SCHEMA
    >>> machine_lines({"schema": SCHEMA, "comparisons": [], "machine_differences": ["GPU NVIDIA H100 then, none now"]})
    ['WARNING: the earlier run was measured on another machine (GPU NVIDIA H100 then, none now): its speedups may \
differ for the machine, not the code']
    """
    differences = as_report(report).machine_differences
    if not differences:
        return []
    return [f"WARNING: the earlier run was measured on another machine ({'; '.join(differences)}): its speedups "
            f"may differ for the machine, not the code"]


def summary_line(report: ABReport | Mapping[str, Any]) -> str:
    """The totals in one line: verdicts, geometric-mean speedup, what survives Benjamini-Hochberg, regressions.

    >>> from pytest_kernelcheck.results.build import build_report
    >>> summary_line(build_report([], settings={"alpha": 0.05}))
    '0 win, 0 loss, 0 tie, 0 inconclusive; no speedup measured, so no geometric mean; after Benjamini-Hochberg (FDR \
0.05): 0 win, 0 loss survive'
    """
    s = as_report(report).summary
    parts = [
        f"{s.win} win, {s.loss} loss, {s.tie} tie, {s.inconclusive} inconclusive"
        + (f", {s.error} error" if s.error else ""),
        # With no speedup measured there is no mean to print: "-x over 0" read as a number of its own.
        f"geometric-mean speedup {_number(s.geomean_speedup, '.3f')}x over {s.comparisons - s.error}"
        if s.geomean_speedup is not None else "no speedup measured, so no geometric mean",
        f"after Benjamini-Hochberg (FDR {s.bh_alpha:g}): {s.bh_win} win, {s.bh_loss} loss survive",
    ]
    if s.throttled:
        parts.append(f"{s.throttled} ran while the SM clock dropped below 90% (see clock in the JSON)")
    if s.regressions is not None:
        # Not the gate's count (its rules may judge this run alone, as `loss` does): the rows that moved.
        parts.append(f"vs last run: {len(s.regressions)} row(s) got slower (interval below the earlier one, or win "
                     f"to loss)")
        missing = len(as_report(report).vanished)
        if missing:
            parts.append(f"{missing} missing from this run")
    return "; ".join(parts)


def tournament_lines(record: TournamentRecord | Mapping[str, Any]) -> list[str]:
    """Text lines for one tournament record (or its error).

    >>> tournament_lines({"kind": "tournament", "name": "t", "verdict": "error", "error": "ValueError: no variants"})
    ['tournament t: error: ValueError: no variants']
    """
    if not isinstance(record, TournamentRecord):
        record = TournamentRecord.from_json(record)
    title = f"tournament {visible(record.name)}" + (f" ({format_shape(record.shape)})" if record.shape else "")
    if record.failed:
        return [f"{title}: error: {record.error}"]
    best = record.best
    ranking = []
    for variant in record.ranking:
        text = f"{visible(variant)} {_number(record.median_ms[variant], '.4g')} ms"
        rates = record.throughput.get(variant)
        if rates is not None:
            text += "".join(f", {_rate(value, share)} {unit}" for value, share, unit in (
                (rates.tflops, rates.tflops_pct, "TFLOP/s"), (rates.gbps, rates.gbps_pct, "GB/s")) if value is not None)
        pair = record.versus_best(variant)
        if pair is not None:
            speed = f"{_speedup(pair.speedup)}x {_interval(pair.ci)}"
            text += f" ({speed} slower, {pair.verdict} for {visible(best)})"
        ranking.append(text)
    return [
        f"{title}: best {visible(best)}; indistinguishable from best: "
        f"{', '.join(map(visible, record.indistinguishable_from_best))}",
        "  ranking: " + " > ".join(ranking),
        f"  {record.n_rounds} rounds, {record.run.method}",
    ]
