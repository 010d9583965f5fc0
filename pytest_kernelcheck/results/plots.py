"""The report's figures: the paired speedup of every comparison with its interval (one row each, grouped by test),
the roofline of the rated comparisons with each point labelled, and the speedup trend over saved runs.

Each writer returns True when it wrote its file, None when the report has nothing for it, or a note when
matplotlib is missing; files are written atomically, as every report file.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..visible_text import shortened, visible
from . import reading
from .records import CeilingRecord, ComparisonRecord
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


# tie in blue: it must stand out on the tie band's yellow.
VERDICT_COLOURS = {"win": "tab:green", "loss": "tab:red", "tie": "tab:blue", "inconclusive": "tab:gray"}
LABEL_WIDTH = 90  # characters of a row's label; a longer one is cut with a digest of the whole (visible_text)
ROW_INCHES = 0.26  # height of one row of the interval plot


def row_label(record: ComparisonRecord) -> str:
    """A row's label: the comparison's name and its shape, escaped and cut to ``LABEL_WIDTH`` characters.

    >>> row_label(ComparisonRecord("fused", "win", shape={"B": 4, "dtype": "torch.bfloat16"}))
    'fused  B=4 dtype=bfloat16'
    """
    shape = visible(_shape_text(record.shape)) if record.shape else ""
    name = visible(record.name)
    return shortened(name + (f"  {shape}" if shape and shape not in name else ""), LABEL_WIDTH)


def group_of(record: ComparisonRecord) -> str:
    """The test a row belongs to: its node id without the parameters (``file.py::test_x``), or its name.

    >>> group_of(ComparisonRecord("a", "win", nodeid="tests/t.py::test_x[B4-S128]"))
    'tests/t.py::test_x'
    """
    return visible(record.nodeid.split("[", 1)[0]) if record.nodeid else visible(record.name)


def row_flags(record: ComparisonRecord) -> list[str]:
    """Short flags drawn beside a row: the medians disagree with the paired speedup (:mod:`.reading`), and the
    measurement modes reached different verdicts (:attr:`.records.ComparisonRecord.modes_disagree`).

    >>> row_flags(ComparisonRecord("a", "win", speedup=1.1, ci=(1.05, 1.2), candidate_ms=2.0, baseline_ms=1.0))
    ['medians disagree']
    """
    return (["medians disagree"] if reading.medians_disagree(record) else []) + \
        (["modes disagree"] if record.modes_disagree else [])


def interval_rows(report: ABReport | Mapping[str, Any]) -> list[tuple[str, list[ComparisonRecord]]]:
    """The comparisons that have a speedup, grouped by test in the order the report first names each test.

    >>> from pytest_kernelcheck.results.build import build_report
    >>> row = lambda test, name: {"kind": "comparison", "nodeid": f"t.py::{test}[x]", "name": name,
    ...                           "verdict": "tie", "speedup": 1.0, "ci": [0.99, 1.01], "p_value": 0.5}
    >>> [(test, [r.name for r in rows]) for test, rows in interval_rows(build_report(
    ...     [row("a", "1"), row("b", "2"), row("a", "3")], settings={}))]
    [('t.py::a', ['1', '3']), ('t.py::b', ['2'])]
    """
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    groups: dict[str, list[ComparisonRecord]] = {}
    for record in typed.comparisons:
        if record.speedup:
            groups.setdefault(group_of(record), []).append(record)
    return list(groups.items())


_NICE_SPEEDUPS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0,
                  3.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def speedup_ticks(low: float, high: float, most: int = 10) -> list[float]:
    """Round speedups between ``low`` and ``high`` for a log axis: 1x always, the others at least a ``most``-th of
    the axis apart (in log), so no two labels touch.

    >>> speedup_ticks(0.7, 1.4)
    [0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3]
    >>> speedup_ticks(0.05, 40.0)
    [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
    """
    gap = math.log(high / low) / most
    kept = [1.0] if low <= 1.0 <= high else []
    for tick in sorted((t for t in _NICE_SPEEDUPS if low <= t <= high), key=lambda t: abs(math.log(t))):
        if all(abs(math.log(tick / other)) >= gap for other in kept):
            kept.append(tick)
    return sorted(kept)


def write_intervals(report: ABReport | Mapping[str, Any], path: str | Path) -> bool | str | None:
    """The paired speedup of every comparison with its interval (:func:`interval_figure`), written to ``path``."""
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    if not interval_rows(typed):
        return None
    if _pyplot() is None:
        return PLOT_MISSING_NOTE
    _save(interval_figure(typed), path)
    return True


def interval_figure(report: ABReport | Mapping[str, Any]) -> Any:
    """The figure of :func:`write_intervals`: one horizontal row per comparison, its name and shape on the left,
    grouped under its test (a bold heading), the tie band shaded, the verdict as the colour, flags
    (:func:`row_flags`) to the right; the figure grows with the rows. Needs matplotlib and at least one row."""
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    groups = interval_rows(typed)
    plt = _pyplot()
    import matplotlib.patches
    import matplotlib.ticker

    # y positions from the top: a heading row per test, then its comparisons.
    labels: list[tuple[str, bool]] = []  # (text, is a test heading)
    placed: list[tuple[int, ComparisonRecord]] = []
    for test, records in groups:
        labels.append((shortened(test, LABEL_WIDTH), True))
        for record in records:
            placed.append((len(labels), record))
            labels.append((row_label(record), False))
    values = [float(v) for _, r in placed for v in (r.speedup, *r.ci) if v is not None]
    margin = reading.tie_margin(typed.settings.get("margin"))
    low_edge = min([*values, 1 / (1 + margin)]) / 1.15
    high_edge = max([*values, 1 + margin]) * 1.15
    longest = max(len(text) for text, _ in labels)
    flagged = any(row_flags(record) for _, record in placed)
    figure, axes = plt.subplots(figsize=(min(30.0, 5.5 + 0.075 * longest + (1.6 if flagged else 0)),
                                         1.9 + ROW_INCHES * len(labels)))
    axes.axvspan(1 / (1 + margin), 1 + margin, color="#f2d16b", alpha=0.45, zorder=0)
    axes.axvline(1.0, color="black", linewidth=0.9, zorder=1)
    for y, record in placed:
        speedup = float(record.speedup)
        low, high = record.ci
        colour = VERDICT_COLOURS.get(record.verdict, "black")
        left = float(low) if low is not None else low_edge
        right = float(high) if high is not None else high_edge
        axes.plot([left, right], [y, y], color=colour, linewidth=2.2, solid_capstyle="butt", zorder=2)
        for end, bound, marker in ((left, low, "<"), (right, high, ">")):
            axes.plot([end], [y], marker="|" if bound is not None else marker, color=colour, markersize=7, zorder=2)
        axes.plot([speedup], [y], marker="o", color=colour, markersize=5, zorder=3)
        flags = row_flags(record)
        if flags:
            # Beside the axes, in the figure's margin: never on top of another row's interval.
            axes.annotate("! " + ", ".join(flags), xy=(1.0, y), xycoords=("axes fraction", "data"),
                          xytext=(6, 0), textcoords="offset points", va="center", fontsize=7, color="tab:red",
                          annotation_clip=False)
    for y, (text, heading) in enumerate(labels):
        if heading and y:
            axes.axhline(y - 0.5, color="0.75", linewidth=0.6)
    axes.set_xscale("log")
    axes.set_xlim(low_edge, high_edge)
    axes.set_ylim(len(labels) - 0.5, -0.5)  # first row at the top
    axes.set_yticks(range(len(labels)))
    # parse_math off: matplotlib reads text between two $ as TeX; names are drawn as written.
    axes.set_yticklabels([text if heading else f"  {text}" for text, heading in labels], fontsize=8,
                         parse_math=False)
    for tick, (_, heading) in zip(axes.get_yticklabels(), labels):
        if heading:
            tick.set_fontweight("bold")
    axes.tick_params(axis="y", length=0)
    axes.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(speedup_ticks(low_edge, high_edge)))
    axes.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}x"))
    axes.tick_params(axis="x", labelsize=8)
    axes.grid(True, axis="x", linewidth=0.4, color="0.8")
    axes.set_xlabel("paired speedup: baseline time / candidate time per pair (right of 1x: the candidate is faster)")
    handles = [plt.Line2D([], [], marker="o", linewidth=2.2, color=c, label=v) for v, c in VERDICT_COLOURS.items()]
    handles.append(matplotlib.patches.Patch(color="#f2d16b", alpha=0.45, label=f"tie band: within {margin:.0%} of 1x"))
    axes.legend(handles=handles, fontsize=8, ncol=len(handles), loc="lower left", bbox_to_anchor=(0.0, 1.0),
                frameon=False)
    figure.suptitle("Kernel A/B: paired speedup with its interval, per comparison", fontsize=10, x=0.01,
                    ha="left")
    figure.tight_layout()
    return figure


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

    # Names repeat across shapes (one test, many cases), so each label carries its shape.
    for record in typed.comparisons:
        add(f"{row_label(record)} (candidate)", record.candidate_throughput)
        add(f"{row_label(record)} (baseline)", record.baseline_throughput)
    for tournament in typed.tournaments:
        shape = f"  {visible(_shape_text(tournament.shape))}" if tournament.shape else ""
        for variant, rates in tournament.throughput.items():
            add(f"{visible(tournament.name)}{shape}: {visible(variant)}", rates)
    for measurement in typed.measurements:
        shape = f"  {visible(_shape_text(measurement.shape))}" if measurement.shape else ""
        add(f"{visible(measurement.name)}{shape}", measurement.throughput)
    return points


_SIDES = {" (candidate)": ("o", "tab:green"), " (baseline)": ("s", "tab:gray")}
_OTHER = ("^", "tab:purple")


def roofline_key(points: Sequence[tuple[str, float, float]]) -> dict[str, int]:
    """A number per labelled thing (a comparison's two sides share one), in the order the points come.

    >>> roofline_key([("a (candidate)", 1, 1), ("a (baseline)", 1, 2), ("m", 3, 3)])
    {'a': 1, 'm': 2}
    """
    key: dict[str, int] = {}
    for label, _, _ in points:
        key.setdefault(_without_side(label), len(key) + 1)
    return key


def _without_side(label: str) -> str:
    return next((label[: -len(side)] for side in _SIDES if label.endswith(side)), label)


def write_roofline(report: ABReport | Mapping[str, Any], path: str | Path) -> bool | str | None:
    """Arithmetic intensity (FLOPs per byte) against achieved TFLOP/s, log-log, with each measured ceiling: the
    flat FLOP/s roof of each dtype and the slanted bandwidth roof (TFLOP/s = GB/s x FLOPs per byte / 1000). Each
    point carries a number, listed with its name and shape in a key beside the plot; a comparison's two sides share
    one, joined by a line from the baseline to the candidate."""
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    if not roofline_points(typed):
        return None
    if _pyplot() is None:
        return PLOT_MISSING_NOTE
    _save(roofline_figure(typed), path)
    return True


def roofline_figure(report: ABReport | Mapping[str, Any]) -> Any:
    """The figure of :func:`write_roofline`; needs matplotlib and at least one rated point."""
    typed = report if isinstance(report, ABReport) else ABReport.from_json(report)
    points = roofline_points(typed)
    plt = _pyplot()
    ceilings: list[CeilingRecord] = list(RunEnvironment.from_json(typed.environment).ceilings)
    key = roofline_key(points)
    intensities = [x for _, x, _ in points]
    low, high = min(intensities) / 4, max(intensities) * 4
    longest = max(len(label) for label in key)
    figure, (axes, legend_axes) = plt.subplots(
        1, 2, figsize=(8.0 + min(9.0, 0.062 * longest), max(5.5, 1.2 + 0.165 * len(key))),
        gridspec_kw={"width_ratios": [8.0, min(9.0, 0.062 * longest)]})
    grid = [low * (high / low) ** (i / 199) for i in range(200)]
    for gbps in sorted({c.gbps for c in ceilings if c.gbps}):
        axes.plot(grid, [gbps * x / 1e3 for x in grid], color="tab:blue", linewidth=1,
                  label=f"bandwidth ceiling {gbps:.4g} GB/s")
    for ceiling in ceilings:
        if ceiling.tflops:
            axes.axhline(ceiling.tflops, color="tab:red", linewidth=1, linestyle="--",
                         label=f"{ceiling.dtype} matmul ceiling {ceiling.tflops:.4g} TFLOP/s")
    by_thing: dict[str, list[tuple[str, float, float]]] = {}
    for label, x, y in points:
        by_thing.setdefault(_without_side(label), []).append((label, x, y))
    for thing, members in by_thing.items():
        if len(members) == 2:  # a comparison's sides: from the baseline to the candidate
            axes.plot([x for _, x, _ in members], [y for _, _, y in members], color="0.6", linewidth=0.7, zorder=2)
        for label, x, y in members:
            marker, colour = next((m for side, m in _SIDES.items() if label.endswith(side)), _OTHER)
            axes.scatter([x], [y], marker=marker, color=colour, s=22, zorder=3)
        label, x, y = max(members, key=lambda member: member[2])  # the number by the higher point
        axes.annotate(str(key[thing]), xy=(x, y), xytext=(4, 3), textcoords="offset points", fontsize=7,
                      color="black", zorder=4)
    for side, (marker, colour) in [*_SIDES.items(), (" tournament variant or measurement", _OTHER)]:
        axes.scatter([], [], marker=marker, color=colour, label=side.strip(" ()"))
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
    legend_axes.axis("off")
    height = max(5.5, 1.2 + 0.165 * len(key))
    legend_axes.set_ylim(max(len(key), (height - 1.2) / 0.165) + 0.5, -0.5)  # one line per entry, from the top
    legend_axes.set_xlim(0, 1)
    # parse_math off: names and shapes are drawn as written, never as TeX.
    legend_axes.text(0, -0.5, "key (number: name and shape)", fontsize=8, fontweight="bold", va="center")
    for thing, number in key.items():
        legend_axes.text(0, number, f"{number:>3}  {thing}", fontsize=7, va="center", family="monospace",
                         parse_math=False)
    figure.tight_layout()
    return figure


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
