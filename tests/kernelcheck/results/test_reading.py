"""A report a newcomer reads: no two numbers of a row contradict each other without the row saying why, the p-value
printed is the one the verdict used and says so, noise advice shows in the terminal, report.md and describe(), and
the gate's counts each say what they count. End to end with pytester and simulated timers."""
from __future__ import annotations

import json

import pytest

from pytest_kernelcheck.results import reading
from pytest_kernelcheck.results.build import build_report
from pytest_kernelcheck.results.records import ComparisonRecord, RunDetails

FAST = ["--kernel-ab", "--kernel-ab-max-time", "0.3", "-p", "no:cacheprovider"]

# Both sides share a machine state per pair (a thread pool that contends for the cores, or not), cycling over 20
# states. The candidate is 10% faster than the baseline in the same state, but it is slow in 11 of the 20 states where
# the baseline is slow in 9: paired, it wins in 18 pairs of 20; by each side's median, it is ~9x slower.
BIMODAL = """
from pytest_kernelcheck.speed.timing import SimulatedTimer

class SharedState(SimulatedTimer):
    rounds = 0

    def time_calls(self, fns, repeat):  # a look's pairs come in one list: candidate and baseline, in either order
        durations = []
        for pair in range(0, len(fns), 2):
            self.state = self.rounds % 20  # one state per pair: both sides see it
            self.rounds += 1
            durations += super().time_calls(fns[pair:pair + 2], repeat)
        return durations

def timed(base_ms, slow_states):
    return lambda rng, now: base_ms * (9.0 if timer.state < slow_states else 1.0) * 1e-3 * (1 + 0.01 * rng.random())

def candidate():
    pass

def baseline():
    pass

timer = SharedState({candidate: timed(0.9, 11), baseline: timed(1.0, 9)})

def test_noisy(kernel_ab):
    result = kernel_ab.compare(candidate, baseline, name="noisy", timer=timer)
    print(result.describe())
"""


def test_a_row_whose_medians_disagree_with_its_paired_speedup_says_why_everywhere(pytester):
    pytester.makepyfile(test_noisy=BIMODAL)
    result = pytester.runpytest(*FAST, "-rP", "--kernel-ab-report", "ab.json")
    result.assert_outcomes(passed=1)
    row = json.loads((pytester.path / "ab.json").read_text())["comparisons"][0]
    assert row["speedup"] > 1.02 and row["baseline_ms"] / row["candidate_ms"] < 0.5  # the planted disagreement
    result.stdout.fnmatch_lines([
        "comparison*paired speedup [[]CI[]]*p adj [[]raw[]]*verdict*notes*method",
        "noisy*(medians disagree)*[[]1[]]*simulated",
        "p adj: the signed-rank p-value times the looks planned*",
        "[[]1[]] noisy: the medians (candidate * ms, baseline * ms) give 0.*x but the paired speedup, which the "
        "verdict uses, is 1.*x: the times are spread or bimodal*",
    ])
    # describe() (printed by the test, shown by -rP) says the same, and labels its p-value.
    result.stdout.fnmatch_lines(["verdict *: paired speedup 1.*x, * p=* (adjusted for * looks; raw *), *; note: the "
                                 "medians (candidate * give 0.*x but the paired speedup*"])
    markdown = (pytester.path / "ab.md").read_text()
    assert "| paired speedup [CI] | p adj [raw] | verdict | notes | method |" in markdown
    assert "(medians disagree)" in markdown and "- [1] noisy: the medians (candidate" in markdown
    assert reading.P_LEGEND in markdown


def test_the_p_value_shown_is_the_one_the_verdict_used_with_the_raw_one_labelled():
    row = {"kind": "comparison", "name": "a", "verdict": "inconclusive", "speedup": 1.2, "ci": [0.9, 1.5],
           "p_value": 1.0, "p_value_raw": 0.36, "candidate_ms": 1.0, "baseline_ms": 1.2, "looks_planned": 11}
    built = build_report([row], settings={})
    from pytest_kernelcheck.results.report_text import table_rows

    header, rows = table_rows(built)
    assert rows[0][header.index(reading.P_HEADER)] == "1 [0.36]"
    record = ComparisonRecord.from_json(row)
    assert reading.p_text(record) == "p=1 (adjusted for 11 looks; raw 0.36)"


