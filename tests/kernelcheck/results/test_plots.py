"""The report's plots are readable: the interval plot has one row per comparison with its whole name and shape, groups
under each test, a visible tie band, a height that grows with the rows and flags beside flagged rows; the roofline
numbers every point and keys each number to a name and shape. Checked on the figures (and by rendering 3 and 60
comparisons: the PNG's height grows with the rows)."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest

from pytest_kernelcheck.results import plots
from pytest_kernelcheck.results.build import build_report
from pytest_kernelcheck.results.measured import ModeRecord
from pytest_kernelcheck.results.records import ComparisonRecord

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
# All of pyplot now, not the bare package: pytester's in-process runs drop the modules they import when they end, and
# a package left behind without them hands later runs stale submodules (matplotlib's own classes then mismatch).
import matplotlib.pyplot  # noqa: E402


def rows(count, seed=0, long_name=False):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        test = ("test_dense", "test_decoding", "test_variants")[i % 3]
        shape = {"B": rng.choice([1, 4, 32]), "S": 128 + i, "dtype": "torch.bfloat16", "causal": bool(i % 2)}
        speedup = math.exp(rng.gauss(0, 0.1))
        name = ("attention forward with a long descriptive name " * 2 if long_name else "flashlite vs sdpa") + test
        out.append({
            "kind": "comparison", "nodeid": f"tests/perf/test_ab.py::{test}[case{i}]", "name": name, "shape": shape,
            "verdict": "inconclusive", "speedup": speedup, "ci": [speedup * 0.9, speedup * 1.1], "p_value": 0.5,
            "candidate_ms": 1.0, "baseline_ms": speedup, "method": "events",
            "throughput": {"candidate": {"flops": 1e12 * (i + 1), "bytes": 1e10, "tflops": 50.0 + i},
                           "baseline": {"flops": 1e12 * (i + 1), "bytes": 1e10, "tflops": 40.0 + i}},
        })
    return out


def _close(figure):
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_the_interval_plot_has_one_row_per_comparison_with_its_full_name_and_shape_under_its_test():
    built = build_report(rows(7), settings={"margin": 0.02})
    figure = plots.interval_figure(built)
    try:
        axes = figure.axes[0]
        labels = [tick.get_text().strip() for tick in axes.get_yticklabels()]
        headings = [t.get_text() for t in axes.get_yticklabels() if t.get_fontweight() == "bold"]
        # One heading per test, each once, in the report's order (which sorts rows by test).
        assert headings == ["tests/perf/test_ab.py::test_decoding", "tests/perf/test_ab.py::test_dense",
                            "tests/perf/test_ab.py::test_variants"]
        assert len(labels) == 7 + 3
        shape = built["comparisons"][0]["shape"]
        assert f"flashlite vs sdpatest_decoding  B={shape['B']} S={shape['S']} dtype=bfloat16 causal=True" in labels
        assert all("..." not in label for label in labels)  # nothing cut
        assert len(set(labels)) == len(labels)  # every row tells itself apart
        band = [patch for patch in axes.patches if abs(patch.get_alpha() or 1) >= 0.4]
        assert band, "the tie band is drawn opaque enough to see"
        assert axes.get_xscale() == "log"
    finally:
        _close(figure)


def test_the_interval_plot_grows_with_its_rows_and_names(tmp_path):
    small, large = tmp_path / "three.png", tmp_path / "sixty.png"
    assert plots.write_intervals(build_report(rows(3), settings={}), small) is True
    assert plots.write_intervals(build_report(rows(60, long_name=True), settings={}), large) is True
    image = matplotlib.image.imread
    height_small, width_small = image(small).shape[:2]
    height_large, width_large = image(large).shape[:2]
    assert height_large > 5 * height_small  # about a row's height per comparison
    assert width_large > width_small  # longer names get a wider figure rather than a cut


def test_a_flagged_row_gets_its_flag_beside_it_and_any_record_flags_are_drawn_too():
    built = build_report(rows(2), settings={})
    disagreeing = {**rows(1)[0], "candidate_ms": 3.0, "baseline_ms": 1.0, "speedup": 1.2, "ci": [1.1, 1.3]}
    built = build_report([disagreeing, *rows(2)[1:]], settings={})
    figure = plots.interval_figure(built)
    try:
        texts = [text.get_text() for text in figure.axes[0].texts]
        assert texts == ["! medians disagree"]
    finally:
        _close(figure)
    # Measurement modes that reached different verdicts are flagged beside the row too.
    modes = (ModeRecord("throughput", "win", 1.1, (1.05, 1.2)), ModeRecord("latency", "loss", 0.9, (0.85, 0.95)))
    record = ComparisonRecord("a", "win", speedup=1.1, ci=(1.05, 1.2), candidate_ms=1.0, baseline_ms=1.1,
                              modes=modes)
    assert plots.row_flags(record) == ["modes disagree"]
    agreeing = dataclasses.replace(record, modes=modes[:1])
    assert plots.row_flags(agreeing) == []


def test_the_roofline_numbers_every_point_and_keys_each_number_to_a_name_and_shape():
    built = build_report(rows(4), settings={})
    figure = plots.roofline_figure(built)
    try:
        axes, key = figure.axes
        numbers = sorted(int(text.get_text()) for text in axes.texts)
        assert numbers == [1, 2, 3, 4]  # one per comparison: its two sides share a number
        entries = [text.get_text() for text in key.texts][1:]
        assert len(entries) == 4 and all("S=" in entry and "dtype=bfloat16" in entry for entry in entries)
        assert entries[0].split()[0] == "1"
    finally:
        _close(figure)


def test_speedup_ticks_keep_one_and_never_crowd():
    for low, high in [(0.7, 1.4), (0.98, 1.03), (0.01, 100.0), (0.5, 0.9)]:
        ticks = plots.speedup_ticks(low, high)
        assert all(low <= tick <= high for tick in ticks)
        if low <= 1 <= high:
            assert 1.0 in ticks
        gaps = [math.log(b / a) for a, b in zip(ticks, ticks[1:])]
        assert all(gap >= math.log(high / low) / 10 - 1e-12 for gap in gaps)
