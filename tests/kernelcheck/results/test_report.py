"""A/B report: totals, Benjamini-Hochberg, regressions against an earlier run, files, terminal markup."""
from __future__ import annotations

import builtins
import errno
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pytest_kernelcheck.results import report
from pytest_kernelcheck.results.report_record import ABReport

SETTINGS = {"alpha": 0.05, "margin": 0.02, "max_time": 2.0}


def comparison(name, verdict, speedup, ci, p, **extra):
    record = {
        "kind": "comparison",
        "nodeid": f"test_x.py::{name}",
        "name": name,
        "shape": {"B": 1, "S": 128},
        "verdict": verdict,
        "speedup": speedup,
        "ci": list(ci),
        "p_value": p,
        "candidate_ms": 1.0,
        "baseline_ms": speedup,
        "method": "events",
        "throttled": False,
        "error": None,
    }
    record.update(extra)
    return record


RECORDS = [
    comparison("fast", "win", 1.20, (1.15, 1.25), 0.001),
    comparison("borderline", "win", 1.05, (1.01, 1.09), 0.04),
    comparison("slow", "loss", 0.8, (0.75, 0.85), 0.002),
    comparison("same", "tie", 1.0, (0.99, 1.01), 0.9),
    {"kind": "comparison", "nodeid": "test_x.py::broken", "name": "broken", "shape": None, "verdict": "error",
     "error": "CallableFailed: candidate raised ValueError during timing: boom", "speedup": None,
     "ci": [None, None], "p_value": None, "candidate_ms": None, "baseline_ms": None, "method": None},
]


def test_summary_counts_geomean_and_benjamini_hochberg():
    built = report.build_report(RECORDS, settings=SETTINGS)
    summary = built["summary"]
    assert (summary["win"], summary["loss"], summary["tie"], summary["inconclusive"], summary["error"]) == (2, 1, 1, 0, 1)
    assert summary["geomean_speedup"] == pytest.approx((1.2 * 1.05 * 0.8 * 1.0) ** 0.25)
    by_name = {r["name"]: r for r in built["comparisons"]}
    # BH over 4 p-values: 0.001*4/1, 0.002*4/2, 0.04*4/3, 0.9 -> the borderline win does not survive.
    assert by_name["fast"]["p_bh"] == pytest.approx(0.004)
    assert by_name["borderline"]["p_bh"] == pytest.approx(0.04 * 4 / 3)
    assert by_name["borderline"]["verdict_bh"] == "inconclusive"
    assert by_name["slow"]["verdict_bh"] == "loss"
    assert (summary["bh_win"], summary["bh_loss"]) == (1, 1)
    assert "p_bh" not in by_name["broken"]


def test_a_run_whose_every_comparison_failed_prints_no_mean_speedup():
    # "geometric-mean speedup -x over 0" read as a speedup of its own; with none measured the line says so.
    line = report.summary_line(report.assemble_report(RECORDS[-1:], settings=SETTINGS))
    assert line.startswith("0 win, 0 loss, 0 tie, 0 inconclusive, 1 error; no speedup measured, so no geometric mean;")
    assert "-x" not in line
    measured = report.summary_line(report.assemble_report(RECORDS[:1], settings=SETTINGS))
    assert "geometric-mean speedup 1.200x over 1" in measured


def test_regressions_against_an_earlier_report():
    earlier = report.build_report(
        [
            comparison("fast", "win", 1.5, (1.4, 1.6), 0.001),  # now 1.15-1.25: interval below the old one
            comparison("borderline", "win", 1.06, (1.0, 1.1), 0.04),  # overlapping: no regression
            comparison("slow", "win", 1.1, (1.05, 1.15), 0.01),  # win -> loss
        ],
        settings=SETTINGS,
    )
    built = report.build_report(RECORDS, settings=SETTINGS, previous=earlier)
    by_name = {r["name"]: r for r in built["comparisons"]}
    assert built["summary"]["regressions"] == ["fast", "slow"]
    assert "interval now below" in by_name["fast"]["vs_last"]["reason"]
    assert "win to loss" in by_name["slow"]["vs_last"]["reason"]
    assert by_name["borderline"]["vs_last"]["regression"] is False
    assert by_name["same"]["vs_last"] is None  # not in the earlier run
    header, rows = report.table_rows(built)
    assert header[-1] == "vs last run"
    assert rows[[r[0] for r in rows].index("fast")][-1].startswith("REGRESSION: was 1.500x win")


