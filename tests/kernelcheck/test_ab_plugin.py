"""End to end with pytester: --kernel-ab, the kernel_ab fixture, the report files, --kernel-ab-compare, the
--kernel-ab-compare-fail gate, saved runs, xdist."""
from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

FAST = ["--kernel-ab", "--kernel-ab-max-time", "0.2", "-p", "no:cacheprovider"]

# Sorting 2x more numbers is a difference no noisy CI machine can hide; the A/A pair must not be a win.
SORTS = """
import numpy as np
import pytest

rng = np.random.default_rng(0)
small, large = rng.random(5_000), rng.random(10_000)

def sort_small():
    return np.sort(small)

def sort_large():
    return np.sort(large)
"""


def test_without_the_option_ab_tests_are_skipped_naming_it(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_speed(kernel_ab):
    kernel_ab.assert_faster(sort_small, sort_large)
"""
    )
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*A/B speed comparisons are off; pass --kernel-ab*"])
    assert "kernel A/B comparisons" not in result.stdout.str()


def test_report_section_files_and_a_failed_comparison_that_loses_nothing(pytester):
    pytester.makepyfile(
        SORTS
        + """
@pytest.fixture(params=[{"n": 5000}], ids=["n5000"])
def shape(request):
    return request.param

def test_faster(kernel_ab, shape):
    result = kernel_ab.assert_faster(sort_small, sort_large)
    assert result.speedup > 1.5

def test_named(kernel_ab):
    kernel_ab.compare(sort_small, sort_small, name="same sort")

def test_raises(kernel_ab):
    def broken():
        raise ValueError("kernel exploded")
    kernel_ab.compare(sort_small, broken)
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "out/ab.json")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*= kernel A/B comparisons =*",
            "comparison*shape*cand ms*base ms*speedup [[]CI[]]*p*verdict*method",
            "test_faster[[]n5000[]]*n=5000*x [[]*[]]*win*cpu-clock*",
            "same sort*x [[]*[]]*cpu-clock*",
            "test_raises*CallableFailed*error*",
            "error in test_raises: CallableFailed: baseline raised ValueError during its first call: kernel exploded",
            "1 win, 0 loss, * error; geometric-mean speedup *x over 2; after Benjamini-Hochberg (FDR 0.05): *",
            "A/B report: out/ab.json, out/ab.md, out/ab.png",
        ]
    )
    data = json.loads((pytester.path / "out" / "ab.json").read_text())
    assert set(data) == {"schema", "version", "created", "settings", "environment", "summary", "comparisons", "tournaments",
                         "measurements"}
    assert data["settings"]["max_time"] == 0.2
    faster = next(r for r in data["comparisons"] if r["name"] == "test_faster[n5000]")
    for key in ("nodeid", "name", "shape", "verdict", "speedup", "ci", "p_value", "candidate_ms", "baseline_ms",
                "n_pairs", "method", "samples", "p_bh", "verdict_bh", "clock", "throttled"):
        assert key in faster, key
    assert faster["nodeid"] == "test_report_section_files_and_a_failed_comparison_that_loses_nothing.py::test_faster[n5000]"
    assert faster["shape"] == {"n": 5000} and faster["verdict"] == "win"
    samples = faster["samples"]
    assert len(samples["candidate_ms"]) == len(samples["baseline_ms"]) == len(samples["candidate_first"]) == faster["n_pairs"]
    assert faster["candidate_ms"] < faster["baseline_ms"]
    assert {"machine_info", "commit_info", "packages", "gpu"} <= set(data["environment"])
    assert "| test_faster[n5000] | n=5000 |" in (pytester.path / "out" / "ab.md").read_text()
    assert (pytester.path / "out" / "ab.png").read_bytes()[:4] == b"\x89PNG"


def test_assert_faster_failure_message_carries_the_numbers(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_not_faster(kernel_ab):
    kernel_ab.assert_faster(sort_small, sort_small, name="a against itself", alpha=0.001)

def test_not_slower_passes_on_a_tie(kernel_ab):
    kernel_ab.assert_not_slower(sort_small, sort_small, alpha=0.001)

def test_not_slower_fails_on_a_loss(kernel_ab):
    kernel_ab.assert_not_slower(sort_large, sort_small)
"""
    )
    result = pytester.runpytest(*FAST)
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*KernelABAssertionError: a against itself: candidate is not faster than baseline; verdict *: paired "
            "speedup *x, *% CI [[]*, *[]], p=* (adjusted for * looks; raw *), n=* pairs, median candidate * ms, "
            "baseline * ms (cpu-clock*)",
            "*KernelABAssertionError: test_not_slower_fails_on_a_loss: candidate is slower than baseline; verdict loss: "
            "paired speedup 0.*x*",
        ]
    )


def test_compare_with_an_earlier_report_flags_a_regression(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_sorts(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, name="small vs large")
"""
    )
    first = pytester.runpytest(*FAST, "--kernel-ab-report", "first.json")
    first.assert_outcomes(passed=1)
    earlier = json.loads((pytester.path / "first.json").read_text())
    # Pretend the last run was far faster, so this run's interval sits entirely below it.
    earlier["comparisons"][0].update(speedup=50.0, ci=[45.0, 55.0], verdict="win")
    (pytester.path / "first.json").write_text(json.dumps(earlier))
    second = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json", "--kernel-ab-report", "second.json")
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(
        [
            "comparison*verdict*method*vs last run",
            # The batch count of a host timer can differ between the runs: the row then says so between the two.
            "small vs large*REGRESSION: was 50.000x win*interval now below the last run's*",
            "*vs last run: 1 row(s) got slower (interval below the earlier one, or win to loss)",
        ]
    )
    record = json.loads((pytester.path / "second.json").read_text())["comparisons"][0]
    assert record["vs_last"]["regression"] is True


def test_tournament_is_reported(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_variants(kernel_ab):
    result = kernel_ab.tournament({"small": sort_small, "large": sort_large, "small again": lambda: np.sort(small)})
    assert result.best in ("small", "small again")
    assert result.ranking[-1] == "large"
    assert "large" not in result.indistinguishable_from_best
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "t.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "tournament test_variants: best small*; indistinguishable from best: small*",
            "  ranking: small* ms > * > large * ms (*x [[]*[]] slower, win for small*)",
        ]
    )
    tournament = json.loads((pytester.path / "t.json").read_text())["tournaments"][0]
    assert tournament["ranking"][-1] == "large" and len(tournament["pairwise"]) == 3


