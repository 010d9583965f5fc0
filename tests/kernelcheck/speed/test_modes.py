"""Measurement modes (throughput, latency, graph): each its own samples and verdict, disagreements flagged, A/A
false verdicts within alpha in every mode, the CPU's graph mode reported unavailable, and the spec object."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from pytest_kernelcheck.results.build import build_report
from pytest_kernelcheck.results.modes_text import markdown_lines, terminal_lines
from pytest_kernelcheck.results.records import ComparisonRecord, record_from_json
from pytest_kernelcheck.results.report_text import table_rows
from pytest_kernelcheck.speed import modes
from pytest_kernelcheck.speed.ab import KernelAB, KernelABAssertionError
from pytest_kernelcheck.speed.budget import Budget
from pytest_kernelcheck.speed.comparison import run_comparison
from pytest_kernelcheck.speed.runs import run_measurement, run_tournament
from pytest_kernelcheck.speed.simulated_timer import SimulatedTimer
from pytest_kernelcheck.speed.spec import ABSpec
from pytest_kernelcheck.speed.timing import CpuTimer

FAST = Budget(max_time=0.5, warmup=0.0, seed=0)


def noisy(mean_s: float, spread: float = 0.01):
    return lambda rng, now: mean_s * (1 + spread * rng.gauss(0, 1))


def split_pair(seed: int = 0):
    """A pair that wins back to back (0.9 ms against 1.0) and loses from idle (1.25 ms against 1.0, its launch
    cost showing): one simulated timer per mode, each with its own truth."""
    candidate, baseline = (lambda: None), (lambda: None)
    timers = {
        "throughput": SimulatedTimer({candidate: noisy(0.9e-3), baseline: noisy(1.0e-3)}, seed=seed),
        "latency": SimulatedTimer({candidate: noisy(1.25e-3), baseline: noisy(1.0e-3)}, seed=seed + 1,
                                  device_models={candidate: noisy(0.85e-3), baseline: noisy(0.95e-3)}),
        "graph": SimulatedTimer({candidate: noisy(0.88e-3), baseline: noisy(1.0e-3)}, seed=seed + 2),
    }
    return candidate, baseline, timers


def test_a_pair_that_wins_back_to_back_and_loses_from_idle_is_flagged_as_disagreeing():
    candidate, baseline, timers = split_pair()
    result = run_comparison(candidate, baseline, FAST, timer=timers, modes=("throughput", "latency", "graph"))
    assert [m.verdict for m in result.modes.values()] == ["win", "loss", "win"]
    assert result.verdict == "win" and result.mode == "throughput"  # the first mode gives the row's verdict
    assert result.modes_disagree
    assert result.modes["latency"].speedup == pytest.approx(1.0 / 1.25, rel=0.02)
    # Host overhead per call: latency minus the device time of the same calls (0.4 ms and 0.05 ms here).
    assert result.modes["latency"].candidate_host_ms == pytest.approx(0.40, abs=0.02)
    assert result.modes["latency"].baseline_host_ms == pytest.approx(0.05, abs=0.02)
    assert "MODES DISAGREE" in result.describe()
    assert any(note.startswith("verdicts disagree across modes") for note in result.notes)
    # Each mode has its own samples: the latency samples are not the throughput ones.
    assert result.modes["latency"].candidate_samples_ms != result.modes["throughput"].candidate_samples_ms
    row = json.loads(json.dumps(result.to_record().to_json()))
    assert row["modes_disagree"] is True and row["mode"] == "throughput"
    assert [m["verdict"] for m in row["modes"]] == ["win", "loss", "win"]
    assert record_from_json(row).modes_disagree
    report = build_report([row], settings={})
    assert table_rows(report)[1][0][6] == "win (modes disagree)"
    assert any(line.startswith("MODES DISAGREE in 1 comparison") for line in terminal_lines(report))
    assert any("MODES DISAGREE" in line for line in markdown_lines(report))
    latency_line = next(line for line in terminal_lines(report) if line.split()[1:2] == ["latency"])
    assert "loss" in latency_line and latency_line.split()[-3:-1] == ["400", "/"]


def test_agreeing_modes_are_not_flagged_and_throughput_alone_keeps_the_first_layout():
    candidate, baseline = (lambda: None), (lambda: None)
    timer = SimulatedTimer({candidate: noisy(0.8e-3), baseline: noisy(1.0e-3)})
    both = run_comparison(candidate, baseline, FAST, timer=timer, modes="throughput,latency")
    assert [m.verdict for m in both.modes.values()] == ["win", "win"] and not both.modes_disagree
    alone = run_comparison(candidate, baseline, FAST, timer=timer).to_record().to_json()
    assert "modes" not in alone and "modes_disagree" not in alone


@pytest.mark.parametrize("mode", modes.MODES)
def test_a_against_a_gives_no_more_false_verdicts_than_alpha_in_every_mode(mode):
    # 200 A/A comparisons on simulated noise (5% per call, a fixed seed each): a win or loss is a false verdict.
    # With alpha 0.05 the count is at most binomial(200, 0.05); 17 or more happens with probability < 1%.
    fn = lambda: None  # noqa: E731
    false = 0
    for seed in range(200):
        timer = SimulatedTimer({fn: noisy(1e-3, 0.05)}, seed=seed)
        budget = Budget(max_time=0.5, warmup=0.0, seed=seed, max_pairs=160, alpha=0.05)
        result = run_comparison(fn, fn, budget, timer={mode: timer}, modes=(mode,))
        assert result.mode == mode and result.modes[mode].available  # the mode itself measured, not a fallback
        false += result.verdict in ("win", "loss")
    assert false <= 16, f"{false} false verdicts of 200 in {mode} mode"


def test_on_the_cpu_graph_is_reported_unavailable_and_latency_still_measures():
    x = np.random.default_rng(0).random(20_000)
    result = run_comparison(lambda: np.sort(x), lambda: np.sort(np.concatenate([x, x]))[::2],
                            Budget(max_time=0.3, seed=0), modes=("latency", "graph"))
    assert result.mode == "latency" and result.verdict == "win"
    assert not result.modes["graph"].available
    assert "not available on the CPU" in result.modes["graph"].unavailable
    assert result.modes["latency"].candidate_host_ms is None  # no device clock on the CPU: no overhead split
    assert any("idle pause" in note for note in result.notes)
    with pytest.raises(modes.ModeUnavailable, match="no requested mode could measure"):
        run_comparison(lambda: np.sort(x), lambda: np.sort(x), Budget(max_time=0.1), modes="graph")


def test_assertions_read_the_mode_they_are_given():
    candidate, baseline, timers = split_pair(seed=3)
    ab = KernelAB(Budget(max_time=0.5, warmup=0.0), test_name="t")
    assert ab.assert_faster(candidate, baseline, timer=timers, name="default").verdict == "win"
    with pytest.raises(KernelABAssertionError, match="slower than baseline in latency mode"):
        ab.assert_not_slower(candidate, baseline, timer=timers, mode="latency", name="from idle")
    # A mode not among modes= is measured as well, after them.
    result = ab.assert_faster(candidate, baseline, timer=timers, modes="throughput", mode="graph", name="graph")
    assert list(result.modes) == ["throughput", "graph"]


def test_tournaments_and_measurements_run_in_one_mode():
    a, b = (lambda: None), (lambda: None)
    timer = SimulatedTimer({a: noisy(1e-3), b: noisy(2e-3)})
    with pytest.raises(ValueError, match="a tournament runs in one measurement mode"):
        run_tournament({"a": a, "b": b}, FAST, timer=timer, modes="throughput,latency")
    assert run_tournament({"a": a, "b": b}, FAST, timer=timer, modes="latency").best == "a"
    ab = KernelAB(Budget(max_time=0.2, warmup=0.0), test_name="t", modes=("latency", "throughput"))
    measured = ab.measure(a, timer=timer)  # the first of the test's default modes
    assert measured.method == "simulated" and math.isfinite(measured.median_ms)
    assert run_measurement(a, FAST, timer=timer).n_samples >= 20


def test_the_spec_object_is_built_once_and_checked():
    spec = ABSpec.build(Budget(max_time=0.4), modes=["latency"], flops=1e9, check="fp32")
    assert (spec.budget.max_time, spec.modes, spec.work.flops, spec.inputs.check) == (0.4, ("latency",), 1e9, "fp32")
    with pytest.raises(ValueError, match="modes must name measurement modes"):
        ABSpec.build(None, modes="fast")
    with pytest.raises(ValueError, match="each once"):
        ABSpec.build(None, modes="latency,latency")
    with pytest.raises(ValueError, match="mode names"):
        ABSpec.build(None, timer={"steady": object()})
    with pytest.raises(TypeError, match="inputs must be a zero-argument callable"):
        ABSpec.build(None, inputs=3)
    # compare(spec=...) takes a spec built before, and keywords on top of it.
    candidate, baseline, timers = split_pair()
    ab = KernelAB(Budget(max_time=5.0, warmup=0.0), test_name="t")
    built = ab.spec(max_time=0.3, timer=timers, modes="latency")
    result = ab.compare(candidate, baseline, spec=built, name="from a spec")
    assert result.mode == "latency" and result.verdict == "loss"
    assert isinstance(result.to_record(), ComparisonRecord)


def test_latency_times_one_call_after_an_idle_pause_whatever_the_batching():
    # On the CPU: LatencyTimer sleeps before each call and times the call alone, so a 1 ms pause never shows in
    # the sample, and calls_per_sample does not batch the latency mode.
    timer = modes.LatencyTimer(CpuTimer(), idle_s=0.005)
    started = time.perf_counter()
    (sample,) = timer.time_calls([lambda: sum(range(1000))], repeat=1)
    assert time.perf_counter() - started >= 0.005 and sample < 0.005
    x = np.random.default_rng(1).random(5_000)
    result = run_comparison(lambda: np.sort(x), lambda: np.sort(x), Budget(max_time=0.2, calls_per_sample=5),
                            modes=("throughput", "latency"))
    assert result.modes["throughput"].method == "cpu-clock-batched x5"
    assert result.modes["latency"].method == "latency-from-idle"