def test_rows_sharing_a_test_and_name_are_matched_with_the_earlier_report_in_order():
    # Reports written before names had to be unique can hold two rows with one test and name; matching both to
    # the same earlier row would hide the first one's regression.
    earlier = report.build_report(
        [comparison("dup", "win", 2.0, (1.9, 2.1), 0.001), comparison("dup", "tie", 1.0, (0.95, 1.05), 0.5)],
        settings=SETTINGS,
    )
    now = [comparison("dup", "tie", 1.0, (0.95, 1.05), 0.5) for _ in range(3)]
    built = report.build_report(now, settings=SETTINGS, previous=earlier)
    assert [(r["vs_last"] or {}).get("speedup") for r in built["comparisons"]] == [2.0, 1.0, None]
    assert built["summary"]["regressions"] == ["dup"]
    assert built["comparisons"][0]["vs_last"]["regression"] is True
    assert built["comparisons"][1]["vs_last"]["regression"] is False


def test_json_round_trip_is_standard_json(tmp_path):
    records = RECORDS + [comparison("unbounded", "inconclusive", 1.0, (0.0, math.inf), 0.5)]
    built = report.build_report(records, settings=SETTINGS, environment={"hostname": "h"})
    path = tmp_path / "ab.json"
    report.write_json(built, path)
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    loaded = report.load_report(path)
    assert loaded["schema"] == report.SCHEMA and len(loaded["comparisons"]) == 6
    unbounded = next(r for r in loaded["comparisons"] if r["name"] == "unbounded")
    assert unbounded["ci"] == [0.0, None]


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), ("{not json", "cannot be read as JSON"), ('{"schema": "other"}', "is not a kernel A/B report")],
)
def test_load_report_errors_name_the_problem(tmp_path, content, message):
    path = tmp_path / "old.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(report.ReportError, match=message):
        report.load_report(path)


ROW = r"comparisons\[0\] \('fast'\): "  # how the message names the damaged row


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data["comparisons"][0].update(verdict="WIN"),
         ROW + "field 'verdict': 'WIN' is refused; accepted: 'win', 'loss', 'tie', 'inconclusive', 'error'"),
        (lambda data: data["comparisons"][0].pop("verdict"), ROW + "field 'verdict' is missing"),
        (lambda data: data.update(version=99), "field 'version': 99 is refused; accepted: 1"),
        (lambda data: data["comparisons"][0].update(speedup=-3.0), ROW + "field 'speedup': -3.0 is refused"),
        (lambda data: data["comparisons"][0].update(ci=[5.0, 1.0]), ROW + r"field 'ci': \[5.0, 1.0\] is refused"),
        (lambda data: data["comparisons"][0].update(ci=[1.1]), ROW + r"field 'ci': \[1.1\] is refused"),
        (lambda data: data["comparisons"][0].update(speedup="fast"), ROW + "field 'speedup': 'fast' is refused"),
    ],
)
def test_load_report_refuses_a_damaged_report_naming_the_file_the_row_and_the_field(tmp_path, damage, message):
    data = report.build_report(RECORDS[:1], settings=SETTINGS)
    damage(data)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(report.ReportError, match=f"^earlier report '{re.escape(str(path))}': {message}"):
        report.load_report(path)


H100 = {"gpu": {"available": True, "devices": ["NVIDIA H100 80GB HBM3"], "driver": "550.54", "cuda": "12.4"},
        "packages": {"torch": "2.4.0"}, "hostname": "gpu-node-7"}
H200 = {"gpu": {"available": True, "devices": ["NVIDIA H200"], "driver": "550.54", "cuda": "12.4"},
        "packages": {"torch": "2.4.0"}, "hostname": "gpu-node-8"}


