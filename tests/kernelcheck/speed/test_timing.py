"""Timing engine: timers, interleaving, batching, locks, bad input, and real CPU A/B runs."""
from __future__ import annotations

import fcntl
import math
import random
import time
import types

import numpy as np
import pytest
import torch

from pytest_kernelcheck import Budget, run_comparison, run_tournament
from pytest_kernelcheck.speed import timing
from pytest_kernelcheck.speed.gpu_lock import device_lock, lock_path

QUICK = Budget(max_time=0.2, warmup=0.0)


def constant(seconds: float):
    return lambda rng, now: seconds


def test_cpu_timer_measures_what_runs():
    durations = timing.CpuTimer().time_calls([lambda: time.sleep(0.002), lambda: None], repeat=2)
    assert durations[0] >= 0.004
    assert durations[1] < durations[0] / 10


def test_rounds_interleave_in_random_order_and_keep_sides_apart():
    a, b = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({a: constant(1e-3), b: constant(2e-3)})
    samples = timing.RoundSamples.empty(2)
    timing.sample_rounds(timer, [a, b], ["candidate", "baseline"], 400, 3, random.Random(1), samples)
    assert samples.times[0] == [1e-3] * 400  # per call, although each sample held 3 calls
    assert samples.times[1] == [2e-3] * 400
    first_a = sum(order[0] == 0 for order in samples.orders)
    assert 150 < first_a < 250  # random order, not alternation by construction

    # A CUDA graph replay is one timed call holding several kernel calls: times are still stored per call.
    replayed = timing.RoundSamples.empty(2)
    timing.sample_rounds(timer, [a, b], ["candidate", "baseline"], 2, 1, random.Random(1), replayed, calls_per_sample=4)
    assert replayed.times == [[0.25e-3] * 2, [0.5e-3] * 2]


def test_a_callable_failing_during_timing_is_named():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("device lost")

    # timer="cpu": on a CUDA machine the automatic choice adds the escape check's calls before timing (the H200
    # run of 2026-12-01 failed there first, naming "the escape check"), which would move the failure's phase.
    with pytest.raises(timing.CallableFailed, match=r"baseline raised RuntimeError during timing: device lost"):
        run_comparison(lambda: None, flaky, QUICK, timer="cpu")


def test_a_callable_failing_on_its_first_call_is_named():
    def broken():
        raise ValueError("bad shape")

    with pytest.raises(timing.CallableFailed, match=r"candidate raised ValueError during its first call: bad shape"):
        run_comparison(broken, lambda: None, QUICK)


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda x: x, "candidate must be callable with no arguments; it requires 'x'"),
        (lambda *, scale: scale, "requires 'scale'"),
        (42, "candidate must be a callable taking no arguments, got int"),
    ],
)
def test_callables_needing_arguments_are_refused_before_timing(fn, message):
    with pytest.raises(TypeError, match=message):
        run_comparison(fn, lambda: None, QUICK)


def test_defaults_and_varargs_are_fine():
    timing.require_zero_arguments(lambda x=1, *args, **kwargs: x, "candidate")


def test_zero_durations_are_refused_with_a_hint():
    a, b = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({a: constant(0.0), b: constant(1e-3)})
    with pytest.raises(ValueError, match="zero duration for candidate.*raise calls_per_sample"):
        run_comparison(a, b, QUICK.replace(calls_per_sample=1), timer=timer)


