"""Comparison names any output would choke on or blur: every output is written, readable and keeps names apart."""
from __future__ import annotations

import json

import pytest

from pytest_kernelcheck.results import gate, plots, report, storage
from pytest_kernelcheck.speed import profiling
from pytest_kernelcheck.visible_text import visible

pytest_plugins = ["pytester"]

NAMES = {
    "non_ascii": "fused ünïcødé 注意力",
    "control": "esc\x1b[31mred\x07\x00",
    "newline": "two\nlines",
    "newline_as_space": "two lines",
    "separator": "para\u2028graph",
    "pipe_backtick": "a | `b` | c",
    "long": "x" * 300,
    "surrogate": "bad \udcff name",
    "rtl": "abc\u202edcba",
    "zero_width": "ab\u200bc",
    "zero_width_twin": "abc",
    "cut_one": "y" * 60 + "ONE",
    "cut_two": "y" * 60 + "TWO",
    "dollars": "$5 vs $6",
}


def _rows():
    return [{"kind": "comparison", "nodeid": f"t.py::test_{key}", "name": name, "verdict": "win", "speedup": 1.5,
             "ci": [1.4, 1.6], "p_value": 0.001, "shape": {"S": 128, "tag": name[:8]}}
            for key, name in NAMES.items()]


def _history(rows):
    return [storage.RunSpeedups("0001_base", {(r["nodeid"], r["name"]): 1.2 for r in rows},
                                {(r["nodeid"], r["name"]): (1.1, 1.3) for r in rows})]


def _shown_plainly(text: str) -> bool:
    """No character that hides, moves or breaks the text around it (line breaks between lines aside)."""
    return all(line.isprintable() or visible(line) == line for line in text.split("\n"))


def test_every_report_file_is_written_readable_and_keeps_names_apart(tmp_path):
    rows = _rows()
    built = report.build_report(rows, settings={})
    # A lone surrogate raised out of matplotlib (TypeError), which crashed pytest at the session's end.
    written = report.write_all(built, tmp_path / "ab.json", _history(rows))
    assert {path.name for path in written.paths} >= {"ab.json", "ab.md", "ab.png", "ab_trend.png"}
    loaded = json.loads((tmp_path / "ab.json").read_text(encoding="utf-8"))
    assert sorted(r["name"] for r in loaded["comparisons"]) == sorted(NAMES.values())  # JSON keeps them exact
    markdown = (tmp_path / "ab.md").read_text(encoding="utf-8")
    assert _shown_plainly(markdown)
    table = [line for line in markdown.split("\n") if line.startswith("| ")]
    for name in NAMES.values():  # each name's cell, in the comparison table and the history table
        assert sum(line.startswith(f"| {visible(name).replace('|', chr(92) + '|')} |") for line in table) == 2, name
    assert len(set(table)) == len(table)  # "two\nlines" and "two lines", "ab\u200bc" and "abc" stay apart


def test_trend_panel_titles_cut_long_names_apart(tmp_path, monkeypatch):
    titles = []
    monkeypatch.setattr(plots, "_save", lambda figure, path: titles.extend(ax.get_title() for ax in figure.axes))
    rows = _rows()
    assert plots.write_trend(report.build_report(rows, settings={}), _history(rows), tmp_path / "t.png") is True
    shown = [title for title in titles if title]
    assert len(shown) == len(NAMES) and len(set(shown)) == len(shown)  # the cut names ONE and TWO kept apart
    assert all(len(line) <= 48 for title in shown for line in title.split("\n"))
    assert all(_shown_plainly(title) for title in shown)


def test_gate_lines_and_traces_take_any_name():
    rows = _rows()
    earlier = [dict(row, verdict="win") for row in rows]
    now = [dict(row, verdict="loss", speedup=0.5, ci=[0.4, 0.6]) for row in rows]
    built = report.build_report(now, settings={}, previous=report.build_report(earlier, settings={}))
    lines = gate.regression_lines(gate.evaluate([gate.VerdictRule()], built))
    titles = [line for line in lines if not line.startswith(" ")]
    assert len(titles) == len(NAMES) and len(set(titles)) == len(titles)
    assert all(_shown_plainly(line) for line in lines)
    files = {profiling.trace_file_name("t.py::test", name) for name in NAMES.values()}  # the surrogate raised
    assert len(files) == len(NAMES)
    assert all(_shown_plainly(profiling.range_name("t.py::test", name, "candidate")) for name in NAMES.values())


NAMED_TESTS = """
from pytest_kernelcheck.speed.timing import SimulatedTimer

def candidate():
    pass

def baseline():
    pass

def timer():
    return SimulatedTimer({candidate: lambda rng, now: 1e-3 * (1 + 0.01 * rng.random()),
                           baseline: lambda rng, now: 2e-3 * (1 + 0.01 * rng.random())})

def test_names(kernel_ab):
    for name in ["bad \\udcff name", "esc\\x1b[31mred", "abc\\u202edcba"]:
        kernel_ab.compare(candidate, baseline, name=name, timer=timer())

def test_a_line_separator_is_a_line_break(kernel_ab):
    kernel_ab.compare(candidate, baseline, name="para\\u2028graph", timer=timer())
"""


def test_end_to_end_a_run_with_such_names_reports_them_escaped(pytester):
    pytester.makepyfile(test_named=NAMED_TESTS)
    result = pytester.runpytest("--kernel-ab", "--kernel-ab-max-time", "0.2", "-p", "no:cacheprovider",
                                "--kernel-ab-report", "out/ab.json")
    result.assert_outcomes(passed=1, failed=1)  # no INTERNALERROR at the session's end
    result.stdout.fnmatch_lines([
        "*ValueError: name must be a non-empty, one-line label for the comparison, got 'para\\u2028graph'",
        "bad \\udcff name *win*", "esc\\x1b[[]31mred *win*", "abc\\u202edcba *win*",
        "A/B report: out/ab.json, out/ab.md, out/ab.png",
    ])
    assert "\x1b[31mred" not in result.stdout.str()


def test_the_per_gpu_disagreement_warning_shows_names_escaped():
    def on_gpu(name, verdict, index):
        return {"kind": "comparison", "nodeid": "t.py::a", "name": name, "verdict": verdict, "speedup": 1.1,
                "ci": [1.05, 1.15], "p_value": 0.01, "gpu": {"index": index, "name": "NVIDIA H200", "uuid": f"GPU-{index}"}}

    built = report.build_report([on_gpu(NAMES["control"], "win", 0), on_gpu(NAMES["control"], "loss", 1)],
                                settings={})
    warnings = [line for line in report.gpu_lines(built) if line.startswith("WARNING")]
    assert warnings == ["WARNING: t.py::a esc\\x1b[31mred\\x07\\x00: verdicts differ across NVIDIA H200 GPUs: win on "
                        "GPU 0, loss on GPU 1"]
