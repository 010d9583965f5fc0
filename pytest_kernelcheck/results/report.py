"""A/B report: summary statistics, terminal table, JSON, markdown, plot, and comparison with an earlier report.

In the run the report is typed (:class:`.report_record.ABReport`, built by :func:`assemble_report`); it becomes
JSON only when written (:func:`write_json`, :func:`write_all`) and is typed again when an earlier report is read
(:func:`read_report`). Every writer here takes the typed report or its JSON form (:func:`build_report`,
:func:`load_report`), which users and tests call.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

# Re-exported below: report is where readers of a report find building, reading, writing and showing it.
from . import modes_text, plots
from .build import assemble_report, build_report
from .environment import environment_info
from .plots import PLOT_MISSING_NOTE
from .records import SCHEMA, SCHEMA_VERSION
from .report_files import (
    ReportError,
    check_writable,
    companion_paths,
    load_report,
    plot_paths,
    read_report,
    write_json,
    write_text,
)
from .report_record import ABReport, RunEnvironment
from .report_text import (
    as_report,
    ceiling_lines,
    error_lines,
    fenced,
    format_shape,
    gpu_lines,
    history_lines,
    machine_lines,
    markdown_table,
    measurement_rows,
    note_lines,
    rate_pair,
    summary_line,
    table_rows,
    tournament_lines,
)
from .unmatched import vanished_lines

__all__ = [
    "ABReport", "PLOT_MISSING_NOTE", "SCHEMA", "SCHEMA_VERSION", "VERDICT_MARKUP", "ProgressWriter",
    "ReportError", "Written", "assemble_report", "build_report", "ceiling_lines", "check_writable",
    "companion_paths", "environment_info", "error_lines", "format_shape", "gpu_lines", "history_lines",
    "load_report", "machine_lines", "measurement_rows", "note_lines", "plot_paths", "rate_pair", "read_report",
    "summary_line", "table_rows", "tournament_lines", "write_all", "write_json", "write_markdown", "write_plot",
    "write_terminal",
]

VERDICT_MARKUP = {
    "win": {"green": True},
    "loss": {"red": True},
    "tie": {"yellow": True},
    "inconclusive": {"yellow": True},
    "error": {"red": True, "bold": True},
}


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_all` wrote, in order, and a note on what it could not (matplotlib missing)."""

    paths: tuple[Path, ...]
    note: str | None = None


def write_all(report: ABReport | Mapping[str, Any], json_path: str | Path, history: Sequence[Any] = ()) -> Written:
    """Write the report (typed, or its JSON form) as JSON and beside it the speedup plot, the roofline (comparisons and measurements that
    gave flops and bytes), the trend plot (given ``history``: :class:`pytest_kernelcheck.results.storage.RunSpeedups`,
    oldest first) and the markdown, which shows the history table and links the roofline and trend plots.

    Each file is replaced whole or not at all (see :func:`write_json`); the first that cannot be written raises
    ``ReportError`` naming its path and the OS error. Without matplotlib the plots are left out and the note
    says so.

    >>> write_all(build_report([], settings={}), "/dev/null/ab.json")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.report_files.ReportError: cannot write report '/dev/null/ab.json': [Errno 17] File exists: '/dev/null'
    """
    report = as_report(report)  # typed once: the JSON file, the plots and the markdown all read this
    markdown_path, plot_path = companion_paths(json_path)
    extra = plot_paths(json_path)
    write_json(report, json_path)
    written = [Path(json_path)]
    note = write_plot(report, plot_path)
    if note is None and plot_path.exists():
        written.append(plot_path)
    images: dict[str, str] = {}
    for kind, write in (("roofline", lambda path: plots.write_roofline(report, path)),
                        ("trend", lambda path: plots.write_trend(report, history, path))):
        outcome = write(extra[kind])
        if outcome is True:
            images[kind] = extra[kind].name
            written.append(extra[kind])
        elif outcome:
            note = outcome
    write_markdown(report, markdown_path, history, images)
    written.insert(1, markdown_path)
    return Written(tuple(written), note)


