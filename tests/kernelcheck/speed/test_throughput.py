"""Throughput: work counts and their errors, rates, ceilings measured with timers of known durations, the ceiling
cache, measure() statistics on simulated timers, and the L2 flush size."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pytest_kernelcheck.speed import ab, stats, throughput, timing
from pytest_kernelcheck.results.records import CeilingRecord


class FixedTimer:
    """A timer whose every call lasts the next of ``seconds`` (cycled), whatever it runs; it runs nothing."""

    name = "fixed"
    lock_key = "fixed"

    def __init__(self, seconds):
        self.seconds = list(seconds)
        self.calls = 0

    def time_calls(self, fns, repeat):
        durations = []
        for _ in fns:
            durations.append(self.seconds[self.calls % len(self.seconds)] * repeat)
            self.calls += 1
        return durations

    def now(self):
        return 0.0


@pytest.mark.parametrize("value, error, message", [
    (-1, ValueError, "flops= must be a finite number >= 0 per call, got -1"),
    (math.nan, ValueError, "flops= must be a finite number >= 0 per call, got nan"),
    (math.inf, ValueError, "flops= must be a finite number >= 0"),
    ("1e12", TypeError, "flops= must be a number per call (int or float), got str: '1e12'"),
    (True, TypeError, "flops= must be a number per call (int or float), got bool"),
    (np.array([1.0, 2.0]), TypeError, "flops= must be a number per call"),
    (lambda shape: None, TypeError, "flops= (returned by its callable for shape {'n': 3}) must be a number"),
    (lambda shape: -5.0, ValueError, "flops= (returned by its callable for shape {'n': 3}) must be a finite"),
    (lambda shape: shape["missing"], ValueError, "flops= callable raised KeyError for shape {'n': 3}"),
])
def test_bad_counts_name_the_argument(value, error, message):
    with pytest.raises(error) as raised:
        throughput.per_call(value, "flops", {"n": 3})
    assert message in str(raised.value)


def test_counts_accept_numbers_of_numpy_and_torch_and_callables_of_the_shape():
    assert throughput.per_call(np.int64(7), "bytes") == 7.0
    assert throughput.per_call(np.float32(2.5), "bytes") == 2.5
    assert throughput.per_call(torch.tensor(3), "bytes") == 3.0
    assert throughput.per_call(lambda s: 2 * s["n"] ** 3, "flops", {"n": 4}) == 128.0
    assert throughput.per_call(None, "flops") is None
    with pytest.raises(TypeError, match="flops= is a callable of the test's shape, but this test has no shape"):
        throughput.per_call(lambda s: 1, "flops", None)


def test_rates_and_shares_of_the_ceiling():
    ceiling = CeilingRecord("gpu", "bfloat16", tflops=800.0, gbps=4000.0)
    rates = throughput.achieved(throughput.Work(flops=1.6e12, bytes=8e9), 0.004, ceiling)
    assert (rates.tflops, rates.gbps) == (pytest.approx(400.0), pytest.approx(2000.0))
    assert (rates.tflops_pct, rates.gbps_pct) == (pytest.approx(50.0), pytest.approx(50.0))
    assert rates.intensity == pytest.approx(200.0)
    no_ceiling = throughput.achieved(throughput.Work(flops=1e12), 0.001, None)
    assert (no_ceiling.tflops, no_ceiling.tflops_pct, no_ceiling.gbps) == (pytest.approx(1000.0), None, None)
    assert throughput.achieved(throughput.Work(), 0.001, ceiling) is None


def test_dtype_comes_from_the_keyword_or_the_shape():
    assert throughput.dtype_name(torch.float16) == "float16"
    assert throughput.dtype_name(None, {"dtype": torch.bfloat16}) == "bfloat16"
    assert throughput.dtype_name("float32", {"dtype": torch.bfloat16}) == "float32"  # the keyword wins
    assert throughput.dtype_name(None, {"B": 1}) is None
    with pytest.raises(ValueError, match="dtype= must be a torch dtype or its name"):
        throughput.dtype_name("bf 16")


def test_matmul_and_copy_ceilings_are_the_median_of_timed_calls():
    # Three warm-up calls at 1 s (ignored), then ten samples whose median is 2 ms.
    timer = FixedTimer([1.0] * 3 + [1e-3] * 4 + [2e-3] * 2 + [3e-3] * 4)
    tflops, method = throughput.matmul_tflops(timer, "cpu", "float32", n=64)
    assert tflops == pytest.approx(2 * 64**3 / 2e-3 / 1e12)
    assert method.startswith("matmul 64^3 float32, float32 matmul precision ") and method.endswith("(fixed)")
    timer = FixedTimer([1.0] * 3 + [4e-3] * 10)
    gbps, method = throughput.copy_gbps(timer, "cpu", nbytes=1 << 20)
    assert gbps == pytest.approx(2 * (1 << 20) / 4e-3 / 1e9)  # read plus write
    assert method == "copy of 1 MiB (read + write), median of 10 (fixed)"


def test_a_ceiling_that_cannot_be_measured_says_why_and_keeps_the_other():
    ceiling = throughput.measure_on(FixedTimer([1e-3]), "cpu", "cpu (test)", "not_a_dtype", n=8, nbytes=4096)
    assert ceiling.tflops is None and ceiling.gbps == pytest.approx(2 * 4096 / 1e-3 / 1e9)
    assert "no FLOP/s ceiling for not_a_dtype: ValueError: 'not_a_dtype' is not a torch dtype" in ceiling.reason
    without_dtype = throughput.measure_on(FixedTimer([1e-3]), "cpu", "cpu (test)", None, n=8, nbytes=4096)
    assert without_dtype.tflops is None and "give dtype=" in without_dtype.reason


def test_the_meter_measures_once_per_device_and_dtype_and_the_cpu_gets_a_reason():
    calls = []

    def fake(timer, dtype):
        calls.append(dtype)
        return CeilingRecord(timer.name, dtype, tflops=100.0, gbps=1000.0)

    meter = throughput.CeilingMeter(measure=fake)
    for dtype in ("bfloat16", "bfloat16", "float16", "bfloat16"):
        meter.ceiling_for(timing.CpuTimer(), dtype)
    assert calls == ["bfloat16", "float16"] and len(meter.measured) == 2
    assert throughput.CeilingMeter(enabled=False, measure=fake).ceiling_for(timing.CpuTimer(), "x") is None
    assert len(calls) == 2
    cpu = throughput.CeilingMeter().ceiling_for(timing.CpuTimer(), "float32")
    assert (cpu.tflops, cpu.gbps, cpu.reason) == (None, None, throughput.CPU_REASON)


def _two_sides(candidate_s, baseline_s):
    candidate, baseline = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({candidate: lambda rng, now: candidate_s, baseline: lambda rng, now: baseline_s})
    return candidate, baseline, timer


def test_a_comparison_rates_both_sides_by_the_same_work_against_the_ceiling():
    candidate, baseline, timer = _two_sides(2e-3, 4e-3)
    meter = throughput.CeilingMeter(measure=lambda t, d: CeilingRecord("sim", d, tflops=1000.0, gbps=2000.0))
    result = ab.run_comparison(candidate, baseline, ab.Budget(max_time=0.1), timer=timer, flops=1e12, bytes=2e9,
                               dtype="bfloat16", ceilings=meter)
    assert result.candidate_throughput.tflops == pytest.approx(500.0)
    assert result.baseline_throughput.tflops == pytest.approx(250.0)
    assert result.candidate_throughput.gbps_pct == pytest.approx(50.0)
    assert result.ceiling.dtype == "bfloat16"
    assert "candidate 500 TFLOP/s (50% of ceiling), 1000 GB/s (50% of ceiling)" in result.describe()
    record = result.to_record().to_json()
    assert record["throughput"]["baseline"]["gbps"] == pytest.approx(500.0)
    plain = ab.run_comparison(candidate, baseline, ab.Budget(max_time=0.1), timer=timer, ceilings=meter)
    assert plain.candidate_throughput is None and plain.ceiling is None  # no work given: no ceiling asked for
    assert "throughput" not in plain.to_record().to_json()


def test_a_tournament_takes_work_per_variant():
    one, two = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({one: lambda rng, now: 1e-3, two: lambda rng, now: 2e-3})
    result = ab.run_tournament({"one": one, "two": two}, ab.Budget(max_time=0.1), timer=timer,
                               flops=1e9, bytes={"two": 4e6})
    assert result.throughput["one"].tflops == pytest.approx(1.0) and result.throughput["one"].gbps is None
    assert result.throughput["two"].gbps == pytest.approx(2.0)
    with pytest.raises(ValueError, match="bytes= names variants the tournament does not have: 'three'"):
        ab.run_tournament({"one": one, "two": two}, ab.Budget(max_time=0.1), timer=timer, bytes={"three": 1})
    with pytest.raises(ValueError, match="variant 'two': flops= must be a finite number >= 0"):
        ab.run_tournament({"one": one, "two": two}, ab.Budget(max_time=0.1), timer=timer, flops={"two": -1})


def test_measure_reports_the_median_and_the_exact_interval_of_its_samples():
    fn = lambda: None  # noqa: E731
    timer = timing.SimulatedTimer({fn: lambda r, now: 1e-3 * math.exp(0.05 * r.gauss(0, 1))}, seed=1)
    result = ab.run_measurement(fn, ab.Budget(max_time=5.0, margin=0.01), timer=timer, flops=1e9, bytes=1e6)
    seconds = np.asarray(result.samples_ms) / 1e3
    low, high = stats.median_interval(seconds, result.alpha / result.looks_planned)
    assert result.ci_ms == (pytest.approx(low * 1e3), pytest.approx(high * 1e3))
    assert result.median_ms == pytest.approx(float(np.median(seconds)) * 1e3)
    assert result.stop_reason == "precise" and result.ci_ms[1] <= result.ci_ms[0] * 1.01
    assert result.n_samples == len(result.samples_ms) > 20  # 20 samples cannot give an interval this narrow
    assert result.throughput.tflops == pytest.approx(1e9 / (result.median_ms / 1e3) / 1e12)
    assert result.ci_level == pytest.approx(1 - 0.05 / 10)


def test_measure_intervals_cover_the_true_median_at_their_level():
    misses = 0
    runs = 200
    for seed in range(runs):
        fn = lambda: None  # noqa: E731
        # Log-normal call times: the true median is exactly 1 ms.
        timer = timing.SimulatedTimer({fn: lambda r, now: 1e-3 * math.exp(0.2 * r.gauss(0, 1))}, seed=seed)
        result = ab.run_measurement(fn, ab.Budget(min_pairs=20, max_pairs=20, alpha=0.2), timer=timer)
        low, high = result.ci_ms
        misses += not (low <= 1.0 <= high)
    # The level is 1 - 0.2 / 1 look = 80%; misses beyond 30% of runs would mean the interval is not exact.
    assert misses / runs <= 0.3
    assert misses > 0  # an interval that never misses at 80% is too wide to be the order-statistic one


def test_l2_flush_is_sized_from_the_device_l2(monkeypatch):
    assert timing.l2_flush_bytes(50 * 2**20) == 100 * 2**20
    assert timing.l2_flush_bytes(2 * 2**20) == timing.L2_FLUSH_MIN_BYTES
    assert timing.l2_flush_bytes(0) == timing.L2_FLUSH_BYTES

    class Properties:
        name, uuid, L2_cache_size = "Fake GPU", "fake-uuid", 60 * 2**20

    allocated = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch, "empty", lambda n, **kwargs: allocated.append(n * 4))
    timer = timing.CudaEventTimer("cuda:0", flush_l2=True)
    assert allocated == [120 * 2**20] and timer.flush_bytes == 120 * 2**20
    assert timer.flush_note == "L2 flush: 120 MiB written before each sample (2x the 60 MiB L2, at least 64 MiB)"
    assert timing.CudaEventTimer("cuda:0", flush_l2=False).flush_note is None and len(allocated) == 1