@pytest.mark.parametrize("speedup, ci, medians, disagree", [
    (1.086, (0.135, 3.561), 0.474, True),  # the CPU row of the issue: opposite sides of 1
    (1.5, (1.4, 1.6), 1.52, False),  # agree
    (1.01, (0.95, 1.07), 0.99, False),  # opposite sides, but both within the 2% tie band
    (1.5, (1.45, 1.55), 1.9, True),  # same side, but outside the interval and far from the paired speedup
    (1.5, (1.45, 1.51), 1.52, False),  # just outside the interval, within the margin of the speedup
])
def test_medians_disagree_when_they_would_read_as_another_answer(speedup, ci, medians, disagree):
    record = ComparisonRecord("a", "inconclusive", speedup=speedup, ci=ci, candidate_ms=1.0, baseline_ms=medians,
                              run=RunDetails(margin=0.02, method="cpu-clock"))
    assert reading.medians_disagree(record) is disagree
    note = reading.medians_note(record)
    assert (note is not None) is disagree
    if disagree:
        assert "--kernel-ab-cpu-threads 1" in note


def test_a_gpu_rows_advice_is_not_the_cpu_thread_count():
    record = ComparisonRecord("a", "inconclusive", speedup=1.2, ci=(0.5, 2.0), candidate_ms=2.0, baseline_ms=1.0,
                              run=RunDetails(method="events"))
    assert "--kernel-ab-cpu-threads" not in reading.medians_note(record)


def test_engine_notes_such_as_cpu_spread_advice_reach_the_terminal_and_markdown(pytester):
    # A candidate whose times are bimodal (half 1 ms, half 16 ms) gets the engine's spread note with its fix.
    pytester.makepyfile(test_spread="""
from pytest_kernelcheck.speed.timing import SimulatedTimer

def candidate():
    pass

def baseline():
    pass

def test_spread(kernel_ab):
    timer = SimulatedTimer({candidate: lambda rng, now: (1e-3 if rng.random() < 0.5 else 16e-3),
                            baseline: lambda rng, now: 2e-3 * (1 + 0.01 * rng.random())})
    kernel_ab.compare(candidate, baseline, name="spread", timer=timer)
""")
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "ab.json")
    result.assert_outcomes(passed=1)
    notes = json.loads((pytester.path / "ab.json").read_text())["comparisons"][0]["notes"]
    assert any("--kernel-ab-cpu-threads 1" in note for note in notes)  # a host timer's spread is checked
    result.stdout.fnmatch_lines(["*[[]*[]] spread: candidate's CPU times are bimodal*--kernel-ab-cpu-threads 1*"])
    assert "--kernel-ab-cpu-threads 1" in (pytester.path / "ab.md").read_text()
    # A run that already has one thread is not told to pass the option it passed: the advice that can still help.
    again = pytester.runpytest(*FAST, "--kernel-ab-cpu-threads", "1", "--kernel-ab-report", "ab.json")
    again.stdout.fnmatch_lines(["*[[]*[]] spread: candidate's CPU times are bimodal*already used one torch thread*"])
    assert "pass --kernel-ab-cpu-threads 1" not in again.stdout.str()
    assert "pass --kernel-ab-cpu-threads 1" not in (pytester.path / "ab.md").read_text()


SIMULATED_LOSS = """
from pytest_kernelcheck.speed.timing import SimulatedTimer

def candidate():
    pass

def baseline():
    pass

def test_fused(kernel_ab):
    timer = SimulatedTimer({candidate: lambda rng, now: 3e-3 * (1 + 0.01 * rng.random()),
                            baseline: lambda rng, now: 1e-3 * (1 + 0.01 * rng.random())})
    kernel_ab.compare(candidate, baseline, name="fused", timer=timer)
"""


def test_the_gate_counts_say_what_they_count_so_a_loss_that_did_not_move_reads_as_no_contradiction(pytester):
    # The README's flow: a loss saved, then the same loss gated by `verdict` and `loss`. Nothing got slower than in
    # the earlier run (the summary's count) while the `loss` rule fails the session (the gate's count).
    pytester.makepyfile(test_sim=SIMULATED_LOSS)
    pytester.runpytest(*FAST, "--kernel-ab-save", "first").assert_outcomes(passed=1)
    result = pytester.runpytest(*FAST, "--kernel-ab-compare-fail", "verdict", "--kernel-ab-compare-fail", "loss",
                                "--kernel-ab-compare")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*; vs last run: 0 row(s) got slower (interval below the earlier one, or win to loss)",
        "*= kernelcheck: regressions =*",
        "the gate fails the session (--kernel-ab-compare-fail): 1 finding(s) of its rules: loss 1 (a loss in this "
        "run)",
    ])
    assert "0 regression(s)" not in result.stdout.str()