class _Every:
    """A duration model that returns ``bad`` on every ``period``-th call and ``good`` otherwise."""

    def __init__(self, bad: float, period: int, good: float = 1e-3) -> None:
        self.bad, self.period, self.good, self.calls = bad, period, good, 0

    def __call__(self, rng, now):
        self.calls += 1
        return self.bad if self.calls % self.period == 0 else self.good


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1e-3])
@pytest.mark.parametrize("period", [1, 5])
def test_non_finite_and_negative_durations_are_refused_by_side(bad, period):
    # A NaN sample once passed as a "precise" measurement with a NaN median (it sorts past every number).
    from pytest_kernelcheck import run_measurement
    a, b = (lambda: None), (lambda: None)
    budget = QUICK.replace(calls_per_sample=1)
    message = rf"timer 'simulated' returned {bad} seconds for a call of {{side}}: a duration must be a finite"
    with pytest.raises(ValueError, match=message.format(side="candidate")):
        run_comparison(a, b, budget, timer=timing.SimulatedTimer({a: _Every(bad, period), b: constant(1e-3)}))
    with pytest.raises(ValueError, match=message.format(side="baseline")):
        run_comparison(a, b, budget, timer=timing.SimulatedTimer({a: constant(1e-3), b: _Every(bad, period)}))
    with pytest.raises(ValueError, match=message.format(side="variant 'second'")):
        run_tournament({"first": a, "second": b}, budget,
                       timer=timing.SimulatedTimer({a: constant(1e-3), b: _Every(bad, period)}))
    with pytest.raises(ValueError, match=message.format(side="the measured function")):
        run_measurement(a, budget, timer=timing.SimulatedTimer({a: _Every(bad, period)}))


def test_a_timer_must_return_one_duration_per_call():
    class Short:
        name, lock_key = "short", "short"

        def time_calls(self, fns, repeat):
            return [1e-3] * (len(fns) - 1)

        def now(self):
            return time.perf_counter()

    with pytest.raises(ValueError, match="timer 'short' returned 1 durations for 2 calls"):
        run_comparison(lambda: None, lambda: None, QUICK, timer=Short())


@pytest.mark.parametrize("single_call_s, calls", [(1e-3, 1), (50e-6, 1), (49e-6, 5), (2e-6, 100), (0.0, 1000)])
def test_calls_per_sample_batches_only_tiny_calls(single_call_s, calls):
    assert timing.choose_calls_per_sample(single_call_s) == calls


def test_tiny_calls_are_batched_and_the_method_says_so():
    a, b = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({a: constant(5e-6), b: constant(5e-6)})
    result = run_comparison(a, b, Budget(warmup=0.001), timer=timer)
    assert result.method == "simulated-batched x40" and result.calls_per_sample == 40
    assert result.candidate_ms == pytest.approx(5e-3)  # reported per call, not per sample


def test_explicit_calls_per_sample_and_cpu_only_options_are_recorded():
    x = np.random.default_rng(0).random(1000)
    result = run_comparison(
        lambda: x.sum(), lambda: x.sum(), QUICK.replace(calls_per_sample=7, flush_l2=True, use_cuda_graph=True)
    )
    assert result.method == "cpu-clock-batched x7"
    assert any("flush_l2 ignored" in n for n in result.notes)
    assert any("hold_gpu ignored" in n for n in run_comparison(
        lambda: x.sum(), lambda: x.sum(), QUICK.replace(hold_gpu=True)).notes)
    assert any("use_cuda_graph ignored" in n for n in result.notes)
    assert result.clock == {"available": False, "reason": "not a CUDA comparison", "throttled": False}


def test_warm_up_runs_until_its_time_is_spent():
    a = lambda: None  # noqa: E731
    timer = timing.SimulatedTimer({a: constant(1e-3)})
    times = timing.warm_up(timer, [a], ["candidate"], seconds=0.05)
    assert len(times[0]) == 50
    assert len(timing.warm_up(timer, [a], ["candidate"], seconds=0.0)[0]) == 3  # the minimum


def test_time_budget_bounds_sampling():
    a, b = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({a: constant(1e-3), b: lambda rng, now: 1e-3 * math.exp(rng.gauss(0, 0.5))})
    result = run_comparison(a, b, Budget(max_time=0.5, margin=0.0, seed=1), timer=timer)
    assert result.stop_reason == "max_time"
    assert result.elapsed_s <= 0.5 + 0.05
    assert 150 <= result.n_pairs <= 260