def test_xdist_workers_results_reach_the_controller_report(pytester):
    pytester.makepyfile(
        test_one=SORTS + "\ndef test_one(kernel_ab):\n    kernel_ab.compare(sort_small, sort_large, name='one')\n",
        test_two=SORTS + "\ndef test_two(kernel_ab):\n    kernel_ab.compare(sort_small, sort_large, name='two')\n",
    )
    result = pytester.runpytest_subprocess(*FAST, "-n", "2", "--kernel-ab-report", "x.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*2 workers*"])
    result.stdout.fnmatch_lines(["*= kernel A/B comparisons =*", "one *", "two *"])
    names = sorted(r["name"] for r in json.loads((pytester.path / "x.json").read_text())["comparisons"])
    assert names == ["one", "two"]


def test_bad_inputs_in_tests_get_clear_errors(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_needs_argument(kernel_ab):
    kernel_ab.compare(lambda x: np.sort(x), sort_small)

def test_unknown_keyword(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, max_tiem=1)

def test_zero_budget(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, max_time=0)

def test_changing_output(kernel_ab):
    sizes = iter(range(1, 10**6))
    kernel_ab.compare(lambda: np.zeros(next(sizes)), sort_small)
"""
    )
    result = pytester.runpytest(*FAST)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines_random(
        [
            "*TypeError: candidate must be callable with no arguments; it requires 'x'*",
            "*TypeError: unknown budget keyword 'max_tiem'; expected one of: *",
            "*ValueError: budget max_time must be > 0, got 0",
            "*OutputChanged: candidate output is not the same after timing as on its first call: output changed: "
            "shape (1,) float64 -> *",
        ]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kernel-ab-report", "test_bad_options_are_usage_errors.py/ab.json"],
         "kernel A/B: cannot write report 'test_bad_options_are_usage_errors.py/ab.json': "
         "'test_bad_options_are_usage_errors.py' is not a directory"),
        (["--kernel-ab-compare", "missing.json"], "kernel A/B: earlier report 'missing.json' does not exist"),
        (["--kernel-ab-alpha", "2"], "kernel A/B settings: budget alpha must be between 0 and 1*"),
        (["--kernel-ab-max-time", "-1"], "kernel A/B settings: budget max_time must be > 0, got -1.0"),
        (["--kernel-ab-margin", "two"], "--kernel-ab-margin / kernel_ab_margin: not a number: 'two'"),
        (["--kernel-ab-calls-per-sample", "many"],
         "--kernel-ab-calls-per-sample / kernel_ab_calls_per_sample: 'auto' or a whole number of calls, got 'many'"),
        (["--kernel-ab-calls-per-sample", "0"], "kernel A/B settings: budget calls_per_sample must be*"),
        # str.isdigit() is true of a superscript two, which int() refuses: it once crashed pytest.
        (["--kernel-ab-calls-per-sample", "\u00b2"],
         "--kernel-ab-calls-per-sample / kernel_ab_calls_per_sample: 'auto' or a whole number of calls, got '\u00b2'"),
        (["-o", "kernel_ab_calls_per_sample=\u00b2"],
         "--kernel-ab-calls-per-sample / kernel_ab_calls_per_sample: 'auto' or a whole number of calls, got '\u00b2'"),
    ],
)
def test_bad_options_are_usage_errors(pytester, args, message):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--kernel-ab", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_ini_settings_and_help(pytester):
    pytester.makeini("[pytest]\nkernel_ab = true\nkernel_ab_max_time = 0.15\nkernel_ab_alpha = 0.01\n"
                     "kernel_ab_hold_gpu = true\nkernel_ab_ceilings = off\n")
    pytester.makepyfile(
        SORTS + "\ndef test_one(kernel_ab):\n    assert kernel_ab.compare(sort_small, sort_large).alpha == 0.01\n"
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--kernel-ab-report", "ini.json")
    result.assert_outcomes(passed=1)
    assert json.loads((pytester.path / "ini.json").read_text())["settings"] == {
        "alpha": 0.01, "margin": 0.02, "max_time": 0.15, "hold_gpu": True, "ceilings": "off"
    }
    help_text = pytester.runpytest("--help")
    help_text.stdout.fnmatch_lines(
        ["*--kernel-ab *", "*--kernel-ab-alpha*", "*--kernel-ab-margin*", "*--kernel-ab-max-time*",
         "*--kernel-ab-hold-gpu*", "*--kernel-ab-report=PATH*", "*--kernel-ab-compare=*RUN*",
         "*--kernel-ab-save=NAME*", "*--kernel-ab-ceilings={on,off}*",
         "*kernel_ab_max_time*"]
    )


def test_calls_per_sample_pinned_for_the_session_times_every_comparison_alike(pytester):
    # "auto" batches calls shorter than 50 us, so one comparison near that size may be timed differently in two
    # runs; the option pins the count for every comparison that does not name its own.
    pytester.makepyfile(
        SORTS
        + """
def test_default(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, name="pinned by the session")

def test_own(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, name="its own count", calls_per_sample=2)
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-calls-per-sample", "3", "--kernel-ab-report", "pinned.json")
    result.assert_outcomes(passed=2)
    written = json.loads((pytester.path / "pinned.json").read_text())
    by_name = {row["name"]: row for row in written["comparisons"]}
    assert by_name["pinned by the session"]["calls_per_sample"] == 3
    assert by_name["pinned by the session"]["method"].endswith("-batched x3")
    assert by_name["its own count"]["calls_per_sample"] == 2
    assert written["settings"]["calls_per_sample"] == 3
    pytester.makeini("[pytest]\nkernel_ab_calls_per_sample = 4\n")
    result = pytester.runpytest(*FAST, "-k", "default", "--kernel-ab-report", "ini.json")
    result.assert_outcomes(passed=1, deselected=1)
    assert json.loads((pytester.path / "ini.json").read_text())["comparisons"][0]["calls_per_sample"] == 4


def test_report_that_cannot_be_written_at_the_end_is_a_message_not_a_traceback(pytester):
    pytester.makepyfile(
        SORTS
        + """
import os

def test_one(kernel_ab):
    kernel_ab.compare(sort_small, sort_large)
    os.mkdir("gone.json")  # the report path turns into a directory during the run
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "gone.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["A/B report not written: cannot write report 'gone.json': *"])
    assert "Traceback" not in result.stdout.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # CI must notice the missing report
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith(".gone")) == []  # no temporary left


def test_a_report_folder_that_becomes_a_file_fails_the_session_naming_path_and_error(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_one(kernel_ab):
    kernel_ab.compare(sort_small, sort_large)
    open("out", "w").close()  # the report's folder (created when written) is taken by a file during the run
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "out/ab.json")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stdout.fnmatch_lines(
        ["A/B report not written: cannot write report 'out/ab.json': [[]Errno 17[]] File exists: 'out' (exit status 4)"]
    )
    # The rewrite while the run went (after the test, when the folder was already a file) failed first, and says so.
    result.stdout.fnmatch_lines(["*A/B report not rewritten while the run went: cannot write report 'out/ab.json'*"])


def test_a_report_written_in_a_failing_run_keeps_the_failure_exit_status(pytester):
    pytester.makepyfile(
        SORTS
        + """
import os

def test_one(kernel_ab):
    kernel_ab.compare(sort_small, sort_large)
    os.mkdir("gone.json")
    assert False, "the test itself fails"
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "gone.json")
    result.assert_outcomes(failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the failed test is the more important news
    result.stdout.fnmatch_lines(["A/B report not written: cannot write report 'gone.json': *"])


def test_shape_marker_cases_are_recorded_as_dicts(pytester):
    pytester.makepyfile(
        SORTS
        + """
@pytest.mark.shape(dict(n=2000), dict(n=4000))
def test_cases(kernel_ab, shape):
    data = np.random.default_rng(0).random(shape.n)
    kernel_ab.compare(lambda: np.sort(data), lambda: np.sort(np.concatenate([data, data])))
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "s.json")
    result.assert_outcomes(passed=2)
    shapes = sorted(r["shape"]["n"] for r in json.loads((pytester.path / "s.json").read_text())["comparisons"])
    assert shapes == [2000, 4000]


def test_fixture_object_names_records_and_keeps_failures():
    from pytest_kernelcheck import Budget, KernelAB
    from pytest_kernelcheck.speed.timing import CallableFailed, SimulatedTimer

    records = []
    ab = KernelAB(Budget(max_time=0.1), nodeid="t.py::test_x", test_name="test_x",
                  shape=lambda: {"S": 64}, record=records.append)
    a, b = (lambda: None), (lambda: None)
    timer = SimulatedTimer({a: lambda rng, now: 1e-3, b: lambda rng, now: 2e-3})
    first = ab.compare(a, b, timer=timer)
    second = ab.compare(a, b, timer=timer)
    assert (first.name, second.name) == ("test_x", "test_x #2")
    assert first.verdict == "win" and first.speedup == pytest.approx(2.0) and first.shape == {"S": 64}

    def broken():
        raise RuntimeError("no kernel image")

    with pytest.raises(CallableFailed, match="candidate raised RuntimeError"):
        ab.compare(broken, b, name="broken")
    assert [r["verdict"] for r in records] == ["win", "win", "error"]
    assert records[2]["name"] == "broken" and "no kernel image" in records[2]["error"]
    assert records[0]["nodeid"] == "t.py::test_x" and records[0]["shape"] == {"S": 64}
    json.dumps(records)  # records are plain JSON


def test_a_name_used_twice_in_one_test_is_refused_naming_it_and_the_test():
    from pytest_kernelcheck import Budget, KernelAB
    from pytest_kernelcheck.speed.timing import CallableFailed, SimulatedTimer

    records = []
    ab = KernelAB(Budget(max_time=0.1), nodeid="t.py::test_x", test_name="test_x", record=records.append)
    a, b = (lambda: None), (lambda: None)
    timer = SimulatedTimer({a: lambda rng, now: 1e-3, b: lambda rng, now: 2e-3})
    ab.compare(a, b, name="fused", timer=timer)
    # The report and --kernel-ab-compare tell results apart by test and name: a second "fused" would be matched
    # to the first one's earlier row, so a regression in it could hide.
    with pytest.raises(ValueError, match=r"kernel_ab name 'fused' is already used in t\.py::test_x"):
        ab.compare(b, a, name="fused", timer=timer)
    with pytest.raises(ValueError, match=r"kernel_ab name 'fused' is already used"):
        ab.tournament({"a": a, "b": b}, name="fused", timer=timer)

    def broken():
        raise RuntimeError("no kernel image")

    with pytest.raises(CallableFailed):
        ab.compare(broken, b, name="broken", timer=timer)
    with pytest.raises(ValueError, match="'broken' is already used"):  # its error row holds the name
        ab.compare(a, b, name="broken", timer=timer)
    assert ab.compare(a, b, timer=timer).name == "test_x"  # unnamed: the test's name
    with pytest.raises(ValueError, match="'test_x' is already used"):
        ab.compare(a, b, name="test_x", timer=timer)
    ab.compare(a, b, name="test_x #2", timer=timer)
    assert ab.tournament({"a": a, "b": b}, timer=timer).name == "test_x #3"  # automatic names step over given ones
    assert [r["name"] for r in records] == ["fused", "broken", "test_x", "test_x #2", "test_x #3"]


@pytest.mark.parametrize("name", ["", "   ", "fused\nkernel"])
def test_a_blank_or_multiline_name_is_refused_before_anything_runs(name):
    # "" made an unlabelled report row; a line break split the markdown row and the summary line.
    from pytest_kernelcheck import Budget, KernelAB
    from pytest_kernelcheck.speed.timing import SimulatedTimer

    records, calls = [], []
    ab = KernelAB(Budget(max_time=0.1), nodeid="t.py::test_x", test_name="test_x", record=records.append)
    a, b = (lambda: calls.append("a")), (lambda: calls.append("b"))
    timer = SimulatedTimer({a: lambda rng, now: 1e-3, b: lambda rng, now: 2e-3})
    for run in (lambda: ab.compare(a, b, name=name, timer=timer),
                lambda: ab.tournament({"a": a, "b": b}, name=name, timer=timer),
                lambda: ab.measure(a, name=name, timer=timer)):
        with pytest.raises(ValueError, match="name must be a non-empty, one-line label"):
            run()
    assert records == [] and calls == []
    assert ab.compare(a, b, name=7, timer=timer).name == "7"  # any other value stands as its text, as before


def test_two_comparisons_with_one_name_fail_the_test_and_only_the_first_is_reported(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_twice(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, name="sort")
    kernel_ab.compare(sort_large, sort_small, name="sort")
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "d.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*ValueError: kernel_ab name 'sort' is already used in "
         "test_two_comparisons_with_one_name_fail_the_test_and_only_the_first_is_reported.py::test_twice;*"]
    )
    assert [r["name"] for r in json.loads((pytester.path / "d.json").read_text())["comparisons"]] == ["sort"]


# Simulated timers of known effect: the candidate takes CANDIDATE_MS, the baseline BASELINE_MS, 2 ms unless a test
# appends another value (speedup BASELINE_MS / CANDIDATE_MS).
SIMULATED = """
from pytest_kernelcheck.speed.timing import SimulatedTimer

CANDIDATE_MS = {candidate_ms}
BASELINE_MS = 2.0

def candidate():
    pass

def baseline():
    pass

def test_fused(kernel_ab):
    timer = SimulatedTimer({{candidate: lambda rng, now: CANDIDATE_MS * 1e-3 * (1 + 0.01 * rng.random()),
                            baseline: lambda rng, now: BASELINE_MS * 1e-3 * (1 + 0.01 * rng.random())}})
    kernel_ab.compare(candidate, baseline, name="fused", timer=timer)
"""


def _planted_regression(pytester, *args, runner=None):
    """A first run where the candidate wins 2x, then the same test where it loses 1.5x, compared with the first."""
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    first = pytester.runpytest(*FAST, "--kernel-ab-report", "first.json")
    first.assert_outcomes(passed=1)
    assert json.loads((pytester.path / "first.json").read_text())["comparisons"][0]["verdict"] == "win"
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=3.0))
    return (runner or pytester.runpytest)(*FAST, "--kernel-ab-compare", "first.json", *args)


def test_the_gate_fails_the_session_on_a_planted_regression_and_lists_it(pytester):
    result = _planted_regression(pytester, "--kernel-ab-compare-fail", "verdict",
                                 "--kernel-ab-compare-fail", "speedup:5%")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*= kernelcheck: regressions =*",
            "test_sim.py::test_fused / fused [[]verdict[]]: verdict went from win to loss",
            "  was *x [[]*, *[]] win",
            "  now 0.6*x [[]*, *[]] loss",
            "test_sim.py::test_fused / fused [[]speedup:5%[]]: interval wholly more than 5% below the earlier speedup*",
            "the gate fails the session (--kernel-ab-compare-fail): 2 finding(s) of its rules: verdict 1 (verdict "
            "worse than in the compared run); speedup:5% 1 (speedup more than 5% below the compared run's)",
        ]
    )


def test_without_the_gate_the_same_regression_only_reports(pytester):
    result = _planted_regression(pytester)
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["fused*REGRESSION: was *x win*"])
    assert "kernelcheck: regressions" not in result.stdout.str()


def test_a_baseline_twice_as_slow_as_last_run_is_named_beside_an_unchanged_speedup(pytester):
    # The same 2x speedup with both sides twice as slow: no regression, but the row says the baseline moved.
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    pytester.runpytest(*FAST, "--kernel-ab-report", "first.json").assert_outcomes(passed=1)
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=2.0) + "BASELINE_MS = 4.0\n")
    result = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json", "--kernel-ab-report", "second.json")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["fused*was *x win (baseline 2.0* ms a call then, 4.0* ms now (*x))*"])
    change = json.loads((pytester.path / "second.json").read_text())["comparisons"][0]["vs_last"]["baseline_change"]
    assert change.startswith("baseline 2.0") and " ms a call then, 4.0" in change


def test_the_gate_from_the_ini_file_and_a_passing_gate(pytester):
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    pytester.runpytest(*FAST, "--kernel-ab-report", "first.json").assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nkernel_ab_compare_fail =\n    verdict\n    speedup:50%\n")
    same = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json")
    assert same.ret == pytest.ExitCode.OK and "kernelcheck: regressions" not in same.stdout.str()
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=3.0))
    worse = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json")
    assert worse.ret == pytest.ExitCode.TESTS_FAILED
    worse.stdout.fnmatch_lines(["*[[]verdict[]]*", "*[[]speedup:50%[]]*"])


def test_the_gate_decides_on_the_xdist_controller_from_merged_records(pytester):
    result = _planted_regression(pytester, "-n", "2", "--kernel-ab-compare-fail", "verdict",
                                 runner=pytester.runpytest_subprocess)
    result.stdout.fnmatch_lines(["*2 workers*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*= kernelcheck: regressions =*", "*fused [[]verdict[]]: verdict went from win to loss"]
    )


def test_a_failing_run_keeps_its_status_when_the_gate_also_trips(pytester):
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=3.0) + "\ndef test_broken():\n    assert False\n")
    result = pytester.runpytest(*FAST, "--kernel-ab-compare-fail", "loss")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*= kernelcheck: regressions =*"])


def test_the_loss_gate_trips_on_real_cpu_work_three_times_the_baseline(pytester):
    pytester.makepyfile(
        """
import numpy as np

data = np.random.default_rng(0).random(20_000)
triple = np.concatenate([data, data, data])

def test_slower_candidate(kernel_ab):
    kernel_ab.compare(lambda: triple.sum(), lambda: data.sum(), name="3x the work")
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-compare-fail", "loss")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*= kernelcheck: regressions =*",
            "*::test_slower_candidate / 3x the work [[]loss[]]: this run's verdict is loss",
            "  now 0.*x [[]*[]] loss",
        ]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kernel-ab-compare-fail", "faster"],
         "kernel A/B: --kernel-ab-compare-fail / kernel_ab_compare_fail: 'faster' is not a rule; accepted: "
         "'verdict', 'speedup:X%' (X a percentage such as 5 or 2.5) or 'loss'"),
        (["--kernel-ab-compare-fail", "verdict"],
         "kernel A/B: --kernel-ab-compare-fail verdict needs --kernel-ab-compare (an earlier run)"),
        (["--kernel-ab-compare-fail", "loss", "--kernel-ab-compare-fail", "speedup:5%"],
         "kernel A/B: --kernel-ab-compare-fail speedup:5% needs --kernel-ab-compare (an earlier run)"),
    ],
)
def test_bad_gate_expressions_are_usage_errors(pytester, args, message):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--kernel-ab", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def _machine_folder(storage_root):
    """The one machine folder a run made under ``storage_root``."""
    folders = [p for p in storage_root.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def test_saved_runs_are_numbered_per_machine_and_compared_by_number_name_and_latest(pytester):
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    first = pytester.runpytest(*FAST, "--kernel-ab-save", "before")
    first.assert_outcomes(passed=1)
    folder = _machine_folder(pytester.path / ".kernelcheck")
    assert folder.name.startswith(("cpu_", "nvidia"))  # the machine's slug
    first.stdout.fnmatch_lines([f"A/B run saved: {folder / '0001_before.json'}"])
    saved = json.loads((folder / "0001_before.json").read_text())
    assert saved["comparisons"][0]["verdict"] == "win" and "cpu_model" in saved["environment"]

    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=3.0))
    second = pytester.runpytest(*FAST, "--kernel-ab-save", "after")
    second.assert_outcomes(passed=1)
    assert sorted(p.name for p in folder.iterdir()) == ["0001_before.json", "0002_after.json"]

    by_number = pytester.runpytest(*FAST, "--kernel-ab-compare", "0001", "--kernel-ab-compare-fail", "verdict")
    assert by_number.ret == pytest.ExitCode.TESTS_FAILED  # 0001 won, this run loses
    by_number.stdout.fnmatch_lines(["fused*REGRESSION: was *x win*", "*= kernelcheck: regressions =*"])
    by_name = pytester.runpytest(*FAST, "--kernel-ab-compare", "before")
    by_name.stdout.fnmatch_lines(["fused*REGRESSION: was *x win*"])
    # Alone (here followed by another option) it means the latest saved run, 0002, which lost too: no regression.
    latest = pytester.runpytest(*FAST, "--kernel-ab-compare", "--kernel-ab-compare-fail", "verdict")
    assert latest.ret == pytest.ExitCode.OK
    latest.stdout.fnmatch_lines(["fused*was *x loss"])
    last_alone = pytester.runpytest(*FAST, "--kernel-ab-compare")
    last_alone.stdout.fnmatch_lines(["fused*was *x loss"])
    assert len(list(folder.iterdir())) == 2  # comparing saves nothing


