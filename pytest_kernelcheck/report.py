"""A/B report: summary statistics, terminal table, JSON, markdown, plot, and comparison with an earlier report.

The report is a plain JSON dict (see :func:`build_report`) so that it can be written, read back and compared
without the objects that produced it; its input records are the JSON records of comparisons and tournaments.
Everything here reads both through the typed records of :mod:`pytest_kernelcheck.records`.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as _datetime
import json
import math
import os
import platform
import re
import secrets
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Sequence

from . import per_gpu, stats
from .timer_resolution import UNRESOLVED_PREFIX
from .visible_text import visible
from .records import (  # SCHEMA and SCHEMA_VERSION are re-exported: readers of reports know them from here
    BASELINE_MOVE,
    SCHEMA,
    SCHEMA_VERSION,
    ABReport,
    CeilingRecord,
    ComparisonRecord,
    DamagedReport,
    GpuInfo,
    LastRun,
    MeasurementRecord,
    NotAReport,
    ReportSummary,
    RunEnvironment,
    ThroughputRecord,
    TournamentRecord,
    record_from_json,
)

VERDICT_MARKUP = {
    "win": {"green": True},
    "loss": {"red": True},
    "tie": {"yellow": True},
    "inconclusive": {"yellow": True},
    "error": {"red": True, "bold": True},
}
PLOT_MISSING_NOTE = "install pytest-kernelcheck[plot] for the plot"


class ReportError(Exception):
    """An earlier report cannot be read, or a report cannot be written; the message names the path."""


def build_report(
    records: Sequence[Mapping[str, Any]],
    *,
    settings: Mapping[str, Any],
    environment: Mapping[str, Any] | None = None,
    previous: Mapping[str, Any] | None = None,
    finished: bool = True,
) -> dict[str, Any]:
    """Assemble the report from JSON records: comparisons with Benjamini-Hochberg columns, tournaments, totals,
    and regressions against ``previous`` (an earlier report, as :func:`load_report` returns it); where
    ``previous`` was measured on another machine than ``environment`` says (:func:`storage.machine_differences`),
    the report's ``machine_differences`` says how, and :func:`machine_lines` warns of it.
    ``finished=False`` marks the report of a run still going (see :class:`ProgressWriter`).

    >>> r = build_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
    ...                    "speedup": 1.2, "ci": [1.1, 1.3], "p_value": 0.001}], settings={"alpha": 0.05})
    >>> r["summary"]["win"], r["comparisons"][0]["verdict_bh"]
    (1, 'win')
    """
    alpha = float(settings.get("alpha", 0.05))
    typed = [record_from_json(record) for record in records]
    comparisons = sorted((r for r in typed if isinstance(r, ComparisonRecord)), key=lambda r: r.nodeid)
    tournaments = sorted((r for r in typed if isinstance(r, TournamentRecord)), key=lambda r: r.nodeid)
    measurements = sorted((r for r in typed if isinstance(r, MeasurementRecord)), key=lambda r: r.nodeid)
    comparisons = _with_benjamini_hochberg(comparisons, alpha)
    regressions = None
    machine_differences: tuple[str, ...] = ()
    vanished: tuple[ComparisonRecord, ...] = ()
    if previous is not None:
        from .storage import machine_differences as differences
        from .unmatched import vanished_rows

        earlier = ABReport.from_json(previous)
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
    )
    report = ABReport(
        created=_now(),
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
    return report.to_json()


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


def environment_info() -> dict[str, Any]:
    """Where the numbers came from: host, versions, GPU, date and git commit.

    Commit details reuse pytest-benchmark's helper (the same fields its saved runs carry). Its machine-info
    helper is not used: it starts py-cpuinfo in a subprocess, which took long enough on a GPU virtual machine
    that a time-limited run was killed while writing its report; the fields that matter are read directly.
    """
    from importlib import metadata

    packages: dict[str, str | None] = {}
    for package in ("torch", "triton", "numpy", "scipy", "pytest", "pytest-kernelcheck"):
        try:
            packages[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            packages[package] = None
    machine_info = commit_info = machine_info_error = None
    try:
        from pytest_benchmark.utils import get_commit_info

        machine_info = {
            "node": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
            "system": platform.system(), "release": platform.release(), "cpu_count": os.cpu_count(),
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
        }
        commit_info = get_commit_info()
    except Exception as exc:  # environment details must never cost the report itself
        machine_info_error = f"{type(exc).__name__}: {exc}"
    environment = RunEnvironment(
        date=_now(),
        hostname=platform.node(),
        python=platform.python_version(),
        packages=packages,
        machine_info=machine_info,
        commit_info=commit_info,
        machine_info_error=machine_info_error,
        gpu=_gpu_info(),
        cpu_model=_cpu_model(),
    )
    return environment.to_json()


def _cpu_model() -> str | None:
    """The CPU's marketing name: /proc/cpuinfo on Linux (platform.processor() there is only the architecture)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:  # not Linux: fall through to what platform knows
        pass
    return platform.processor() or None