def test_min_pairs_overrides_the_time_budget():
    a, b = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({a: constant(0.1), b: lambda rng, now: 0.1 * math.exp(rng.gauss(0, 0.5))})
    result = run_comparison(a, b, Budget(max_time=0.01, min_pairs=12, margin=0.0), timer=timer)
    assert result.n_pairs == 12


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"max_time": 0}, ValueError, "max_time must be > 0"),
        ({"max_time": -1.0}, ValueError, "max_time must be > 0"),
        ({"min_pairs": 0}, ValueError, "min_pairs must be a positive integer"),
        ({"max_pairs": 5}, ValueError, r"max_pairs \(5\) must be >= min_pairs \(20\)"),
        ({"alpha": 1.5}, ValueError, "alpha must be between 0 and 1"),
        ({"margin": -0.1}, ValueError, r"margin must be in \[0, 1\)"),
        ({"calls_per_sample": "many"}, ValueError, "calls_per_sample must be a positive integer"),
        ({"use_cuda_graph": "yes"}, ValueError, "use_cuda_graph must be True, False or 'auto'"),
        ({"hold_gpu": "yes"}, ValueError, "hold_gpu must be True or False"),
        ({"max_time": float("inf")}, ValueError, "max_time must be a finite number"),
        ({"maxtime": 1}, TypeError, "unknown budget keyword 'maxtime'"),
    ],
)
def test_bad_budgets_are_refused_with_the_name(changes, error, message):
    with pytest.raises(error, match=message):
        Budget().replace(**changes)


def test_device_lock_excludes_a_second_holder():
    key = f"test-{time.time_ns()}"
    with device_lock(key) as locked:
        assert locked
        with open(lock_path(key), "a+") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock_path(key), "a+") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
    lock_path(key).unlink()


def test_clock_monitor_without_a_gpu_reports_unavailable():
    summary = timing.ClockMonitor(None).summary()
    assert summary["available"] is False and summary["throttled"] is False


def test_tournament_refuses_bad_variants():
    with pytest.raises(ValueError, match="at least two named callables"):
        run_tournament({"only": lambda: None}, QUICK)
    shared = lambda: None  # noqa: E731
    with pytest.raises(ValueError, match="its own callable object"):
        run_tournament({"a": shared, "b": shared}, QUICK)
    with pytest.raises(TypeError, match="variant 'b' must be callable with no arguments"):
        run_tournament({"a": lambda: None, "b": lambda n: n}, QUICK)


def test_real_cpu_work_ten_percent_heavier_baseline_is_a_win():
    # End to end with the CPU clock: sorting 10% more numbers costs ~11% more; noisy shared machines included.
    rng = np.random.default_rng(0)
    light, heavy = rng.random(20_000), rng.random(22_000)
    results = [
        # check=False: the two sort different arrays, so their outputs differ by design.
        run_comparison(lambda: np.sort(light), lambda: np.sort(heavy), Budget(max_time=1.0, seed=s), check=False)
        for s in range(3)
    ]
    verdicts = [r.verdict for r in results]
    assert verdicts.count("win") >= 2, [r.describe() for r in results]
    assert "loss" not in verdicts
    assert all(1.0 < r.speedup < 1.3 for r in results if r.verdict == "win")


class _FakeCuda:
    """Records what CudaEventTimer queues, in order, and lets the test set how long the host takes to queue."""

    def __init__(self, host_s_per_call: float) -> None:
        self.log: list[str] = []
        self.host_s_per_call = host_s_per_call
        self.now = 1000.0
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = 0.0

            def record(self) -> None:
                fake.log.append("event")

            def elapsed_time(self, other: "Event") -> float:
                return 1.0  # milliseconds

        self.Event = Event

    def _sleep(self, cycles: int) -> None:
        self.log.append(f"sleep {cycles}")

    def synchronize(self, device=None) -> None:
        self.log.append("sync")

    def device(self, device):
        import contextlib
        return contextlib.nullcontext()

    def call(self) -> None:
        self.log.append("call")
        self.now += self.host_s_per_call

    def perf_counter(self) -> float:
        """The host clock the timer reads, advanced only by ``call``: host times are exact, not slept."""
        return self.now


def _held_timer(fake: _FakeCuda) -> timing.CudaEventTimer:
    import types
    timer = timing.CudaEventTimer.__new__(timing.CudaEventTimer)
    timer._torch = types.SimpleNamespace(cuda=fake)
    timer.name, timer.hold_gpu = "events-held", True
    timer.holds = timer.short_holds = 0
    timer._host_s_per_call = {}
    timer._spin_cycles_per_s = 1e9  # as calibrated: a 1 GHz spin clock
    timer.device, timer._flush_buffer = "cuda:0", None
    return timer