def test_autosave_names_runs_by_commit_and_time_in_the_storage_folder(pytester):
    import re

    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    pytester.makeini("[pytest]\nkernel_ab_autosave = true\nkernel_ab_storage = runs\n")
    pytester.runpytest(*FAST).assert_outcomes(passed=1)
    pytester.runpytest(*FAST, "--kernel-ab-save", "named").assert_outcomes(passed=1)  # the given name wins
    names = sorted(p.name for p in _machine_folder(pytester.path / "runs").iterdir())
    assert len(names) == 2 and names[1] == "0002_named.json"
    # pytester's folder is no git work tree: "nocommit" (a repository gives its short hash, -dirty with changes).
    assert re.fullmatch(r"0001_nocommit_\d{8}T\d{6}Z\.json", names[0]), names
    pytester.runpytest(*FAST, "--kernel-ab-storage", "elsewhere", "--kernel-ab-autosave").assert_outcomes(passed=1)
    assert len(list(_machine_folder(pytester.path / "elsewhere").iterdir())) == 1


@pytest.mark.parametrize(
    "save_first, args, message",
    [
        (False, ["--kernel-ab-compare"],
         "kernel A/B: --kernel-ab-compare latest: no saved runs for this machine in '*.kernelcheck*'; save one with "
         "--kernel-ab-save NAME or --kernel-ab-autosave"),
        (True, ["--kernel-ab-compare", "7"],
         "kernel A/B: --kernel-ab-compare 7: no saved run number 0007 for this machine in '*' "
         "(latest saved: 0001_base.json)"),
        (True, ["--kernel-ab-compare", "nope"],
         "kernel A/B: --kernel-ab-compare nope: no saved run named 'nope' for this machine in '*' "
         "(latest saved: 0001_base.json)"),
        (False, ["--kernel-ab-save", "12"], "kernel A/B: --kernel-ab-save: name '12' is all digits*"),
        (False, ["--kernel-ab-save", "a/b"], "kernel A/B: --kernel-ab-save: name 'a/b' must start with*"),
        # An empty name (an unset variable in a CI script) once saved nothing and said nothing.
        (False, ["--kernel-ab-save", ""], "kernel A/B: --kernel-ab-save: name '' is empty; give a name of *"),
    ],
)
def test_saved_runs_that_do_not_match_are_usage_errors_naming_the_option(pytester, save_first, args, message):
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    if save_first:
        pytester.runpytest(*FAST, "--kernel-ab-save", "base").assert_outcomes(passed=1)
    result = pytester.runpytest(*FAST, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


ANOTHER_GPU = {"available": True, "devices": ["NVIDIA H100 80GB HBM3"], "driver": "550.54", "cuda": "12.4",
               "cudnn": "90100"}


def _as_if_measured_on_another_gpu(path):
    """Rewrite the report at ``path`` as if its run had been on an H100 (this machine has no such GPU)."""
    data = json.loads(path.read_text())
    data["environment"]["gpu"] = ANOTHER_GPU
    path.write_text(json.dumps(data))


def test_comparing_with_a_report_of_another_machine_warns_in_the_summary_the_report_and_the_gate(pytester):
    # A report named by its path is compared on purpose: the gate still decides, and every output says the
    # earlier run was on another machine, so that a regression is not taken for the code's without thought.
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    pytester.runpytest(*FAST, "--kernel-ab-report", "first.json").assert_outcomes(passed=1)
    same = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json", "--kernel-ab-report", "same.json")
    assert "WARNING" not in same.stdout.str()
    assert "machine_differences" not in json.loads((pytester.path / "same.json").read_text())
    _as_if_measured_on_another_gpu(pytester.path / "first.json")
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=3.0))
    result = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json", "--kernel-ab-compare-fail", "verdict",
                                "--kernel-ab-report", "second.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "WARNING: the earlier run was measured on another machine (GPU NVIDIA H100 80GB HBM3 then, none now; "
        "driver 550.54 then, none now; CUDA 12.4 then, none now; cuDNN 90100 then, none now): its speedups may "
        "differ for the machine, not the code",
        "*= kernelcheck: regressions =*",
        "test_sim.py::test_fused / fused [[]verdict[]]: verdict went from win to loss",
        "WARNING: compared with a run of another machine (GPU NVIDIA H100 80GB HBM3 then, none now; *): a "
        "regression may be the machine's, not the code's",
    ])
    second = json.loads((pytester.path / "second.json").read_text())
    assert second["machine_differences"][0] == "GPU NVIDIA H100 80GB HBM3 then, none now"
    assert "WARNING: the earlier run was measured on another machine" in (pytester.path / "second.md").read_text()