def test_a_report_compared_with_a_run_of_another_machine_says_how_in_every_form(tmp_path):
    earlier = report.build_report(RECORDS[:1], settings=SETTINGS, environment=H100)
    built = report.build_report(RECORDS[:1], settings=SETTINGS, environment=H200, previous=earlier)
    assert built["machine_differences"] == ["GPU NVIDIA H100 80GB HBM3 then, NVIDIA H200 now"]
    warning = ("WARNING: the earlier run was measured on another machine (GPU NVIDIA H100 80GB HBM3 then, NVIDIA "
               "H200 now): its speedups may differ for the machine, not the code")
    assert report.machine_lines(built) == [warning]
    terminal = RecordingTerminal()
    report.write_terminal(terminal, built)
    assert (warning + "\n", {"yellow": True, "bold": True}) in terminal.pieces
    report.write_markdown(built, tmp_path / "ab.md")
    assert warning in (tmp_path / "ab.md").read_text().splitlines()
    # The same machine on another host (two machines alike): nothing to say, and no key in the report.
    same = report.build_report(RECORDS[:1], settings=SETTINGS, environment={**H100, "hostname": "gpu-node-9"},
                               previous=earlier)
    assert "machine_differences" not in same and report.machine_lines(same) == []


def test_check_writable(tmp_path):
    report.check_writable(tmp_path / "ab.json")
    report.check_writable(tmp_path / "new" / "dirs" / "ab.json")  # created when written
    (tmp_path / "afile").write_text("")
    with pytest.raises(report.ReportError, match="is not a directory"):
        report.check_writable(tmp_path / "afile" / "ab.json")
    with pytest.raises(report.ReportError, match="is a directory"):
        report.check_writable(tmp_path)


def test_markdown_and_plot(tmp_path):
    built = report.build_report(RECORDS, settings=SETTINGS)
    markdown, plot = report.companion_paths(tmp_path / "ab.json")
    report.write_markdown(built, markdown)
    text = markdown.read_text()
    assert "| comparison | shape | cand ms | base ms | paired speedup [CI] | p adj [raw] | verdict | method |" in text
    assert "| fast | B=1 S=128 | 1 | 1.2 | 1.200x [1.150, 1.250] | 0.001 | win | events |" in text
    assert "error in broken: CallableFailed" in text
    assert report.write_plot(built, plot) is None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    built = report.build_report(RECORDS, settings=SETTINGS)
    note = report.write_plot(built, tmp_path / "ab.png")
    # The hint names a command that works: matplotlib is on the package index, pytest-kernelcheck is not.
    assert note == report.PLOT_MISSING_NOTE and "pip install matplotlib" in note and "kernelcheck[" not in note
    assert not (tmp_path / "ab.png").exists()


class RecordingTerminal:
    def __init__(self):
        self.pieces = []

    def write_sep(self, sep, title):
        self.pieces.append((title, {}))

    def write_line(self, line, **markup):
        self.pieces.append((line + "\n", markup))

    def write(self, text, **markup):
        self.pieces.append((text, markup))


def test_terminal_colours_verdicts():
    terminal = RecordingTerminal()
    report.write_terminal(terminal, report.build_report(RECORDS, settings=SETTINGS), notes=["a note"])
    marked = {text.strip(): markup for text, markup in terminal.pieces if markup}
    assert marked["win"] == {"green": True}
    assert marked["loss"] == {"red": True}
    assert marked["tie"] == {"yellow": True}
    assert marked["win (not after BH)"] == {"green": True}
    text = "".join(t for t, _ in terminal.pieces)
    assert "2 win, 1 loss, 1 tie, 0 inconclusive, 1 error" in text
    assert "after Benjamini-Hochberg (FDR 0.05): 1 win, 1 loss survive" in text
    assert text.rstrip().endswith("a note")


