"""Timers coarser than the difference they measure: injected clocks with coarse ticks never yield a verdict the
ticks could not show, and with calls_per_sample="auto" the engine batches until a sample spans enough ticks."""
from __future__ import annotations

import random

import pytest

from pytest_kernelcheck import Budget, run_comparison
from pytest_kernelcheck.speed import timer_resolution, timing

QUICK = Budget(max_time=0.5, warmup=0.01)

pytest_plugins = ["pytester"]


class TickTimer:
    """A clock that reads whole ticks: every duration of an exact simulation, rounded to the nearest tick.
    ``declare``: whether it states its tick as ``resolution_s`` (a timer of the user's own may not)."""

    name, lock_key = "ticks", "ticks"

    def __init__(self, tick_s: float, models: dict, declare: bool = True) -> None:
        self.tick_s = tick_s
        self._exact = timing.SimulatedTimer(models)
        if declare:
            self.resolution_s = tick_s

    def time_calls(self, fns, repeat):
        return [round(d / self.tick_s) * self.tick_s for d in self._exact.time_calls(fns, repeat)]

    def now(self):
        return self._exact.now()


def _jittered(seconds: float):
    return lambda rng, now: seconds * (1 + 0.001 * rng.random())


@pytest.mark.parametrize("declare", [True, False])
def test_a_forty_percent_slower_baseline_hidden_by_the_tick_is_inconclusive_not_a_tie(declare):
    # Both sides read one 1 ms tick every time: the paired ratios are all exactly 1, a "tie" the clock never saw.
    candidate, baseline = (lambda: None), (lambda: None)
    slower = random.Random().uniform(1.2, 1.45)
    timer = TickTimer(1e-3, {candidate: _jittered(1.0e-3), baseline: _jittered(slower * 1e-3)}, declare=declare)
    result = run_comparison(candidate, baseline, QUICK.replace(calls_per_sample=1), timer=timer)
    assert result.verdict == "inconclusive"
    note = [note for note in result.notes if note.startswith("inconclusive:")]
    assert len(note) == 1 and "timer 'ticks'" in note[0] and "calls_per_sample" in note[0]
    assert ("resolution is 0.001 s" in note[0]) if declare else ("every sample of timer 'ticks' read 0.001 s" in note[0])


def test_a_real_difference_read_in_too_few_ticks_is_inconclusive_with_the_resolution_named():
    # 3 and 5 ticks a sample: a 1.67x difference shows, but one tick is a third of a sample, so no verdict is given.
    candidate, baseline = (lambda: None), (lambda: None)
    timer = TickTimer(1e-3, {candidate: _jittered(3e-3), baseline: _jittered(5e-3)})
    result = run_comparison(candidate, baseline, QUICK.replace(calls_per_sample=1), timer=timer)
    assert result.verdict == "inconclusive"
    assert any("span fewer than 100 ticks of timer 'ticks', whose resolution is 0.001 s" in note
               for note in result.notes)


def test_auto_batching_takes_enough_calls_for_a_sample_of_a_hundred_ticks_and_then_decides():
    # A 10 us tick and calls of 20 us (candidate) and 40 us (baseline): the 200 us target alone would batch 10
    # calls, 20 ticks a sample; the resolution asks for 50 calls, 100 ticks.
    candidate, baseline = (lambda: None), (lambda: None)
    timer = TickTimer(1e-5, {candidate: _jittered(20e-6), baseline: _jittered(40e-6)})
    result = run_comparison(candidate, baseline, QUICK, timer=timer)
    assert result.calls_per_sample == 50 and result.method == "ticks-batched x50"
    assert result.verdict == "win" and not any(note.startswith("inconclusive:") for note in result.notes)


def test_exact_and_fine_clocks_are_left_alone():
    candidate, baseline = (lambda: None), (lambda: None)
    exact = timing.SimulatedTimer({candidate: _jittered(1e-3), baseline: _jittered(2e-3)})
    assert run_comparison(candidate, baseline, QUICK.replace(calls_per_sample=1), timer=exact).verdict == "win"
    fine = random.Random()
    samples = [[2e-4 * (1 + 0.05 * fine.random()) for _ in range(50)], [4e-4 * (1 + 0.05 * fine.random())
                                                                        for _ in range(50)]]
    assert timer_resolution.unresolved(timing.CpuTimer(), samples) is None
    assert timer_resolution.calls_for(timing.CpuTimer(), 20e-6, 10, 1000) == 10