def test_a_saved_run_of_another_machine_is_refused_before_the_tests_run(pytester):
    # A saved run picked by number, name or latest is meant to be this machine's: one of another machine (here
    # copied into this machine's folder) would let the gate judge this run by another machine's speeds.
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    pytester.runpytest(*FAST, "--kernel-ab-save", "base").assert_outcomes(passed=1)
    saved = _machine_folder(pytester.path / ".kernelcheck") / "0001_base.json"
    _as_if_measured_on_another_gpu(saved)
    result = pytester.runpytest(*FAST, "--kernel-ab-compare-fail", "verdict", "--kernel-ab-compare")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*kernel A/B: --kernel-ab-compare latest: {saved} was measured on another machine "
                                 f"(GPU NVIDIA H100 80GB HBM3 then, none now; *); compare with a run saved on this "
                                 f"machine, or give the file's path to compare with it anyway*"])
    assert "passed" not in result.stdout.str()  # refused at start-up: no test ran
    by_path = pytester.runpytest(*FAST, "--kernel-ab-compare", str(saved))
    by_path.assert_outcomes(passed=1)
    by_path.stdout.fnmatch_lines(["WARNING: the earlier run was measured on another machine (GPU NVIDIA H100*"])


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data["comparisons"][0].update(verdict="WIN"),
         "comparisons[[]0[]] ('fused'): field 'verdict': 'WIN' is refused; accepted: 'win', 'loss', 'tie', "
         "'inconclusive', 'error'"),
        (lambda data: data["comparisons"][0].pop("verdict"), "comparisons[[]0[]] ('fused'): field 'verdict' is missing*"),
        (lambda data: data.update(version=99), "field 'version': 99 is refused; accepted: 1*"),
        (lambda data: data["comparisons"][0].update(speedup=-3.0, ci=[5.0, 1.0]),
         "comparisons[[]0[]] ('fused'): field 'speedup': -3.0 is refused; accepted: a finite number above 0, or null"),
        (lambda data: data["comparisons"][0].update(ci=[5.0, 1.0]), "*field 'ci': [[]5.0, 1.0[]] is refused*"),
        (lambda data: data["comparisons"][0].update(ci=[1.1]), "*field 'ci': [[]1.1[]] is refused*"),
        (lambda data: data["comparisons"][0].update(speedup="fast"), "*field 'speedup': 'fast' is refused*"),
        (lambda data: data["comparisons"].__setitem__(0, {"kind": "comparison", "name": "fused"}),
         "*field 'verdict' is missing*"),
    ],
)
def test_a_damaged_earlier_report_is_a_usage_error_naming_the_file_and_the_field(pytester, damage, message):
    # Each of these once loaded: shown but never judged by the gate, taken for a new row, or crashing pytest
    # (a speedup "fast" only at the end, after every test had run).
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    pytester.runpytest(*FAST, "--kernel-ab-report", "first.json").assert_outcomes(passed=1)
    data = json.loads((pytester.path / "first.json").read_text())
    damage(data)
    (pytester.path / "first.json").write_text(json.dumps(data))
    result = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json", "--kernel-ab-compare-fail", "verdict")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: kernel A/B: earlier report 'first.json': {message}"])
    assert "passed" not in result.stdout.str()  # refused at start-up: no test ran