def test_hold_gpu_queues_a_spin_before_each_element_sized_from_its_own_host_time(monkeypatch):
    slow = _FakeCuda(host_s_per_call=0.004)
    # The fake's clock stands in for time.perf_counter: a real sleep overshoots on a busy machine.
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=slow.perf_counter))
    timer = _held_timer(slow)
    log = slow.log

    def quick_call() -> None:
        log.append("quick")

    timer.time_calls([slow.call, quick_call], repeat=1)
    # Each element: its spin first, then its events around its calls; one synchronisation at the end.
    spins = [entry for entry in log if entry.startswith("sleep")]
    assert [entry if not entry.startswith("sleep") else "sleep" for entry in log] == [
        "sleep", "event", "call", "event", "sleep", "event", "quick", "event", "sync"]
    # Nothing was known yet: the minimum hold (200 us), shorter than the ~4 ms the slow call took: counted.
    assert spins[0] == f"sleep {int(timing.HOLD_MIN_S * 1e9)}"
    assert (timer.holds, timer.short_holds) == (2, 1)
    log.clear()
    timer.time_calls([quick_call, slow.call], repeat=3)
    spins = [int(entry.split()[1]) for entry in log if entry.startswith("sleep")]
    # The quick call keeps the minimum hold; the slow one gets twice its last host time per call, times 3 calls.
    assert spins[0] == int(timing.HOLD_MIN_S * 1e9)
    assert spins[1] == pytest.approx(2 * 3 * 0.004 * 1e9)
    assert (timer.holds, timer.short_holds) == (4, 1)  # both covered this time


def test_hold_gpu_gives_an_unseen_callable_the_longest_known_hold():
    timer = _held_timer(_FakeCuda(host_s_per_call=0.0))
    timer._host_s_per_call = {1: 0.001, 2: 0.003}
    assert timer.hold_for(lambda: None, repeat=2) == pytest.approx(2 * 0.003 * 2)
    assert timer.hold_for(lambda: None, repeat=10_000) == timing.HOLD_MAX_S


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hold_gpu_times_a_host_bound_call_by_its_device_work_whatever_it_is_paired_with():
    # 30 tiny kernels with host work between them: about 1.5 ms of host time, microseconds of device time.
    x = torch.randn(1024, device="cuda")

    def host_bound():
        for _ in range(30):
            x.mul_(1.0)
            time.sleep(50e-6)

    a = torch.randn(4096, 4096, device="cuda")
    heavy = lambda: a @ a  # noqa: E731  (milliseconds of device work, little host work)
    light = lambda: x.add(1.0)  # noqa: E731
    # One call per sample for both pairings, so the partner changes and nothing else (batching is the fake-CUDA
    # tests' business).
    held = Budget(max_time=0.5, min_pairs=20, max_pairs=40, hold_gpu=True, check_output=False, calls_per_sample=1)
    with_heavy = run_comparison(host_bound, heavy, held)
    with_light = run_comparison(host_bound, light, held)
    assert with_heavy.method.startswith("events-held") and with_light.method.startswith("events-held")
    # Device time of 30 tiny kernels: far below the 1.5 ms of host time, and the same with either partner.
    assert with_heavy.candidate_ms < 0.5 and with_light.candidate_ms < 0.5
    assert with_heavy.candidate_ms == pytest.approx(with_light.candidate_ms, rel=0.5)
    queued = run_comparison(host_bound, light, held.replace(hold_gpu=False))
    assert queued.candidate_ms > 1.0  # without the hold, the launch gaps are timed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_a_matmul_and_detect_extra_work():
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(2048, 2304, device="cuda")
    result = run_comparison(lambda: a @ a, lambda: a @ b, Budget(max_time=1.0, flush_l2=True))
    assert result.method == "events" and result.flush_l2
    assert result.verdict == "win"
    assert result.clock["available"] in (True, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_for_tiny_kernels():
    x = torch.randn(256, device="cuda")
    # check=False: the two sides compute different things by design (the output check before timing would refuse).
    result = run_comparison(lambda: x * 2, lambda: x * 2 + 1, Budget(max_time=0.5, use_cuda_graph="auto"),
                            check=False)
    assert result.method.startswith("cuda-graph x")
