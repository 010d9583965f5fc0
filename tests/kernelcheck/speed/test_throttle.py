"""Throttling cannot make a verdict: the SM clock read after each chunk of rounds, against the session's highest,
and --kernel-ab-throttle flag|discard|fail. Clocks and timers are simulated, so this runs on the CPU."""
from __future__ import annotations

import json

import pytest

from pytest_kernelcheck import Budget, KernelAB, run_comparison, run_tournament
from pytest_kernelcheck.results.records import ClockRecord, ComparisonRecord
from pytest_kernelcheck.speed import clocks
from pytest_kernelcheck.speed.timing import SimulatedTimer

pytest_plugins = ["pytester"]

HIGH, LOW = 1980, 1500  # an H200's top SM clock and a throttled one, 24% below
THROTTLED_UNTIL_S = 0.25  # virtual seconds: the first ~105 pairs of 2.3 ms run throttled


def throttled(now: float) -> bool:
    return now < THROTTLED_UNTIL_S


def a_a_pair_that_throttling_slows_on_one_side(seed: int = 0):
    """Two equal 1 ms callables; while the clock is down the compute-bound candidate takes 1.3x as long and the
    memory-bound baseline does not (the clock barely moves memory time). The clock starts throttled, after an
    earlier comparison of the session saw the top clock."""
    candidate, baseline = (lambda: None), (lambda: None)
    timer = SimulatedTimer(
        {candidate: lambda rng, now: 1e-3 * (1.3 if throttled(now) else 1.0) * (1 + 0.01 * rng.random()),
         baseline: lambda rng, now: 1e-3 * (1 + 0.01 * rng.random())},
        seed=seed, sm_clock=lambda now: LOW if throttled(now) else HIGH,
    )
    clocks.SESSION.observe(timer.sm_clock.key, HIGH)  # what an earlier comparison on this GPU left
    return candidate, baseline, timer


BUDGET = Budget(max_time=0.6, warmup=0.0, seed=3)


def test_flag_keeps_the_throttled_rounds_and_says_so():
    candidate, baseline, timer = a_a_pair_that_throttling_slows_on_one_side()
    result = run_comparison(candidate, baseline, BUDGET, timer=timer)
    # Today's behaviour: the throttled rounds decide, and here they make an A/A pair a loss.
    assert result.verdict == "loss" and result.throttled
    note = next(n for n in result.notes if n.startswith("throttled:"))
    assert f"as low as {LOW} MHz" in note and f"session's highest {HIGH} MHz" in note
    assert f"{result.n_pairs} of {result.n_pairs} rounds" in note  # decided at the first look, all throttled
    clock = ClockRecord.from_json(result.clock)
    assert (clock.policy, clock.session_highest_mhz, clock.sm_min_mhz, clock.dropped_rounds) == ("flag", HIGH, LOW, 0)
    assert clock.at_looks_mhz == (LOW,) * result.looks_done


def test_discard_drops_the_throttled_rounds_and_decides_on_the_rest():
    candidate, baseline, timer = a_a_pair_that_throttling_slows_on_one_side()
    result = run_comparison(candidate, baseline, BUDGET.replace(throttle="discard"), timer=timer)
    assert result.verdict == "tie" and result.throttled  # the A/A truth, from the unthrottled rounds
    clock = ClockRecord.from_json(result.clock)
    # The clock reads after each chunk (~25 pairs), so the chunk that spans the recovery is kept: a few rounds
    # under the ~105 throttled ones.
    assert 90 <= clock.dropped_rounds <= 120 and clock.policy == "discard"
    assert result.n_pairs == len(result.candidate_samples_ms) >= BUDGET.min_pairs
    # Only the rounds of that one chunk, read after the clock came back, are throttled calls among the samples.
    kept_throttled = sum(t > 1.2 for t in result.candidate_samples_ms)
    assert kept_throttled < 25 and kept_throttled + clock.dropped_rounds >= 100
    note = next(n for n in result.notes if n.startswith("throttled:"))
    assert f"dropped {clock.dropped_rounds} of {clock.dropped_rounds + result.n_pairs} rounds" in note
    assert f"uses the other {result.n_pairs}" in note
    record = ComparisonRecord.from_json(json.loads(json.dumps(result.to_record().to_json())))
    assert record.run.clock.dropped_rounds == clock.dropped_rounds and record.run.throttled