def test_the_markdown_report_shows_the_speedups_of_the_last_saved_runs(pytester):
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=1.0))
    pytester.runpytest(*FAST, "--kernel-ab-save", "before").assert_outcomes(passed=1)
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=3.0))
    pytester.runpytest(*FAST, "--kernel-ab-save", "after").assert_outcomes(passed=1)
    pytester.makepyfile(test_sim=SIMULATED.format(candidate_ms=2.0))
    pytester.runpytest(*FAST, "--kernel-ab-report", "r.json", "--kernel-ab-save", "third").assert_outcomes(passed=1)
    lines = (pytester.path / "r.md").read_text().splitlines()
    start = lines.index("## Speedup history: last 2 saved run(s) of this machine")
    assert lines[start + 2] == "| comparison | shape | 0001_before | 0002_after | this run |"
    assert lines[start + 4].startswith("| fused |  | ")
    speedups = [float(cell.rstrip("x")) for cell in lines[start + 4].strip("| ").split(" | ")[2:]]
    assert speedups == [pytest.approx(2.0, rel=0.02), pytest.approx(2 / 3, rel=0.02), pytest.approx(1.0, rel=0.02)]
    assert "![Speedup with its interval per saved run](r_trend.png)" in lines
    assert (pytester.path / "r_trend.png").read_bytes()[:4] == b"\x89PNG"

    pytester.runpytest(*FAST, "--kernel-ab-report", "one.json", "--kernel-ab-history", "1").assert_outcomes(passed=1)
    assert "| comparison | shape | 0003_third | this run |" in (pytester.path / "one.md").read_text()
    pytester.runpytest(*FAST, "--kernel-ab-report", "none.json", "--kernel-ab-history", "0").assert_outcomes(passed=1)
    assert "Speedup history" not in (pytester.path / "none.md").read_text()
    assert not (pytester.path / "none_trend.png").exists()