@pytest.mark.parametrize("single_call_s, calls", [(1e-3, 1), (2e-6, 100), (0.0, 1000)])
def test_cuda_events_batch_short_kernels_past_a_hundred_half_microsecond_ticks(single_call_s, calls):
    class Events:
        resolution_s = timer_resolution.CUDA_EVENT_RESOLUTION_S

    chosen = timer_resolution.calls_for(Events(), single_call_s, timing.choose_calls_per_sample(single_call_s),
                                        timing.MAX_CALLS_PER_SAMPLE)
    assert chosen == calls and (single_call_s == 0 or chosen * single_call_s >= 100 * 0.5e-6)


def test_a_tournament_on_samples_within_a_few_ticks_separates_no_variant():
    from pytest_kernelcheck import run_tournament

    fast, slow = (lambda: None), (lambda: None)
    timer = TickTimer(1e-3, {fast: _jittered(3e-3), slow: _jittered(5e-3)})
    result = run_tournament({"fast": fast, "slow": slow}, QUICK.replace(calls_per_sample=1), timer=timer)
    assert [pair.verdict for pair in result.pairwise] == ["inconclusive"]
    assert result.indistinguishable_from_best == ["fast", "slow"]
    assert any("whose resolution is 0.001 s" in note for note in result.notes)


@pytest.mark.parametrize("declare", [True, False])
def test_calls_shorter_than_a_tick_even_batched_are_inconclusive_not_an_error(declare):
    # 0.3 us calls on a 1 ms clock: even 1000 calls read 0 ticks. An error failed the test; nothing was wrong with
    # the code, only with what the clock can see.
    candidate, baseline = (lambda: None), (lambda: None)
    timer = TickTimer(1e-3, {candidate: _jittered(0.3e-6), baseline: _jittered(0.4e-6)}, declare=declare)
    result = run_comparison(candidate, baseline, QUICK, timer=timer)
    assert result.verdict == "inconclusive" and result.calls_per_sample == 1000
    assert any(note.startswith("inconclusive:") and "timer 'ticks'" in note for note in result.notes)
    assert result.to_record().to_json()["verdict"] == "inconclusive"


COARSE_CLOCK_TEST = """
from pytest_kernelcheck.speed.timing import SimulatedTimer

class TickTimer:
    name, lock_key, resolution_s = "ticks", "ticks", 1e-3

    def __init__(self, models):
        self._exact = SimulatedTimer(models)

    def time_calls(self, fns, repeat):
        return [round(d / 1e-3) * 1e-3 for d in self._exact.time_calls(fns, repeat)]

    def now(self):
        return self._exact.now()

def candidate():
    pass

def baseline():
    pass

def test_coarse(kernel_ab):
    timer = TickTimer({candidate: lambda rng, now: 1.0e-3, baseline: lambda rng, now: 1.4e-3})
    assert kernel_ab.compare(candidate, baseline, name="hidden by the tick", timer=timer,
                             calls_per_sample=1).verdict == "inconclusive"
"""


def test_end_to_end_the_report_row_says_the_timer_could_not_resolve_it(pytester):
    import json

    pytester.makepyfile(test_coarse=COARSE_CLOCK_TEST)
    result = pytester.runpytest("--kernel-ab", "--kernel-ab-max-time", "0.2", "-p", "no:cacheprovider",
                                "--kernel-ab-report", "ab.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["hidden by the tick *inconclusive (below timer resolution)*"])
    row = json.loads((pytester.path / "ab.json").read_text())["comparisons"][0]
    assert row["verdict"] == "inconclusive"
    assert any("whose resolution is 0.001 s" in note for note in row["notes"])


def test_a_measurement_within_a_few_ticks_says_its_interval_is_the_clocks_rounding():
    from pytest_kernelcheck import run_measurement

    fn = lambda: None  # noqa: E731
    timer = TickTimer(1e-3, {fn: _jittered(2e-3)})
    result = run_measurement(fn, QUICK.replace(calls_per_sample=1), timer=timer)
    assert result.ci_ms == (2.0, 2.0)  # every sample read two ticks: an interval of no width
    assert any("whose resolution is 0.001 s" in note for note in result.notes)