def test_fail_stops_the_comparison_with_both_clocks():
    candidate, baseline, timer = a_a_pair_that_throttling_slows_on_one_side()
    with pytest.raises(clocks.ThrottledComparison, match=rf"SM clock {LOW} MHz .* session's highest {HIGH} MHz"):
        run_comparison(candidate, baseline, BUDGET.replace(throttle="fail"), timer=timer)
    assert timer.now() < 0.1  # at the first chunk, not after the budget


def test_fail_leaves_an_error_row_and_fails_the_test():
    candidate, baseline, timer = a_a_pair_that_throttling_slows_on_one_side()
    rows = []
    ab = KernelAB(Budget(max_time=0.6, warmup=0.0, throttle="fail"), nodeid="t.py::test_x", record=rows.append)
    with pytest.raises(clocks.ThrottledComparison):
        ab.compare(candidate, baseline, name="fused", timer=timer)
    assert rows[0]["verdict"] == "error" and rows[0]["error"].startswith("ThrottledComparison: SM clock 1500 MHz")


def test_an_unthrottled_comparison_is_left_alone_under_every_policy():
    for policy in clocks.POLICIES:
        a, b = (lambda: None), (lambda: None)
        timer = SimulatedTimer({a: lambda rng, now: 1e-3, b: lambda rng, now: 2e-3},
                               sm_clock=lambda now: HIGH - 40 * (int(now * 100) % 3))  # jitter within 10%
        result = run_comparison(a, b, Budget(max_time=0.2, warmup=0.0, throttle=policy), timer=timer)
        assert result.verdict == "win" and not result.throttled
        assert not any(n.startswith("throttled") for n in result.notes)
        assert result.clock["throttle"] == {"policy": policy, "rounds_below": 0, "dropped_rounds": 0}


def test_discard_with_every_round_throttled_is_an_error_not_a_verdict():
    a, b = (lambda: None), (lambda: None)
    timer = SimulatedTimer({a: lambda rng, now: 1e-3, b: lambda rng, now: 1.5e-3}, sm_clock=lambda now: LOW)
    clocks.SESSION.observe(timer.sm_clock.key, HIGH)
    with pytest.raises(clocks.ThrottledComparison, match=r"every one of the \d+ rounds .* 1980 MHz"):
        run_comparison(a, b, Budget(max_time=0.1, warmup=0.0, throttle="discard"), timer=timer)


def test_tournaments_drop_throttled_rounds_too():
    fast, slow = (lambda: None), (lambda: None)
    timer = SimulatedTimer(
        {fast: lambda rng, now: 1e-3 * (3.0 if throttled(now) else 1.0), slow: lambda rng, now: 2e-3},
        sm_clock=lambda now: LOW if throttled(now) else HIGH)
    clocks.SESSION.observe(timer.sm_clock.key, HIGH)
    result = run_tournament({"fast": fast, "slow": slow}, Budget(max_time=0.6, warmup=0.0, throttle="discard"),
                            timer=timer)
    assert result.best == "fast" and result.clock["throttle"]["dropped_rounds"] > 0


def test_the_session_highest_is_per_device_and_a_late_high_clock_drops_earlier_rounds():
    session = clocks.SessionClocks()
    other = clocks.ClockMonitor(clocks.FakeClock([HIGH], key="gpu-1"), session=session)
    other.after_chunk(5)
    monitor = clocks.ClockMonitor(clocks.FakeClock([1700, 1700, 1950], key="gpu-0"), policy="discard",
                                  session=session)
    monitor.after_chunk(7)
    monitor.after_chunk(13)
    assert monitor.kept_rounds(13) is not None and monitor.dropped == 0  # gpu-1's clock is not gpu-0's
    monitor.after_chunk(21)  # 1950 MHz: 1700 is now more than 10% below the highest
    assert monitor.kept_rounds(21) == list(range(13, 21)) and monitor.dropped == 13
    assert monitor.throttled and monitor.record().rounds_below == 13


def test_a_failing_clock_read_ends_the_watch_without_failing_the_comparison():
    class Broken:
        key, max_supported_mhz = "broken", None

        def read(self):
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    monitor = clocks.ClockMonitor(Broken(), policy="fail", session=clocks.SessionClocks())
    monitor.after_chunk(11)
    assert monitor.summary() == {"available": False, "reason": "NVML query failed: RuntimeError: "
                                 "NVML_ERROR_GPU_IS_LOST", "throttled": False}
    assert monitor.kept_rounds(11) is None