def test_a_bad_history_count_is_a_usage_error(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--kernel-ab", "--kernel-ab-history", "-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kernel-ab-history / kernel_ab_history: not a count >= 0: '-1'*"])


RATED = """
import pytest
from pytest_kernelcheck.speed.timing import SimulatedTimer

def candidate():
    pass

def baseline():
    pass

@pytest.mark.shape(dict(n=1000), dtype=["bfloat16"])
def test_rated(kernel_ab, shape):
    timer = SimulatedTimer({candidate: lambda rng, now: 2e-3, baseline: lambda rng, now: 4e-3})
    kernel_ab.compare(candidate, baseline, name="rated", timer=timer, flops=lambda s: 2 * s.n ** 3,
                      bytes=lambda s: 4 * s.n * 1000)

def test_measured(kernel_ab):
    fn = lambda: None
    timer = SimulatedTimer({fn: lambda rng, now: 1e-3})
    result = kernel_ab.measure(fn, flops=1e9, bytes=1e6, dtype="float32", timer=timer, name="alone")
    assert result.median_ms == pytest.approx(1.0) and result.stop_reason == "precise"
"""

# The conftest a project writes to inject its own ceilings; this one counts what it is asked to measure.
FAKE_CEILINGS = """
import pytest
from pytest_kernelcheck.results.records import CeilingRecord
from pytest_kernelcheck import CeilingMeter

@pytest.fixture(scope="session")
def kernel_ab_ceilings():
    return CeilingMeter(measure=lambda timer, dtype: CeilingRecord("fake gpu", dtype, tflops=4.0, gbps=2.0))
"""


def test_throughput_ceilings_measurements_and_roofline_end_to_end(pytester):
    pytester.makeconftest(FAKE_CEILINGS)
    pytester.makepyfile(test_rated=RATED)
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "r.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "comparison*cand ms*base ms*TFLOP/s cand/base*GB/s cand/base*speedup [[]CI[]]*",
        "rated*bfloat16*2*4*1 / 0.5 (25% of ceiling)*2 / 1 (100% of ceiling)*2.000x*win*simulated*",
        "measurement*median ms*CI ms*n*TFLOP/s*GB/s*method",
        "alone*1*[[]1, 1[]]*20*1 (25% of ceiling)*1 (50% of ceiling)*simulated",
        "Ceiling of fake gpu, bfloat16: 4 TFLOP/s; 2 GB/s",
        "A/B report: r.json, r.md, r.png, r_roofline.png",
    ])
    data = json.loads((pytester.path / "r.json").read_text())
    rated = data["comparisons"][0]["throughput"]
    assert rated["candidate"] == {"flops": 2e9, "bytes": 4e6, "tflops": pytest.approx(1.0),
                                  "gbps": pytest.approx(2.0), "tflops_pct": pytest.approx(25.0),
                                  "gbps_pct": pytest.approx(100.0)}
    assert rated["baseline"]["tflops"] == pytest.approx(0.5)
    ceilings = data["environment"]["ceilings"]
    assert ceilings["enabled"] is True
    assert sorted(c["dtype"] for c in ceilings["measured"]) == ["bfloat16", "float32"]  # once each, from the records
    measurement = data["measurements"][0]
    assert (measurement["name"], measurement["median_ms"], measurement["ci_ms"]) == ("alone", 1.0, [1.0, 1.0])
    assert len(measurement["samples"]["ms"]) == measurement["n_samples"] == 20
    assert data["summary"]["measurements"] == 1
    markdown = (pytester.path / "r.md").read_text()
    assert "| alone |  | 1 | [1, 1] | 20 | 1 (25% of ceiling) | 1 (50% of ceiling) | simulated |" in markdown
    assert "](r_roofline.png)" in markdown
    assert (pytester.path / "r_roofline.png").read_bytes()[:4] == b"\x89PNG"


