"""The report's second and third figures: the roofline of the rated comparisons, and the speedup trend over saved
runs. (The first, speedup per comparison, is :func:`pytest_kernelcheck.results.report.write_plot`.)

Each writer returns True when it wrote its file, None when the report has nothing for it, or a note when
matplotlib is missing; files are written atomically, as every report file.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..visible_text import shortened, visible
from .records import CeilingRecord
from .report_files import write_atomically
from .report_record import ABReport, RunEnvironment

TREND_PANELS = 48  # small multiples beyond this make an unreadable figure; the rest are in the markdown table

# pytest-kernelcheck is not on the package index: the hint names what is (matplotlib), and the extra of a clone.
PLOT_MISSING_NOTE = 'matplotlib is not installed: pip install matplotlib (in a clone: pip install -e ".[plot]")'


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(figure: Any, path: str | Path) -> None:
    plt = _pyplot()
    try:
        write_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=110), "plot")
    finally:
        plt.close(figure)


def roofline_points(report: ABReport | Mapping[str, Any]) -> list[tuple[str, float, float]]:
    """(label, FLOPs per byte, achieved TFLOP/s) of every comparison side, tournament variant and measurement
    that gave both flops and bytes and has a rate.

    >>> from pytest_kernelcheck.results.report import build_report
    >>> r = build_report([{"kind": "measurement", "name": "mm", "median_ms": 1.0, "n_samples": 20,
    ...                    "throughput": {"flops": 2e12, "bytes": 1e9, "tflops": 2000.0}}], settings={})
    >>> roofline_points(r)
    [('mm', 2000.0, 2000.0)]
    """
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    points = []

    def add(label: str, rates: Any) -> None:
        if rates is not None and rates.intensity is not None and rates.tflops:
            points.append((label, rates.intensity, rates.tflops))

    for record in typed.comparisons:
        add(f"{visible(record.name)} (candidate)", record.candidate_throughput)
        add(f"{visible(record.name)} (baseline)", record.baseline_throughput)
    for tournament in typed.tournaments:
        for variant, rates in tournament.throughput.items():
            add(f"{visible(tournament.name)}: {visible(variant)}", rates)
    for measurement in typed.measurements:
        add(measurement.name, measurement.throughput)
    return points


def write_roofline(report: ABReport | Mapping[str, Any], path: str | Path) -> bool | str | None:
    """Arithmetic intensity (FLOPs per byte) against achieved TFLOP/s, log-log, with each measured ceiling: the
    flat FLOP/s roof of each dtype and the slanted bandwidth roof (TFLOP/s = GB/s x FLOPs per byte / 1000)."""
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    points = roofline_points(typed)
    if not points:
        return None
    plt = _pyplot()
    if plt is None:
        return PLOT_MISSING_NOTE
    ceilings: list[CeilingRecord] = list(RunEnvironment.from_json(typed.environment).ceilings)
    intensities = [x for _, x, _ in points]
    low, high = min(intensities) / 4, max(intensities) * 4
    figure, axes = plt.subplots(figsize=(8.0, 5.5))
    grid = [low * (high / low) ** (i / 199) for i in range(200)]
    for gbps in sorted({c.gbps for c in ceilings if c.gbps}):
        axes.plot(grid, [gbps * x / 1e3 for x in grid], color="tab:blue", linewidth=1,
                  label=f"bandwidth ceiling {gbps:.4g} GB/s")
    for ceiling in ceilings:
        if ceiling.tflops:
            axes.axhline(ceiling.tflops, color="tab:red", linewidth=1, linestyle="--",
                         label=f"{ceiling.dtype} matmul ceiling {ceiling.tflops:.4g} TFLOP/s")
    markers = {"(candidate)": ("o", "tab:green"), "(baseline)": ("s", "tab:gray")}
    for label, x, y in points:
        marker, colour = next((m for suffix, m in markers.items() if label.endswith(suffix)), ("^", "tab:purple"))
        axes.scatter([x], [y], marker=marker, color=colour, s=22, zorder=3)
    for suffix, (marker, colour) in [*markers.items(), ("tournament variant or measurement", ("^", "tab:purple"))]:
        axes.scatter([], [], marker=marker, color=colour, label=suffix.strip("()"))
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlim(low, high)
    tops = [y for _, _, y in points] + [c.tflops for c in ceilings if c.tflops]
    axes.set_ylim(min(y for _, _, y in points) / 4, max(tops) * 3)  # the bandwidth roof would stretch it far up
    axes.set_xlabel("arithmetic intensity (FLOPs per byte, as the tests count them)")
    axes.set_ylabel("achieved TFLOP/s (median time per call)")
    title = "Roofline: every rated comparison side, variant and measurement"
    if not ceilings or not any(c.tflops or c.gbps for c in ceilings):
        title += "\n(no ceilings measured in this run)"
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=7, loc="best")
    axes.grid(True, which="both", linewidth=0.3)
    figure.tight_layout()
    _save(figure, path)
    return True


def trend_series(report: ABReport | Mapping[str, Any], history: Sequence[Any]) -> list[tuple[str, list[tuple]]]:
    """Per comparison of this run found in at least one saved run: (label, [(run label, speedup, low, high)...])
    oldest first, this run last; interval ends may be None (unbounded or not saved).

    >>> from pytest_kernelcheck.results.report import build_report
    >>> from pytest_kernelcheck.results.storage import RunSpeedups
    >>> now = build_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
    ...                      "speedup": 1.5, "ci": [1.4, 1.6], "p_value": 0.001}], settings={})
    >>> trend_series(now, [RunSpeedups("0001_base", {("t.py::a", "a"): 1.2}, {("t.py::a", "a"): (1.1, 1.3)})])
    [('a', [('0001_base', 1.2, 1.1, 1.3), ('this run', 1.5, 1.4, 1.6)])]
    """
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    series = []
    for record in typed.comparisons:
        key = (record.nodeid, record.name)
        earlier = []
        for run in history:
            speedup = run.speedups.get(key)
            if speedup is not None:
                low, high = getattr(run, "intervals", {}).get(key, (None, None))
                earlier.append((run.label, speedup, low, high))
        if earlier and record.speedup is not None:
            # The shape on a second line: a parametrized test gives every panel the same name otherwise.
            # Escaped (visible_text): matplotlib cannot draw a lone surrogate, and a line break would split a name.
            label = visible(record.name) + (f"\n{visible(_shape_text(record.shape))}" if record.shape else "")
            series.append((label, earlier + [("this run", record.speedup, *record.ci)]))
    return series


def _shape_text(shape: Any) -> str:
    if isinstance(shape, dict):
        return " ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in shape.items())
    return str(shape)


def write_trend(report: ABReport | Mapping[str, Any], history: Sequence[Any], path: str | Path) -> bool | str | None:
    """Small multiples, one per comparison with saved history: speedup with its interval per saved run and this
    run, the line at 1 marking parity. At most ``TREND_PANELS`` panels, in report order."""
    series = trend_series(report, history)[:TREND_PANELS]
    if not series:
        return None
    plt = _pyplot()
    if plt is None:
        return PLOT_MISSING_NOTE
    columns = min(4, len(series))
    rows = math.ceil(len(series) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(3.4 * columns, 2.6 * rows), squeeze=False)
    for axes, (label, points) in zip(grid.flat, series):
        xs = list(range(len(points)))
        speedups = [p[1] for p in points]
        below = [s - (lo if lo is not None else s) for _, s, lo, _ in points]
        above = [(hi if hi is not None else s) - s for _, s, _, hi in points]
        axes.errorbar(xs, speedups, yerr=[below, above], fmt="o-", capsize=3, markersize=4, linewidth=1)
        axes.axhline(1.0, color="black", linewidth=0.6)
        axes.set_xticks(xs)
        axes.set_xticklabels([p[0].split("_")[0] for p in points], rotation=45, ha="right", fontsize=6)
        axes.tick_params(axis="y", labelsize=7)
        # parse_math off: names and shapes are drawn as written, never as TeX (see report.write_plot).
        # Cut with a digest of the whole line: two names that differ only after the cut keep titles of their own.
        axes.set_title("\n".join(shortened(line, 48) for line in label.split("\n")),
                       fontsize=7, parse_math=False)
    for axes in list(grid.flat)[len(series):]:
        axes.set_visible(False)
    figure.suptitle("Speedup (baseline / candidate) with its interval, per saved run of this machine", fontsize=9)
    figure.tight_layout()
    _save(figure, path)
    return True