def test_nvml_clock_reads_a_fake_nvml_module():
    class FakeNvml:
        NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

        def __init__(self):
            self.clocks = iter([1980, 1605])

        def nvmlDeviceGetMaxClockInfo(self, handle, kind):
            assert (handle, kind) == ("handle-3", 1)
            return 1980

        def nvmlDeviceGetClockInfo(self, handle, kind):
            assert kind == 1  # the SM clock, not memory or graphics
            return next(self.clocks)

        def nvmlDeviceGetTemperature(self, handle, kind):
            return 71

    clock = clocks.NvmlClock("cuda:3", key="gpu-uuid", nvml=FakeNvml(), handle="handle-3")
    monitor = clocks.ClockMonitor(clock, session=clocks.SessionClocks())
    monitor.after_chunk(9)
    monitor.at_look()
    monitor.after_chunk(17)
    monitor.at_look()
    record = monitor.record()
    assert (record.sm_start_mhz, record.sm_end_mhz, record.sm_max_supported_mhz) == (1980, 1605, 1980)
    assert record.at_looks_mhz == (1980, 1605) and record.temperature_max_c == 71
    assert record.throttled and record.rounds_below == 8  # 1605 < 0.9 * 1980 = 1782


def test_bad_throttle_policies_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match="throttle must be one of flag, discard, fail; got 'drop'"):
        Budget().replace(throttle="drop")


SIMULATED_THROTTLE = """
from pytest_kernelcheck.speed import clocks
from pytest_kernelcheck.speed.timing import SimulatedTimer

def throttled(now):
    return now < 0.25

def candidate():
    pass

def baseline():
    pass

def test_fused(kernel_ab):
    timer = SimulatedTimer(
        {candidate: lambda rng, now: 1e-3 * (1.3 if throttled(now) else 1.0) * (1 + 0.01 * rng.random()),
         baseline: lambda rng, now: 1e-3 * (1 + 0.01 * rng.random())},
        sm_clock=lambda now: 1500 if throttled(now) else 1980)
    clocks.SESSION.observe(timer.sm_clock.key, 1980)
    kernel_ab.assert_not_slower(candidate, baseline, name="fused", timer=timer, warmup=0.0, seed=3)
"""


def test_the_option_end_to_end(pytester):
    pytester.makepyfile(test_sim=SIMULATED_THROTTLE)
    base = ["--kernel-ab", "--kernel-ab-max-time", "0.6", "-p", "no:cacheprovider", "-p", "no:xdist"]

    flagged = pytester.runpytest(*base)
    flagged.assert_outcomes(failed=1)  # the throttled rounds make the A/A pair a loss
    flagged.stdout.fnmatch_lines(["*fused*loss (throttled)*"])

    discarded = pytester.runpytest(*base, "--kernel-ab-throttle", "discard", "--kernel-ab-report", "d.json")
    discarded.assert_outcomes(passed=1)
    data = json.loads((pytester.path / "d.json").read_text())
    assert data["settings"]["throttle"] == "discard"
    row = data["comparisons"][0]
    assert row["verdict"] == "tie" and row["clock"]["throttle"]["dropped_rounds"] > 0
    assert any(note.startswith(f"throttled: dropped {row['clock']['throttle']['dropped_rounds']} of")
               for note in row["notes"])

    pytester.makeini("[pytest]\nkernel_ab_throttle = fail\n")
    failed = pytester.runpytest(*base)
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*ThrottledComparison: SM clock 1500 MHz*session's highest 1980 MHz*"])


@pytest.mark.parametrize("where", ["option", "ini"])
def test_a_bad_throttle_value_is_a_usage_error_naming_the_option_and_the_choices(pytester, where):
    pytester.makepyfile(test_sim=SIMULATED_THROTTLE)
    args = ["--kernel-ab", "-p", "no:cacheprovider"]
    if where == "option":
        args += ["--kernel-ab-throttle", "drop"]
    else:
        pytester.makeini("[pytest]\nkernel_ab_throttle = drop\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kernel-ab-throttle / kernel_ab_throttle: one of flag, discard, fail; got 'drop'*"])