def test_tournament_lines():
    record = {
        "kind": "tournament", "name": "variants", "shape": {"S": 64}, "best": "b", "ranking": ["b", "a"],
        "indistinguishable_from_best": ["b"], "median_ms": {"a": 1.2, "b": 1.0}, "n_rounds": 80, "method": "events",
        "pairwise": [{"faster": "b", "slower": "a", "speedup": 1.2, "ci": [1.1, 1.3], "verdict": "win"}],
    }
    lines = report.tournament_lines(record)
    assert lines[0] == "tournament variants (S=64): best b; indistinguishable from best: b"
    assert "a 1.2 ms (1.200x [1.100, 1.300] slower, win for b)" in lines[1]


def test_environment_reuses_pytest_benchmark_machine_and_commit_info():
    environment = report.environment_info()
    assert {"date", "hostname", "python", "packages", "machine_info", "commit_info", "gpu"} <= set(environment)
    assert environment["machine_info"]["python_version"] == environment["python"]
    assert "id" in environment["commit_info"]
    json.dumps(environment, default=str)


def _mode_of_a_new_file(folder):
    probe = folder / "probe"
    probe.write_text("")
    return probe.stat().st_mode & 0o777


def test_report_files_are_written_whole_with_the_usual_permissions_and_no_temporary_left(tmp_path):
    built = report.build_report(RECORDS, settings=SETTINGS)
    json_path = tmp_path / "out" / "ab.json"
    markdown, plot = report.companion_paths(json_path)
    written = report.write_all(built, json_path)
    assert written.note is None  # the plot note: None when the plot was written
    assert [path.name for path in written.paths] == ["ab.json", "ab.md", "ab.png"]  # no rated rows: no roofline
    assert report.load_report(json_path)["summary"]["comparisons"] == 5
    assert markdown.read_text().startswith("# Kernel A/B comparisons")
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["ab.json", "ab.md", "ab.png"]
    assert json_path.stat().st_mode & 0o777 == _mode_of_a_new_file(tmp_path)  # not the 0600 of a bare mkstemp


# Run in a child process: the file-size limit (the way to make a real write fail halfway, as a full disk does)
# must not reach pytest's own files.
HALF_WRITE = """
import resource, signal, sys
from pytest_kernelcheck.results import report
from pytest_kernelcheck.results.report_record import ABReport

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write then fails with EFBIG instead of killing
records = [{"kind": "comparison", "nodeid": f"t.py::test_{i}", "name": "n" * 80 + str(i), "verdict": "tie",
            "speedup": 1.0, "ci": [0.9, 1.1], "p_value": 0.5} for i in range(400)]
built = report.build_report(records, settings={"alpha": 0.05})
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
for write, path in ((report.write_json, sys.argv[1]), (report.write_markdown, sys.argv[2])):
    try:
        write(built, path)
        print("written", path)
    except report.ReportError as exc:
        print("ReportError:", exc)
"""