def test_cpu_runs_get_rates_without_a_ceiling_and_off_skips_the_measurement(pytester):
    pytester.makepyfile(SORTS + """
def test_rated(kernel_ab):
    result = kernel_ab.compare(sort_small, sort_large, flops=5_000 * 13, bytes=40_000, dtype="float64")
    assert result.candidate_throughput.tflops > 0 and result.candidate_throughput.tflops_pct is None
""")
    on = pytester.runpytest(*FAST, "--kernel-ab-report", "on.json")
    on.assert_outcomes(passed=1)
    on.stdout.fnmatch_lines(["Ceiling of cpu-clock, float64: not measured: ceilings are measured on CUDA devices "
                             "only, and this ran on the CPU clock"])
    row = json.loads((pytester.path / "on.json").read_text())["comparisons"][0]
    assert row["ceiling"]["tflops"] is None and row["throughput"]["candidate"]["gbps"] > 0
    off = pytester.runpytest(*FAST, "--kernel-ab-report", "off.json", "--kernel-ab-ceilings", "off")
    off.assert_outcomes(passed=1)
    off.stdout.fnmatch_lines(["Ceilings: not measured (--kernel-ab-ceilings off)"])
    data = json.loads((pytester.path / "off.json").read_text())
    assert "ceiling" not in data["comparisons"][0]
    assert data["environment"]["ceilings"] == {"enabled": False, "measured": []}
    assert data["settings"]["ceilings"] == "off"


def test_bad_work_counts_fail_the_test_naming_the_argument(pytester):
    pytester.makepyfile(SORTS + """
def test_negative(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, flops=-1)

def test_garbage_from_the_callable(kernel_ab, shape):
    kernel_ab.measure(sort_small, bytes=lambda s: "lots")

def test_callable_without_a_shape(kernel_ab):
    kernel_ab.tournament({"a": sort_small, "b": sort_large}, flops={"a": lambda s: 1})

@pytest.fixture
def shape():
    return {"n": 5}
""")
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "bad.json")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines_random([
        "E * ValueError: flops= must be a finite number >= 0 per call, got -1",
        "E * TypeError: bytes= (returned by its callable for shape {'n': 5}) must be a number per call (int or "
        "float), got str: 'lots'",
        "E * TypeError: variant 'a': flops= is a callable of the test's shape, but this test has no shape*",
    ])
    data = json.loads((pytester.path / "bad.json").read_text())
    assert [row["verdict"] for row in data["comparisons"]] == ["error"]
    assert data["measurements"][0]["error"].startswith("TypeError: bytes=")
    assert data["tournaments"][0]["verdict"] == "error"


