"""Work that escapes the timed stream: events that see far less than a device-wide synchronisation fail the
comparison before it samples. The event and synchronised timers are injected, so this runs on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from pytest_kernelcheck import Budget, KernelAB, run_comparison, run_measurement
from pytest_kernelcheck.speed import escape
from pytest_kernelcheck.speed.timing import CallableFailed, CpuTimer, SimulatedTimer

QUICK = Budget(max_time=0.1, warmup=0.0, seed=0)


class Probe:
    """Per-sample seconds as given, round after round (a list cycles): events, then synchronised."""

    def __init__(self, event_s, synced_s):
        self.event_s, self.synced_s = list(np.atleast_1d(event_s)), list(np.atleast_1d(synced_s))
        self.calls = []

    def event_time(self, fn, repeat):
        self.calls.append(("events", repeat))
        return self.event_s[(len(self.calls) // 2) % len(self.event_s)]

    def synced_time(self, fn, repeat):
        self.calls.append(("synced", repeat))
        return self.synced_s[(len(self.calls) // 2 - 1) % len(self.synced_s)]


def test_events_that_see_a_third_of_the_work_fail_with_both_numbers_and_the_cause():
    with pytest.raises(escape.EscapedWork) as caught:
        escape.check_escaping_work(Probe(0.31e-3, 0.93e-3), [print, print], ["candidate", "baseline"], repeat=3)
    message = str(caught.value)
    assert message.startswith("candidate: CUDA events timed 0.31 ms per sample")
    assert "(3 calls) took 0.93 ms between device-wide synchronisations (medians of 5)" in message
    assert "another CUDA stream or from another thread" in message and "check_escape=False" in message


def test_a_normal_callable_passes_and_both_timers_run_alternately():
    probe = Probe(0.97e-3, 1.01e-3)
    times = escape.check_escaping_work(probe, [print, print], ["candidate", "baseline"], repeat=7)
    assert [t.side for t in times] == ["candidate", "baseline"]
    assert times[0].event_s == pytest.approx(0.97e-3) and times[0].synced_s == pytest.approx(1.01e-3)
    assert probe.calls[:4] == [("events", 7), ("synced", 7)] * 2 and len(probe.calls) == 2 * 2 * escape.ESCAPE_ROUNDS


@pytest.mark.parametrize(
    "event_s, synced_s, escaped",
    [
        (7e-6, 31e-6, False),  # a tiny call: events at a quarter, but the gap is launch and sync latency
        (90e-6, 150e-6, False),  # 60 us missing, but the events still see over half
        (40e-6, 130e-6, True),  # 90 us missing and the events see under a third
        (1.3e-3, 2.7e-3, True),
    ],
)
def test_both_the_ratio_and_the_absolute_floor_must_be_crossed(event_s, synced_s, escaped):
    assert escape.EscapeTimes("candidate", event_s, synced_s).escaped is escaped


def test_the_medians_shrug_off_one_descheduled_sample():
    probe = Probe(1e-3, [1.02e-3, 1.01e-3, 9e-3, 1.03e-3, 1.01e-3])  # one synchronisation waited 9 ms
    assert escape.check_escaping_work(probe, [print], ["candidate"], repeat=1)[0].synced_s == pytest.approx(1.02e-3)


class SharedDeviceProbe(Probe):
    """A probe with a control: an on-stream sample of the asked length shows ``control_gap_s`` more between
    synchronisations than between its events (another process's slices of the device, or latency)."""

    def __init__(self, event_s, synced_s, control_gap_s):
        super().__init__(event_s, synced_s)
        self.control_gap_s, self.controls = control_gap_s, []

    def control_times(self, seconds):
        self.controls.append(seconds)
        return seconds, seconds + self.control_gap_s

    def synced_time(self, fn, repeat):
        self.calls.append(("synced", repeat))
        return self.synced_s[0]


def test_a_gap_that_on_stream_work_shows_too_is_not_escaped_work():
    # The H200 case: a 0.96 ms matmul synchronised at 3.4 ms while a second process loaded the GPU, and a spin
    # kernel of 0.96 ms on the timed stream waited as long.
    probe = SharedDeviceProbe(0.96e-3, 3.4e-3, control_gap_s=2.42e-3)
    times = escape.check_escaping_work(probe, [print], ["candidate"], repeat=1)
    assert times[0].control_gap_s == pytest.approx(2.42e-3) and not times[0].escaped
    assert probe.controls and all(seconds == pytest.approx(0.96e-3) for seconds in probe.controls)


def test_escaped_work_on_a_shared_device_still_fails_and_the_message_gives_the_control():
    probe = SharedDeviceProbe(0.12e-3, 3.2e-3, control_gap_s=2.38e-3)  # 0.7 ms beyond what the control explains
    with pytest.raises(escape.EscapedWork, match=r"medians of 10; on-stream work as long waited 2\.38 ms more"):
        escape.check_escaping_work(probe, [print], ["candidate"], repeat=1)


def test_the_control_runs_only_when_the_first_measurement_looks_escaped():
    probe = SharedDeviceProbe(0.97e-3, 1.01e-3, control_gap_s=5e-3)
    assert not escape.check_escaping_work(probe, [print], ["candidate"], repeat=1)[0].escaped
    assert probe.controls == []


def test_a_callable_that_raises_in_the_check_names_its_side():
    class Raising(Probe):
        def synced_time(self, fn, repeat):
            raise RuntimeError("illegal memory access")

    with pytest.raises(CallableFailed, match="baseline raised RuntimeError during the escape check"):
        escape.check_escaping_work(Raising(1e-3, 1e-3), [print, print], ["baseline", "candidate"], repeat=1)


def candidate():
    pass


def baseline():
    pass


def simulated(escaped):
    return SimulatedTimer({candidate: lambda rng, now: 1e-3, baseline: lambda rng, now: 1.5e-3}, escaped=escaped)


def test_a_comparison_whose_candidate_escapes_fails_before_sampling():
    timer = simulated({candidate: lambda rng, now: 2e-3})  # 2 ms on a side stream the events never see
    with pytest.raises(escape.EscapedWork, match=r"^candidate: CUDA events timed 1 ms per sample, but .* 3\.01 ms"):
        run_comparison(candidate, baseline, QUICK, timer=timer)
    assert timer.now() < 0.05  # warm-up and the check only: the budget was not spent


def test_the_same_comparison_without_escaping_work_runs_and_check_escape_false_skips_the_check():
    assert run_comparison(candidate, baseline, QUICK, timer=simulated({})).verdict == "win"
    timer = simulated({candidate: lambda rng, now: 2e-3})
    assert run_comparison(candidate, baseline, QUICK.replace(check_escape=False), timer=timer).verdict == "win"


def test_measurements_are_checked_too_and_the_fixture_records_the_error():
    with pytest.raises(escape.EscapedWork, match="^the measured function"):
        run_measurement(baseline, QUICK, timer=simulated({baseline: lambda rng, now: 3e-3}))
    rows = []
    ab = KernelAB(QUICK, nodeid="t.py::test_x", record=rows.append)
    with pytest.raises(escape.EscapedWork):
        ab.compare(candidate, baseline, name="side stream", timer=simulated({baseline: lambda rng, now: 5e-3}))
    assert rows[0]["verdict"] == "error" and rows[0]["error"].startswith("EscapedWork: baseline: CUDA events")


def test_host_timers_are_not_checked():
    # The CPU clock waits for whatever the host waits for; there is no second stream to miss.
    assert escape.probe_for(CpuTimer()) is None and escape.probe_for(SimulatedTimer({})) is None
    probe = Probe(1e-3, 1e-3)

    class TimerWithProbe(CpuTimer):
        escape_probe = probe

    assert escape.probe_for(TimerWithProbe()) is probe


def test_slow_callables_are_checked_in_fewer_rounds():
    probe = Probe(0.19, 0.2)  # 200 ms samples: 3 rounds reach the check's time cap
    escape.check_escaping_work(probe, [print], ["candidate"], repeat=1)
    assert len(probe.calls) == 2 * escape.ESCAPE_MIN_ROUNDS
    with pytest.raises(escape.EscapedWork, match=r"\(medians of 3\)"):
        escape.check_escaping_work(Probe(0.05, 0.2), [print], ["candidate"], repeat=1)