def test_a_write_failing_halfway_leaves_the_previous_report_intact(tmp_path):
    pytest.importorskip("resource")
    built = report.build_report(RECORDS[:1], settings=SETTINGS)
    json_path, markdown = tmp_path / "ab.json", tmp_path / "ab.md"
    report.write_json(built, json_path)
    report.write_markdown(built, markdown)
    before = {path: path.read_bytes() for path in (json_path, markdown)}
    assert all(len(content) < 8192 for content in before.values())
    root = Path(report.__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-c", HALF_WRITE, str(json_path), str(markdown)],
        capture_output=True, text=True, cwd=root, timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.count("ReportError: cannot write report") == 2, child.stdout
    assert "File too large" in child.stdout
    assert {path: path.read_bytes() for path in (json_path, markdown)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ab.json", "ab.md"]


def test_a_plot_failing_halfway_leaves_the_previous_plot_intact(tmp_path, monkeypatch):
    import matplotlib.figure

    plot = tmp_path / "ab.png"
    plot.write_bytes(b"previous plot")

    def savefig_until_the_disk_is_full(self, fname, **kwargs):
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG half a plot")
        else:
            Path(fname).write_bytes(b"\x89PNG half a plot")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig_until_the_disk_is_full)
    with pytest.raises(report.ReportError, match=r"cannot write plot '.*ab\.png': \[Errno 28\] No space left"):
        report.write_plot(report.build_report(RECORDS, settings=SETTINGS), plot)
    assert plot.read_bytes() == b"previous plot"
    assert [p.name for p in tmp_path.iterdir()] == ["ab.png"]


def test_markdown_history_table_matches_rows_by_test_and_name(tmp_path):
    from pytest_kernelcheck.results.storage import RunSpeedups

    built = report.build_report(RECORDS, settings=SETTINGS)
    history = [RunSpeedups("0001_old", {("test_x.py::fast", "fast"): 1.1}),
               RunSpeedups("0002_new", {("test_x.py::fast", "fast"): 1.15, ("test_x.py::slow", "slow"): 0.9})]
    path = tmp_path / "ab.md"
    report.write_markdown(built, path, history)
    text = path.read_text()
    assert "## Speedup history: last 2 saved run(s) of this machine" in text
    assert "| comparison | shape | 0001_old | 0002_new | this run |" in text
    assert "| fast | B=1 S=128 | 1.100x | 1.150x | 1.200x |" in text
    assert "| slow | B=1 S=128 | - | 0.900x | 0.800x |" in text
    assert "| broken |  | - | - | - |" in text
    report.write_markdown(built, path)
    assert "Speedup history" not in path.read_text()


def _rated(name, candidate_tflops, baseline_tflops, ceiling=None, **extra):
    """A comparison row that gave flops and bytes (intensity 100 FLOPs per byte)."""
    rates = {"candidate": {"flops": 1e12, "bytes": 1e10, "tflops": candidate_tflops, "gbps": candidate_tflops * 10,
                           "tflops_pct": candidate_tflops / 10 if ceiling else None},
             "baseline": {"flops": 1e12, "bytes": 1e10, "tflops": baseline_tflops, "gbps": baseline_tflops * 10}}
    speedup = candidate_tflops / baseline_tflops
    return comparison(name, "win", speedup, (speedup * 0.9, speedup * 1.1), 0.001, throughput=rates,
                      ceiling=ceiling, **extra)


CEILING = {"device": "cuda:0 (Fake)", "dtype": "bfloat16", "tflops": 1000.0, "gbps": 4000.0,
           "flops_method": "matmul 8192^3 bfloat16, median of 10 (events)",
           "bandwidth_method": "copy of 1 GiB (read + write), median of 10 (events)", "reason": None}
MEASUREMENT = {"kind": "measurement", "nodeid": "test_x.py::m", "name": "mm", "shape": {"n": 64}, "median_ms": 1.5,
               "ci_ms": [1.4, 1.6], "n_samples": 40, "method": "events",
               "throughput": {"flops": 2e12, "bytes": 1e9, "tflops": 1333.0, "gbps": 667.0}, "ceiling": CEILING}


def test_rated_rows_get_throughput_columns_and_the_environment_lists_each_ceiling_once(tmp_path):
    records = RECORDS + [_rated("rated", 500.0, 400.0, CEILING), _rated("rated too", 300.0, 200.0, CEILING),
                         MEASUREMENT]
    built = report.build_report(records, settings={**SETTINGS, "ceilings": "on"}, environment={"hostname": "h"})
    assert built["environment"]["ceilings"] == {"enabled": True, "measured": [CEILING]}
    header, rows = report.table_rows(built)
    assert header[4:6] == ["TFLOP/s cand/base", "GB/s cand/base"]
    rated = rows[[r[0] for r in rows].index("rated")]
    assert rated[4:6] == ["500 / 400 (50% of ceiling)", "5e+03 / 4e+03"]
    assert rows[[r[0] for r in rows].index("fast")][4:6] == ["-", "-"]
    json_path = tmp_path / "ab.json"
    written = report.write_all(built, json_path)
    assert [p.name for p in written.paths] == ["ab.json", "ab.md", "ab.png", "ab_roofline.png"]
    assert (tmp_path / "ab_roofline.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "ab.md").read_text()
    assert "| rated | B=1 S=128 | 1 | 1.25 | 500 / 400 (50% of ceiling) | 5e+03 / 4e+03 | 1.250x" in text
    assert "## Measurements (one function timed alone)" in text
    assert "| mm | n=64 | 1.5 | [1.4, 1.6] | 40 | 1.33e+03 | 667 | events |" in text
    assert ("Ceiling of cuda:0 (Fake), bfloat16: 1000 TFLOP/s (matmul 8192^3 bfloat16, median of 10 (events)); "
            "4000 GB/s (copy of 1 GiB (read + write), median of 10 (events))") in text
    assert "![Roofline: achieved TFLOP/s against arithmetic intensity](ab_roofline.png)" in text
    assert "ab_trend.png" not in text  # no saved runs, no trend


def test_roofline_points_need_both_flops_and_bytes():
    only_flops = comparison("flops only", "win", 1.2, (1.1, 1.3), 0.001,
                            throughput={"candidate": {"flops": 1e12, "tflops": 5.0}, "baseline": None})
    built = report.build_report([only_flops, _rated("both", 500.0, 400.0)], settings=SETTINGS)
    from pytest_kernelcheck.results import plots

    assert [(label, x) for label, x, _ in plots.roofline_points(built)] == [
        ("both  B=1 S=128 (candidate)", 100.0), ("both  B=1 S=128 (baseline)", 100.0)]
    assert plots.write_roofline(report.build_report([only_flops], settings=SETTINGS), "/nonexistent/r.png") is None


def test_ceilings_off_and_unmeasured_ceilings_are_said_so():
    off = report.build_report([_rated("rated", 5.0, 4.0)], settings={**SETTINGS, "ceilings": "off"})
    assert off["environment"]["ceilings"] == {"enabled": False, "measured": []}
    assert report.ceiling_lines(off) == ["Ceilings: not measured (--kernel-ab-ceilings off)"]
    cpu = {"device": "cpu-clock", "dtype": None, "reason": "not measured: ceilings are measured on CUDA devices only"}
    on = report.build_report([_rated("rated", 5.0, 4.0, cpu)], settings=SETTINGS)
    assert report.ceiling_lines(on) == [
        "Ceiling of cpu-clock, no dtype: not measured: ceilings are measured on CUDA devices only"]
    assert "ceilings" not in report.build_report(RECORDS, settings=SETTINGS)["environment"]


def test_trend_plot_of_saved_runs_is_written_and_linked(tmp_path):
    from pytest_kernelcheck.results import plots
    from pytest_kernelcheck.results.storage import RunSpeedups

    built = report.build_report(RECORDS, settings=SETTINGS)
    key = ("test_x.py::fast", "fast")
    history = [RunSpeedups("0001_old", {key: 1.1}, {key: (1.0, None)}), RunSpeedups("0002_new", {key: 1.15})]
    assert plots.trend_series(built, history) == [
        ("fast\nB=1 S=128", [("0001_old", 1.1, 1.0, None), ("0002_new", 1.15, None, None), ("this run", 1.2, 1.15, 1.25)])]
    written = report.write_all(built, tmp_path / "ab.json", history)
    assert (tmp_path / "ab_trend.png") in written.paths
    assert (tmp_path / "ab_trend.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "ab.md").read_text()
    assert text.index("## Speedup history") < text.index("![Speedup with its interval per saved run](ab_trend.png)")
    assert plots.write_trend(built, [RunSpeedups("0001_other", {("x", "y"): 1.0})], tmp_path / "t.png") is None


# The report rewritten while a run goes (ProgressWriter), with an injected clock.
class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _unfinished():
    return report.build_report([], settings={}, finished=False)


def test_progress_rewrites_wait_the_interval_then_write(tmp_path):
    clock = _Clock()
    writer = report.ProgressWriter(tmp_path / "ab.json", min_interval=10.0, clock=clock)
    assert writer.maybe_write(_unfinished)  # the first record at once
    clock.now = 9.9
    assert not writer.maybe_write(_unfinished)
    clock.now = 10.0
    assert writer.maybe_write(_unfinished) and writer.writes == 2
    assert json.loads((tmp_path / "ab.json").read_text())["finished"] is False


def test_progress_rewrites_keep_their_cost_under_the_share(tmp_path):
    clock = _Clock()

    def slow_build():  # a write that takes 2 s of the clock: at a 5% share the next waits 40 s, not 10
        clock.now += 2.0
        return _unfinished()

    writer = report.ProgressWriter(tmp_path / "ab.json", min_interval=10.0, max_share=0.05, clock=clock)
    assert writer.maybe_write(slow_build) and writer.last_cost == 2.0
    clock.now += 39.0
    assert not writer.maybe_write(slow_build)
    clock.now += 1.0
    assert writer.maybe_write(slow_build)


def test_a_failed_progress_write_stops_the_rewrites_and_says_why(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    writer = report.ProgressWriter(blocker / "ab.json", min_interval=0.0, clock=_Clock())
    assert not writer.maybe_write(_unfinished)
    assert writer.error is not None and "a_file" in writer.error
    built = []
    assert not writer.maybe_write(lambda: built.append(1) or _unfinished())
    assert built == []  # not even built again


def test_an_unfinished_report_reads_back_as_unfinished():
    data = report.build_report([], settings={}, finished=False)
    assert data["finished"] is False and ABReport.from_json(data).finished is False
    assert "finished" not in report.build_report([], settings={}) and ABReport.from_json(
        report.build_report([], settings={})).finished


def test_a_progress_build_that_raises_stops_the_rewrites_not_the_run(tmp_path):
    def broken():
        raise KeyError("cpu_threads")

    writer = report.ProgressWriter(tmp_path / "ab.json", min_interval=0.0, clock=_Clock())
    assert not writer.maybe_write(broken)
    assert writer.error == "KeyError: 'cpu_threads'" and not (tmp_path / "ab.json").exists()


def _printed_numbers(text):
    return [float(number) for number in re.findall(r"\d+\.\d+", text)]


def test_printed_speedups_and_intervals_never_contradict_the_verdict():
    # A win's interval lies wholly above 1 and a loss's wholly below (stats.decide), but rounding to 3 decimals
    # printed a win whose lower end is 1.0004 as "1.000x [1.000, 1.040] win", and a loss ending at 0.9996 as
    # reaching 1.000, in the table, the history, the tournament lines and the markdown.
    rng = np.random.default_rng()
    for _ in range(50):
        gap, spread = float(rng.uniform(1e-7, 4.9e-4)), float(rng.uniform(1e-5, 0.05))
        win = comparison("win", "win", 1 + gap * 1.01, (1 + gap, 1 + gap + spread), 0.001)
        loss = comparison("loss", "loss", 1 - gap * 1.01, (1 - gap - spread, 1 - gap), 0.001)
        header, rows = report.table_rows(report.build_report([win, loss], settings=SETTINGS))
        column = header.index("paired speedup [CI]")
        cells = {row[0]: row[column] for row in rows}
        speedup, low, high = _printed_numbers(cells["win"])
        assert speedup > 1 and low > 1, cells["win"]
        speedup, low, high = _printed_numbers(cells["loss"])
        assert speedup < 1 and high < 1, cells["loss"]
        tournament = {
            "kind": "tournament", "name": "t", "best": "b", "ranking": ["b", "a"], "indistinguishable_from_best": [],
            "median_ms": {"a": 1.0, "b": 1.0}, "n_rounds": 80, "method": "events",
            "pairwise": [{"faster": "b", "slower": "a", "speedup": 1 + gap * 1.01, "ci": [1 + gap, 1 + gap + spread],
                          "verdict": "win"}],
        }
        printed = report.tournament_lines(tournament)[1].split("(")[1]
        speedup, low, _high = _printed_numbers(printed)
        assert speedup > 1 and low > 1, printed
        earlier_low = float(rng.uniform(1.1, 3.0))
        earlier = report.build_report([comparison("r", "win", earlier_low + spread, (earlier_low, 4.0), 0.001)],
                                      settings=SETTINGS)
        now_high = earlier_low * (1 - gap)
        now = report.build_report([comparison("r", "win", now_high - spread / 2, (now_high - spread, now_high),
                                              0.001)], settings=SETTINGS, previous=earlier)
        reason = ABReport.from_json(now).comparisons[0].vs_last.reason
        below, above = (float(n) for n in re.findall(r"\((\S+) < (\S+)\)", reason)[0])
        assert below < above, reason


def test_a_speedup_or_interval_end_of_exactly_one_or_far_from_it_keeps_three_decimals():
    assert report.table_rows(report.build_report(
        [comparison("a", "inconclusive", 1.0, (0.99, 1.0), 0.3)], settings=SETTINGS))[1][0][4] == \
        "1.000x [0.990, 1.000]"
    assert report.table_rows(report.build_report(
        [comparison("b", "win", 1.2, (1.15, 1.25), 0.001)], settings=SETTINGS))[1][0][4] == "1.200x [1.150, 1.250]"


def _table_rows_of(markdown_text, header_start):
    lines = markdown_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def test_a_multi_line_error_keeps_each_table_row_on_one_line(tmp_path):
    # Error messages often span lines (assert_close's, a traceback's); the table cell kept the line breaks, so the
    # markdown row ended mid-cell and the rest of the error became a stray paragraph, and the terminal row split.
    rng = np.random.default_rng()
    words = ["shape", "mismatch", "at", "row", str(int(rng.integers(10**6))), "|", "x"]
    error = f"AssertionError: {int(rng.integers(10**4))}\n" + "\n".join(
        " ".join(rng.permutation(words)) for _ in range(int(rng.integers(1, 5))))
    records = [
        comparison("fast", "win", 1.2, (1.1, 1.3), 0.001),
        {"kind": "comparison", "nodeid": "test_x.py::bad", "name": "bad", "verdict": "error", "error": error},
        {"kind": "measurement", "nodeid": "test_x.py::m", "name": "m", "error": "ValueError: one\r\ntwo"},
    ]
    built = report.build_report(records, settings=SETTINGS)
    for _header, rows in (report.table_rows(built), report.measurement_rows(built)):
        assert all("\n" not in cell and "\r" not in cell for row in rows for cell in row), rows
    markdown = tmp_path / "ab.md"
    report.write_markdown(built, markdown)
    text = markdown.read_text()
    for header in ("| comparison |", "| measurement |"):
        table = _table_rows_of(text, header)
        cells = [len(re.split(r"(?<!\\)\|", line)) for line in table]
        assert len(table) >= 3 and len(set(cells)) == 1, table
    assert error in text  # the full message is still there, below the table


def test_names_with_dollar_signs_are_plotted_as_written(tmp_path, monkeypatch):
    # matplotlib reads text between two $ as TeX: a comparison named "cost $\foo$" (any unknown command) raised a
    # ValueError out of the plot at the end of the run, so the run ended in a traceback with no markdown written,
    # and a name such as "$5 vs $6" was drawn as italic math instead of as written.
    import matplotlib.text

    from pytest_kernelcheck.results.storage import RunSpeedups

    rng = np.random.default_rng()
    word = "".join(rng.choice(list("qwzxjk"), size=5))
    name = f"cost {int(rng.integers(100))} $\\{word}$ | `{word}`"  # with the shape's, 4 dollar signs
    records = [comparison(name, "win", 1.2, (1.1, 1.3), 0.001, shape={"mode": f"${word}$"})]
    built = report.build_report(records, settings=SETTINGS)
    key = (f"test_x.py::{name}", name)
    drawn = []
    real_draw = matplotlib.text.Text.draw

    def recording_draw(self, renderer):
        drawn.append((self.get_text(), self.get_parse_math()))
        return real_draw(self, renderer)

    monkeypatch.setattr(matplotlib.text.Text, "draw", recording_draw)
    written = report.write_all(built, tmp_path / "ab.json", [RunSpeedups("0001_old", {key: 1.1})])
    assert {path.name for path in written.paths} >= {"ab.json", "ab.md", "ab.png", "ab_trend.png"}
    assert name in (tmp_path / "ab.md").read_text().replace("\\|", "|")
    with_name = [parse_math for text, parse_math in drawn if word in text]
    assert with_name and not any(with_name), drawn