def test_a_bad_ceilings_setting_is_a_usage_error(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.makeini("[pytest]\nkernel_ab_ceilings = maybe\n")
    result = pytester.runpytest("--kernel-ab")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kernel-ab-ceilings / kernel_ab_ceilings: 'on' or 'off', got 'maybe'*"])


def test_inputs_owned_by_the_plugin_end_to_end(pytester):
    pytester.makepyfile(
        """
import numpy as np

rng = np.random.default_rng(0)
make = lambda: (rng.random(1000),)

def test_owned(kernel_ab):
    result = kernel_ab.compare(lambda x: x * 2, lambda x: x + x, inputs=make)
    assert result.input_sets == 3

def test_cached(kernel_ab):
    kept = {}
    kernel_ab.compare(lambda x: kept.setdefault("out", x * 2), lambda x: x + x, inputs=make, name="cached")
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "r.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*the candidate returns the same output for different inputs*"])
    rows = {row["name"]: row for row in json.loads((pytester.path / "r.json").read_text())["comparisons"]}
    assert rows["test_owned"]["input_sets"] == 3
    assert any("3 input sets" in note for note in rows["test_owned"]["notes"])


def test_cpu_threads_option_sets_torch_threads_during_comparisons_and_records_them(pytester):
    pytester.makepyfile(
        """
import torch

seen = []
x = torch.randn(64, 64)

def test_threads(kernel_ab):
    before = torch.get_num_threads()
    kernel_ab.compare(lambda: seen.append(torch.get_num_threads()) or x @ x, lambda: x @ x, check_output=False)
    assert set(seen) == {1}
    assert torch.get_num_threads() == before
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-cpu-threads", "1", "--kernel-ab-report", "r.json")
    result.assert_outcomes(passed=1)
    assert json.loads((pytester.path / "r.json").read_text())["environment"]["cpu_threads"] == 1
    bad = pytester.runpytest(*FAST, "--kernel-ab-cpu-threads", "0")
    bad.stderr.fnmatch_lines(["*--kernel-ab-cpu-threads / kernel_ab_cpu_threads: not a count >= 1*"])


# A run killed before its end (SIGKILL at a CI time limit, or an interrupt the process never returns from) still
# leaves, at the report's path, the comparisons it had finished, marked unfinished: the report is rewritten while
# the run goes (report.ProgressWriter; the first record at once), and the finished report replaces it at the end.
def test_a_run_killed_before_its_end_leaves_what_it_finished_marked_unfinished(pytester):
    pytester.makepyfile(
        SORTS
        + """
import os
import signal

def test_a_first(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, name="finished before the kill")

def test_b_killed(kernel_ab):
    os.kill(os.getpid(), signal.SIGKILL)  # what a time limit's kill does: no session finish, no summary
"""
    )
    result = pytester.runpytest_subprocess(*FAST, "--kernel-ab-report", "ab.json")
    assert result.ret not in (0, 1)  # killed, not failed
    written = json.loads((pytester.path / "ab.json").read_text())
    assert written["finished"] is False
    assert [row["name"] for row in written["comparisons"]] == ["finished before the kill"]
    # Its verdict, whatever a loaded machine makes of 0.2 s of sampling, and its samples are all there.
    row = written["comparisons"][0]
    assert row["verdict"] in ("win", "inconclusive") and written["summary"]["comparisons"] == 1
    assert row["n_pairs"] > 0 and len(row["samples"]["candidate_ms"]) == row["n_pairs"]
    assert not (pytester.path / "ab.md").exists()  # the markdown and plots come only with the finished report


def test_a_finished_run_replaces_the_progress_report_and_is_not_marked(pytester):
    pytester.makepyfile(
        SORTS
        + """
def test_one(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, name="one")

def test_two(kernel_ab):
    kernel_ab.compare(sort_small, sort_small, name="two")
"""
    )
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "ab.json")
    result.assert_outcomes(passed=2)
    written = json.loads((pytester.path / "ab.json").read_text())
    assert "finished" not in written and sorted(row["name"] for row in written["comparisons"]) == ["one", "two"]


def test_comparing_with_an_unfinished_report_says_so(pytester):
    from pytest_kernelcheck.results.report import build_report, write_json
    first = build_report([{"kind": "comparison", "nodeid": "test_compare_unfinished.py::test_sorts", "name": "sorts",
                           "verdict": "win", "speedup": 2.0, "ci": [1.9, 2.1], "p_value": 0.001}],
                         settings={"alpha": 0.05}, finished=False)
    write_json(first, pytester.path / "first.json")
    pytester.makepyfile(test_compare_unfinished=SORTS + """
def test_sorts(kernel_ab):
    kernel_ab.compare(sort_small, sort_large, name="sorts")
""")
    result = pytester.runpytest(*FAST, "--kernel-ab-compare", "first.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*earlier report is of a run that did not finish (1 comparisons)*"])


@pytest.mark.parametrize("option, accepted", [
    ("--kernel-ab-report", "a report path"), ("--kernel-ab-trace", "a folder"), ("--kernel-ab-storage", "a folder"),
    ("--kernel-ab-compare", "a saved run"), ("--kernel-ab-cpu-threads", "a count"),
])
def test_an_empty_value_on_the_command_line_is_a_usage_error_naming_the_option(pytester, option, accepted):
    # --kernel-ab-trace "$TRACES" with the variable unset turned profile mode off (and, without --kernel-ab, every
    # A/B test was skipped); an empty report path wrote no report; both passed without a word.
    pytester.makepyfile(SORTS + "\ndef test_one(kernel_ab):\n    kernel_ab.compare(sort_small, sort_large)\n")
    result = pytester.runpytest(*FAST, option, "")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{option}: the value is empty; give {accepted}*or leave the option out*"])
    assert "kernel A/B comparisons" not in result.stdout.str()