class ProgressWriter:
    """Rewrites a run's JSON report while the run goes, so that a run killed before its end (SIGKILL at a CI time
    limit, a lost machine, a hung interrupt) leaves at the report's path what it had finished, marked
    ``"finished": false``. The finished report replaces it at the end, as always.

    A rewrite serialises every record so far, so it is done at most every ``min_interval`` seconds and never more
    often than keeps its own cost under ``max_share`` of the run's time (each write is timed); the first record is
    written at once. A rewrite that fails, for any reason, stops the rewrites and never the run (``error`` says
    why, and the run's summary shows it): the report at the end is still tried, and fails the run as it would
    have. ``clock`` is injectable for tests.

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "ab.json")
    >>> ticks = iter([0.0, 0.0, 1.0, 12.0, 12.0, 12.0])  # what the clock reads at each call
    >>> writer = ProgressWriter(path, clock=lambda: next(ticks))
    >>> so_far = lambda: build_report([], settings={}, finished=False)
    >>> writer.maybe_write(so_far), writer.maybe_write(so_far), writer.maybe_write(so_far)
    (True, False, True)
    >>> json.load(open(path))["finished"]
    False
    """

    def __init__(self, path: str | Path, *, min_interval: float = 10.0, max_share: float = 0.05,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.path = Path(path)
        self.min_interval = min_interval
        self.max_share = max_share
        self.clock = clock or time.monotonic
        self.last_write: float | None = None  # clock() when the last write ended
        self.last_cost = 0.0  # seconds the last write took
        self.writes = 0
        self.error: str | None = None

    def due(self) -> bool:
        """Whether a rewrite is due now."""
        if self.error is not None:
            return False
        if self.last_write is None:
            return True
        wait = max(self.min_interval, self.last_cost / self.max_share)
        return self.clock() - self.last_write >= wait

    def maybe_write(self, build: Callable[[], ABReport | Mapping[str, Any]]) -> bool:
        """Write ``build()`` (a report with ``finished=False``) when a rewrite is due; whether it wrote."""
        if not self.due():
            return False
        start = self.clock()
        try:
            write_json(build(), self.path)
        except Exception as exc:  # a rewrite must never stop the run it is there to protect
            self.error = str(exc) if isinstance(exc, ReportError) else f"{type(exc).__name__}: {exc}"
            return False
        self.last_write = self.clock()
        self.last_cost = self.last_write - start
        self.writes += 1
        return True


def write_markdown(report: ABReport | Mapping[str, Any], path: str | Path, history: Sequence[Any] = (),
                   images: Mapping[str, str] | None = None) -> None:
    """Write the comparison table, totals, tournaments, measurements, ceilings and (given saved runs) the speedup
    history as markdown; ``images`` (``roofline``, ``trend``: file names beside ``path``) are linked."""
    typed = as_report(report)
    images = images or {}
    lines = ["# Kernel A/B comparisons", ""]
    lines += markdown_table(*table_rows(typed))
    errors = [line for error in error_lines(typed) for line in error.splitlines()]
    lines += [""] + (fenced(errors) if errors else []) + ["", summary_line(typed), ""]
    if note_lines(typed):  # the p column's legend, then the rows' notes (why medians disagree, noise advice)
        legend, *notes = note_lines(typed)
        lines += [legend, ""] + ([f"- {note}" for note in notes] + [""] if notes else [])
    if typed.vanished:  # the earlier run's rows this run lacks: a list whose names are shown as written
        heading, *rows = vanished_lines(typed.vanished)
        lines += [heading, ""] + fenced([row.strip() for row in rows]) + [""]
    if machine_lines(typed):
        lines += machine_lines(typed) + [""]
    if gpu_lines(typed):
        lines += [line if line.startswith(("Per GPU", "WARNING")) else f"- {line}" for line in gpu_lines(typed)]
        lines.append("")
    lines += modes_text.markdown_lines(typed)  # per-mode rows, when some comparison ran in several modes
    for tournament in typed.tournaments:
        lines += tournament_lines(tournament) + [""]
    if typed.measurements:
        lines += ["## Measurements (one function timed alone)", ""] + markdown_table(*measurement_rows(typed))
        lines.append("")
    if ceiling_lines(typed):
        lines += ceiling_lines(typed) + [""]
    if "roofline" in images:
        lines += [f"![Roofline: achieved TFLOP/s against arithmetic intensity]({images['roofline']})", ""]
    if history:
        lines += history_lines(typed, history) + [""]
        if "trend" in images:
            lines += [f"![Speedup with its interval per saved run]({images['trend']})", ""]
    if typed.environment:
        environment = RunEnvironment.from_json(typed.environment)
        commit = environment.commit_id
        lines.append(
            f"Run {environment.date} on {environment.hostname}; GPU: "
            f"{', '.join(environment.gpu.devices) or 'none'}; packages: "
            + ", ".join(f"{k} {v}" for k, v in environment.packages.items() if v)
            + (f"; commit {commit}" if commit else "")
        )
    write_text(path, "\n".join(lines) + "\n")


def write_plot(report: ABReport | Mapping[str, Any], path: str | Path) -> str | None:
    """Plot the paired speedup of every comparison with its interval (:func:`plots.write_intervals`); returns a
    note instead when matplotlib is missing."""
    outcome = plots.write_intervals(report, path)
    return outcome if isinstance(outcome, str) else None


def write_terminal(
    terminal: Any, report: ABReport | Mapping[str, Any], notes: Iterable[str] = (), errors: Iterable[str] = ()
) -> None:
    """Write the A/B section to pytest's terminal reporter, verdicts coloured where the terminal allows.

    ``notes`` end the section; ``errors`` (a report file not written, say) follow them in red.
    """
    typed = as_report(report)
    terminal.write_sep("=", "kernel A/B comparisons")
    header, rows = table_rows(typed)
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        terminal.write_line("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        verdict_column = header.index("verdict")
        for record, row in zip(typed.comparisons, rows):
            for index, (cell, width) in enumerate(zip(row, widths)):
                text = cell.ljust(width) + ("  " if index < len(row) - 1 else "")
                markup = VERDICT_MARKUP.get(str(record.verdict), {}) if index == verdict_column else {}
                if header[index] == "vs last run" and cell.startswith("REGRESSION"):
                    markup = {"red": True, "bold": True}
                terminal.write(text, **markup)
            terminal.write_line("")
        for line in error_lines(typed):
            terminal.write_line(line, red=True)
        terminal.write_line(summary_line(typed))
        for line in note_lines(typed):
            terminal.write_line(line, **({} if line.startswith("p adj") else {"yellow": True}))
    if typed.vanished:
        for line in vanished_lines(typed.vanished):
            terminal.write_line(line, yellow=True, bold=not line.startswith(" "))
    for line in machine_lines(typed):
        terminal.write_line(line, yellow=True, bold=True)
    for line in gpu_lines(typed):
        terminal.write_line(line, **({"yellow": True, "bold": True} if line.startswith("WARNING") else {}))
    for line in modes_text.terminal_lines(typed):  # per-mode rows, when some comparison ran in several modes
        terminal.write_line(line, **({"purple": True, "bold": True} if line.startswith("MODES DISAGREE") else {}))
    for tournament in typed.tournaments:
        for line in tournament_lines(tournament):
            terminal.write_line(line)
    header, rows = measurement_rows(typed)
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for row in [header, *rows]:
            terminal.write_line("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for line in ceiling_lines(typed):
        terminal.write_line(line)
    for note in notes:
        terminal.write_line(note)
    for error in errors:
        terminal.write_line(error, red=True, bold=True)