def _gpu_info() -> GpuInfo:
    torch = sys.modules.get("torch")  # only describe a GPU the tests actually used torch for
    if torch is None or not torch.cuda.is_available():
        return GpuInfo(available=False)
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:
        driver = f"unavailable ({type(exc).__name__})"
    try:
        cudnn_version = torch.backends.cudnn.version()
        cudnn = None if cudnn_version is None else str(cudnn_version)
    except Exception as exc:  # a broken cuDNN install must not cost the report
        cudnn = f"unavailable ({type(exc).__name__})"
    return GpuInfo(
        available=True,
        devices=tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
        cuda=torch.version.cuda,
        driver=driver,
        cudnn=cudnn,
    )


def _now() -> str:
    return _datetime.datetime.now(_datetime.timezone.utc).isoformat(timespec="seconds")


def companion_paths(json_path: str | Path) -> tuple[Path, Path]:
    """Markdown and PNG paths beside the JSON report (same stem).

    >>> [p.name for p in companion_paths("out/ab.json")]
    ['ab.md', 'ab.png']
    """
    path = Path(json_path)
    return path.with_suffix(".md"), path.with_suffix(".png")


def plot_paths(json_path: str | Path) -> dict[str, Path]:
    """The other plots beside the JSON report: the roofline, and the speedup trend over saved runs.

    >>> {kind: path.name for kind, path in plot_paths("out/ab.json").items()}
    {'roofline': 'ab_roofline.png', 'trend': 'ab_trend.png'}
    """
    path = Path(json_path)
    return {kind: path.with_name(f"{path.stem}_{kind}.png") for kind in ("roofline", "trend")}


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_all` wrote, in order, and a note on what it could not (matplotlib missing)."""

    paths: tuple[Path, ...]
    note: str | None = None


def check_writable(json_path: str | Path) -> None:
    """Raise ``ReportError`` unless the report (and its companions) can be written there.

    Missing directories are fine (they are created when the report is written) as long as the nearest existing
    one is a writable directory.
    """
    import os

    path = Path(json_path)
    if path.is_dir():
        raise ReportError(f"report path {str(path)!r} is a directory; give a file name such as ab.json")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ReportError(f"cannot write report {str(path)!r}: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ReportError(f"cannot write report {str(path)!r}: permission denied")


def load_report(path: str | Path) -> dict[str, Any]:
    """Read an earlier JSON report, with a clear error when it is missing or not an A/B report.

    >>> load_report("/nonexistent/ab.json")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.report.ReportError: earlier report '/nonexistent/ab.json' does not exist

    A report holding a field no run writes is refused, naming the file, the row and the field (such a row would be
    shown but never judged, or crash the run at its end): ``earlier report 'ab.json': comparisons[0]
    ('fused'): field 'verdict': 'WIN' is refused; accepted: 'win', 'loss', 'tie', 'inconclusive', 'error'``.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReportError(f"earlier report {str(path)!r} does not exist") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise ReportError(f"earlier report {str(path)!r} cannot be read as JSON: {exc}") from None
    from .report_schema import checked_report

    try:
        checked_report(data)  # the check every reader of a report makes: each field's JSON type, then its value
    except NotAReport as exc:
        raise ReportError(f"{str(path)!r} is not a kernel A/B report ({exc})") from None
    except DamagedReport as exc:
        raise ReportError(f"earlier report {str(path)!r}: {exc}") from None
    return data


def write_all(report: dict[str, Any], json_path: str | Path, history: Sequence[Any] = ()) -> Written:
    """Write the JSON report and beside it the speedup plot, the roofline (comparisons and measurements that
    gave flops and bytes), the trend plot (given ``history``: :class:`pytest_kernelcheck.storage.RunSpeedups`,
    oldest first) and the markdown, which shows the history table and links the roofline and trend plots.

    Each file is replaced whole or not at all (see :func:`write_json`); the first that cannot be written raises
    ``ReportError`` naming its path and the OS error. Without matplotlib the plots are left out and the note
    says so.

    >>> write_all(build_report([], settings={}), "/dev/null/ab.json")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.report.ReportError: cannot write report '/dev/null/ab.json': [Errno 17] File exists: '/dev/null'
    """
    from . import plots

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

    def maybe_write(self, build: Callable[[], dict[str, Any]]) -> bool:
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


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as standard JSON (non-finite numbers become null).

    Like every report file it goes to a temporary file beside ``path`` that then replaces ``path`` in one step,
    so a failed or killed write leaves the previous file as it was, never half a file.
    """
    _write(path, json.dumps(_finite(report), indent=1, default=str, allow_nan=False) + "\n")


def _markdown_cell(cell: str) -> str:
    """A table cell's text: ``|`` escaped, and line breaks (which would end the row mid-cell) as spaces."""
    return _one_line(cell).replace("|", "\\|")


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(_markdown_cell(cell) for cell in row) + " |" for row in rows])


def _fenced(lines: Sequence[str]) -> list[str]:
    """``lines`` as a markdown code block, shown as written: an error's own lines starting with ``-``, ``#`` or
    ``|`` would otherwise become a list, a heading or a table. The fence is longer than any run of backticks in
    them, so none closes it early."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, *lines, fence]


def write_markdown(report: Mapping[str, Any], path: str | Path, history: Sequence[Any] = (),
                   images: Mapping[str, str] | None = None) -> None:
    """Write the comparison table, totals, tournaments, measurements, ceilings and (given saved runs) the speedup
    history as markdown; ``images`` (``roofline``, ``trend``: file names beside ``path``) are linked."""
    typed = _as_report(report)
    images = images or {}
    lines = ["# Kernel A/B comparisons", ""]
    lines += _markdown_table(*table_rows(typed))
    errors = [line for error in error_lines(typed) for line in error.splitlines()]
    lines += [""] + (_fenced(errors) if errors else []) + ["", summary_line(typed), ""]
    if typed.vanished:  # the earlier run's rows this run lacks: a list whose names are shown as written
        from .unmatched import vanished_lines

        heading, *rows = vanished_lines(typed.vanished)
        lines += [heading, ""] + _fenced([row.strip() for row in rows]) + [""]
    if machine_lines(typed):
        lines += machine_lines(typed) + [""]
    if gpu_lines(typed):
        lines += [line if line.startswith(("Per GPU", "WARNING")) else f"- {line}" for line in gpu_lines(typed)]
        lines.append("")
    for tournament in typed.tournaments:
        lines += tournament_lines(tournament) + [""]
    if typed.measurements:
        lines += ["## Measurements (one function timed alone)", ""] + _markdown_table(*measurement_rows(typed))
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
    _write(path, "\n".join(lines) + "\n")


def history_lines(report: ABReport | Mapping[str, Any], history: Sequence[Any]) -> list[str]:
    """Markdown table of each comparison's speedup in earlier saved runs (oldest first) and in this run; rows are
    matched by test and name, as with --kernel-ab-compare, and ``-`` marks a run without the comparison.

    >>> from pytest_kernelcheck.storage import RunSpeedups
    >>> now = build_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
    ...                      "speedup": 1.5, "ci": [1.4, 1.6], "p_value": 0.001}], settings={})
    >>> history_lines(now, [RunSpeedups("0001_base", {("t.py::a", "a"): 1.25})])[2:]
    ['| comparison | shape | 0001_base | this run |', '|---|---|---|---|', '| a |  | 1.250x | 1.500x |']
    """
    typed = _as_report(report)
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


def write_plot(report: Mapping[str, Any], path: str | Path) -> str | None:
    """Plot speedup per comparison with its interval; returns a note instead when matplotlib is missing."""
    typed = _as_report(report)
    comparisons = [r for r in typed.comparisons if r.speedup]
    if not comparisons:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.patches
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return PLOT_MISSING_NOTE
    colours = {"win": "tab:green", "loss": "tab:red", "tie": "tab:olive", "inconclusive": "tab:gray"}
    figure, axes = plt.subplots(figsize=(max(6.0, 0.45 * len(comparisons) + 2), 4.5))
    margin = float(typed.settings.get("margin", 0.02))
    axes.axhspan(1 / (1 + margin), 1 + margin, color="0.9", label=f"tie margin ±{margin:.0%}")
    axes.axhline(1.0, color="black", linewidth=0.8)
    for x, record in enumerate(comparisons):
        speedup = float(record.speedup)
        low, high = record.ci
        low = speedup if low is None else float(low)
        high = speedup if high is None else float(high)
        axes.errorbar(
            x, speedup, yerr=[[speedup - low], [high - speedup]], fmt="o", capsize=3,
            color=colours.get(record.verdict, "black"),
        )
    axes.set_xticks(range(len(comparisons)))
    # parse_math off: matplotlib reads text between two $ as TeX, so a name such as "cost $\\foo$" raised out of the
    # plot (and the run's end), and "$5 vs $6" was drawn as math; names are drawn as written.
    axes.set_xticklabels([_label(r) for r in comparisons], rotation=60, ha="right", fontsize=7, parse_math=False)
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}x"))
    axes.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}x"))
    axes.set_ylabel("speedup (baseline time / candidate time)")
    axes.set_title("Kernel A/B: speedup with interval, per comparison")
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=c, label=v) for v, c in colours.items()]
    handles.append(matplotlib.patches.Patch(color="0.9", label=f"tie margin ±{margin:.0%}"))
    axes.legend(handles=handles, fontsize=7, loc="best")
    figure.tight_layout()
    # The temporary file has no telling suffix, so the format comes from the target's (savefig's own rule).
    image_format = Path(path).suffix.lstrip(".").lower() or "png"
    try:
        _write_atomically(path, lambda handle: figure.savefig(handle, format=image_format, dpi=120), "plot")
    finally:
        plt.close(figure)
    return None


def _as_report(report: ABReport | Mapping[str, Any]) -> ABReport:
    """The typed report, from the JSON dict that :func:`build_report` and :func:`load_report` return."""
    return report if isinstance(report, ABReport) else ABReport.from_json(report)


def _label(record: ComparisonRecord) -> str:
    shape, name = format_shape(record.shape), visible(record.name)  # matplotlib cannot draw a lone surrogate
    return name + (f" ({shape})" if shape and shape not in name else "")


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


def table_rows(report: ABReport | Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and text rows of the comparison table (the terminal and markdown share them).

    >>> table_rows(build_report([{"kind": "comparison", "name": "a", "verdict": "tie", "speedup": 1.0,
    ...                           "ci": [0.99, 1.01], "p_value": 0.5}], settings={}))[1]
    [['a', '', '-', '-', '1.000x [0.990, 1.010]', '0.5', 'tie', '-']]
    """
    typed = _as_report(report)
    rated = any(record.candidate_throughput is not None for record in typed.comparisons)
    header = ["comparison", "shape", "cand ms", "base ms", "speedup [CI]", "p", "verdict", "method"]
    if rated:  # only when some comparison gave flops= or bytes=: the table stays narrow otherwise
        header[4:4] = ["TFLOP/s cand/base", "GB/s cand/base"]
    if typed.compared_with_last_run:
        header.append("vs last run")
    rows = []
    for record in typed.comparisons:
        verdict = str(record.verdict)
        if record.run.throttled:
            verdict += " (throttled)"
        if record.verdict_bh and record.verdict_bh != record.verdict:
            verdict += " (not after BH)"
        if any(note.startswith(UNRESOLVED_PREFIX) for note in record.run.notes):  # the note says which timer
            verdict += " (below timer resolution)"
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
            _number(record.p_value, ".2g"),
            verdict,
            str(record.run.method or "-"),
        ]
        if rated:
            candidate, baseline = record.candidate_throughput, record.baseline_throughput
            row[4:4] = [rate_pair(candidate, baseline, "tflops"), rate_pair(candidate, baseline, "gbps")]
        if typed.compared_with_last_run:
            row.append(_vs_last(record.vs_last))
        rows.append(row)
    return header, rows


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

    >>> measurement_rows(build_report([{"kind": "measurement", "name": "mm", "median_ms": 1.5,
    ...     "ci_ms": [1.4, 1.6], "n_samples": 40, "method": "events", "throughput": {"tflops": 700.0}}],
    ...     settings={}))[1]
    [['mm', '', '1.5', '[1.4, 1.6]', '40', '700', '-', 'events']]
    """
    header = ["measurement", "shape", "median ms", "CI ms", "n", "TFLOP/s", "GB/s", "method"]
    rows = []
    for record in _as_report(report).measurements:
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

    >>> ceiling_lines({"schema": SCHEMA, "comparisons": [], "environment": {"ceilings": {"enabled": False}}})
    ['Ceilings: not measured (--kernel-ab-ceilings off)']
    """
    environment = RunEnvironment.from_json(_as_report(report).environment)
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
        from .unmatched import NEW_ROW

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

    >>> error_lines(build_report([{"kind": "comparison", "name": "a", "verdict": "error", "error": "boom"}],
    ...                          settings={}))
    ['error in a: boom']
    """
    return [f"error in {visible(r.name)}: {r.error}" for r in _as_report(report).comparisons if r.failed]


def gpu_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """Per-GPU totals and verdict-disagreement warnings of a run spread over GPUs (:mod:`.per_gpu`); none for a
    run whose rows name no GPU.

    >>> gpu = {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-b"}
    >>> gpu_lines(build_report([{"kind": "comparison", "name": "a", "verdict": "tie", "elapsed_s": 1.5,
    ...                          "gpu": gpu}], settings={}))
    ['Per GPU (1):', 'GPU 1 (NVIDIA H200, GPU-b): 1 comparison(s) (1 tie), 1.5 s timing']
    """
    typed = _as_report(report)
    rows = [*typed.comparisons, *typed.tournaments, *typed.measurements]
    return per_gpu.summary_lines(rows) + per_gpu.disagreement_lines(typed.comparisons)


def machine_lines(report: ABReport | Mapping[str, Any]) -> list[str]:
    """The warning of a report compared with a run measured on another machine; none otherwise.

    >>> machine_lines({"schema": SCHEMA, "comparisons": [], "machine_differences": ["GPU NVIDIA H100 then, none now"]})
    ['WARNING: the earlier run was measured on another machine (GPU NVIDIA H100 then, none now): its speedups may \
differ for the machine, not the code']
    """
    differences = _as_report(report).machine_differences
    if not differences:
        return []
    return [f"WARNING: the earlier run was measured on another machine ({'; '.join(differences)}): its speedups "
            f"may differ for the machine, not the code"]


def summary_line(report: ABReport | Mapping[str, Any]) -> str:
    """The totals in one line: verdicts, geometric-mean speedup, what survives Benjamini-Hochberg, regressions.

    >>> summary_line(build_report([], settings={"alpha": 0.05}))
    '0 win, 0 loss, 0 tie, 0 inconclusive; geometric-mean speedup -x over 0; after Benjamini-Hochberg (FDR 0.05): 0 win, 0 loss survive'
    """
    s = _as_report(report).summary
    parts = [
        f"{s.win} win, {s.loss} loss, {s.tie} tie, {s.inconclusive} inconclusive"
        + (f", {s.error} error" if s.error else ""),
        f"geometric-mean speedup {_number(s.geomean_speedup, '.3f')}x over {s.comparisons - s.error}",
        f"after Benjamini-Hochberg (FDR {s.bh_alpha:g}): {s.bh_win} win, {s.bh_loss} loss survive",
    ]
    if s.throttled:
        parts.append(f"{s.throttled} ran while the SM clock dropped below 90% (see clock in the JSON)")
    if s.regressions is not None:
        parts.append(f"{len(s.regressions)} regression(s) vs last run")
        missing = len(_as_report(report).vanished)
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


def write_terminal(
    terminal: Any, report: Mapping[str, Any], notes: Iterable[str] = (), errors: Iterable[str] = ()
) -> None:
    """Write the A/B section to pytest's terminal reporter, verdicts coloured where the terminal allows.

    ``notes`` end the section; ``errors`` (a report file not written, say) follow them in red.
    """
    typed = _as_report(report)
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
    if typed.vanished:
        from .unmatched import vanished_lines

        for line in vanished_lines(typed.vanished):
            terminal.write_line(line, yellow=True, bold=not line.startswith(" "))
    for line in machine_lines(typed):
        terminal.write_line(line, yellow=True, bold=True)
    for line in gpu_lines(typed):
        terminal.write_line(line, **({"yellow": True, "bold": True} if line.startswith("WARNING") else {}))
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


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _write(path: str | Path, text: str) -> None:
    # Encoded up front: an unencodable name fails here, before any file is touched, instead of halfway.
    data = text.encode("utf-8", errors="backslashreplace")
    _write_atomically(path, lambda handle: handle.write(data), "report")


def _write_atomically(path: str | Path, write: Callable[[BinaryIO], Any], what: str) -> None:
    """Have ``write`` fill a temporary file in ``path``'s folder, then move it over ``path`` with ``os.replace``.

    The move is atomic within one file system, so readers and later runs see the old file or the new one,
    whatever happens mid-write (full disk, a killed run). The temporary file is removed when anything fails; an
    ``OSError`` becomes ``ReportError`` naming ``path`` and the error.
    """
    target = Path(path)
    temporary: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # os.open with 0o666 leaves the mode to the umask, as for any new file (mkstemp would make it 0600).
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())  # the data is on disk before the name points at it
        os.replace(temporary, target)
        temporary = None
    except OSError as exc:
        raise ReportError(f"cannot write {what} {str(path)!r}: {exc}") from None
    finally:
        if temporary is not None:
            try:
                temporary.unlink()
            except OSError:  # never created, or already gone: nothing to clean up
                pass
