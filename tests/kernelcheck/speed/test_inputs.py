"""Inputs the plugin owns (pytest_kernelcheck.speed.inputs and inputs= of run_comparison): set counts from the L2 and the
memory budget, rotation, the fresh-input check and its two failure messages, and refusals of bad arguments."""
from __future__ import annotations

import numpy as np
import pytest

from pytest_kernelcheck import Budget, run_comparison, run_measurement, run_tournament
from pytest_kernelcheck.speed import inputs, timing

FAST = Budget(max_time=0.05, warmup=0.0)


def _rng_inputs(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return lambda: (rng.random(n),)


def test_cuda_set_count_exceeds_twice_the_l2_and_the_budget_caps_it_with_a_note():
    count, note = inputs.plan_set_count(8 * 2**20, 60 * 2**20, 2**30)
    assert count * 8 * 2**20 > timing.l2_flush_bytes(60 * 2**20)
    assert "120 MiB" in note
    capped, note = inputs.plan_set_count(50 * 2**20, 60 * 2**20, 90 * 2**20)
    assert capped == 2 and "90 MiB input memory budget" in note and "do not exceed" in note


def test_cpu_builds_a_fixed_count_and_every_call_takes_the_next_set():
    seen = []
    sets = inputs.build_input_sets(_rng_inputs())
    assert len(sets) == inputs.CPU_INPUT_SETS
    one, two = sets.bind(lambda x: seen.append(id(x)), "a"), sets.bind(lambda x: seen.append(id(x)), "b")
    for _ in range(3):
        one(), two()
    assert len(set(seen[:3])) == 3 and seen[3] == seen[0]  # consecutive calls never share a set


def test_timed_calls_rotate_over_the_sets():
    seen = []

    def candidate(x):
        seen.append(x)  # kept alive, so ids are not reused
        return x.sum()

    result = run_comparison(candidate, lambda x: x.sum(), FAST, inputs=_rng_inputs())
    assert result.input_sets == 3 and len({id(x) for x in seen}) == 3 + 2  # the sets, and the two fresh ones of the check
    assert result.to_record().run.inputs_owned
    assert result.to_record().to_json()["input_sets"] == 3
    assert any("3 input sets" in n for n in result.notes)
    assert any("outputs on fresh inputs matched the baseline's" in n for n in result.notes)


def test_without_inputs_nothing_is_owned():
    x = np.arange(10.0)
    result = run_comparison(lambda: x.sum(), lambda: x.sum(), FAST)
    assert result.input_sets is None and not result.to_record().run.inputs_owned


def test_a_cached_result_is_named_as_reuse():
    cache = {}

    def cached(x):  # computes once, then returns that forever
        return cache.setdefault("out", x * 2)

    with pytest.raises(inputs.FreshOutputMismatch, match="the candidate returns the same output for different inputs"):
        run_comparison(cached, lambda x: x + x, FAST, inputs=_rng_inputs())


def test_a_kernel_wrong_on_new_data_is_named_as_differing():
    first = _rng_inputs(seed=1)()[0]

    def right_on_seen_data_only(x):
        return x * 2 if x.sum() == first.sum() else x * 2 + 1

    with pytest.raises(inputs.FreshOutputMismatch, match="output on fresh inputs differs from the baseline's"):
        run_comparison(lambda x: x * 2 + 1e-3, lambda x: x + x, FAST, inputs=_rng_inputs())


def test_a_buffer_overwritten_in_place_is_not_mistaken_for_reuse():
    buffer = np.empty(64)
    run_comparison(lambda x: np.multiply(x, 2, out=buffer), lambda x: x + x, FAST, inputs=_rng_inputs())


def test_outputs_without_elements_are_refused_rather_than_matched():
    # Empty outputs "matched the baseline's": a candidate returning anything empty would have passed.
    with pytest.raises(ValueError, match=r"the check on fresh inputs compared no elements: the baseline's output of "
                                         r"shape \(0,\) holds none"):
        run_comparison(lambda x: x[:0] + 1, lambda x: (x + x)[:0], FAST, inputs=_rng_inputs())
    with pytest.raises(ValueError, match=r"the baseline's output\[0\] of shape \(0, 3\), output\[1\] of shape "
                                         r"\(0,\) holds none"):
        inputs.check_fresh_outputs(lambda x: (np.empty((0, 3)), x[:0]), lambda x: (np.empty((0, 3)), x[:0]),
                                   _rng_inputs())
    # An empty part beside one with elements is passed over, and the part with elements is still compared.
    with pytest.raises(inputs.FreshOutputMismatch, match=r"output\[1\]: Tensors are not close"):
        inputs.check_fresh_outputs(lambda x: (x[:0], x * 3), lambda x: (x[:0], x + x), _rng_inputs())
    inputs.check_fresh_outputs(lambda x: (x[:0], x * 2), lambda x: (x[:0], x + x), _rng_inputs())


def test_sides_that_return_none_are_refused_rather_than_matched():
    # Two sides that write into buffers and return None "matched": a candidate writing garbage would have passed.
    def writes_double(x):
        np.multiply(x, 2, out=x)

    def writes_garbage(x):
        x[:] = 7.0

    with pytest.raises(ValueError, match=r"compared no elements: the baseline's output \(None\) holds none.*should "
                                         r"return it"):
        run_comparison(writes_garbage, writes_double, FAST, inputs=_rng_inputs())
    with pytest.raises(ValueError, match=r"output\[1\] \(None\) holds none"):
        inputs.check_fresh_outputs(lambda x: (x[:0], None), lambda x: (x[:0], None), _rng_inputs())
    # None beside a part with elements is passed over; the part with elements is still compared.
    inputs.check_fresh_outputs(lambda x: (None, x * 2), lambda x: (None, x + x), _rng_inputs())
    with pytest.raises(inputs.FreshOutputMismatch, match=r"output\[1\]: Tensors are not close"):
        inputs.check_fresh_outputs(lambda x: (None, x * 3), lambda x: (None, x + x), _rng_inputs())
    # Equal text is a comparison that could fail, so text alone is checked, not refused.
    inputs.check_fresh_outputs(lambda x: "ok", lambda x: "ok", _rng_inputs())
    with pytest.raises(inputs.FreshOutputMismatch, match="'no' != 'ok'"):
        inputs.check_fresh_outputs(lambda x: "no", lambda x: "ok", _rng_inputs())


def test_check_policy_callable_and_false():
    loose = lambda x: x * 2 * (1 + 1e-4)  # noqa: E731
    with pytest.raises(inputs.FreshOutputMismatch):
        run_comparison(loose, lambda x: x + x, FAST, inputs=_rng_inputs())  # float64 policy: too far
    run_comparison(loose, lambda x: x + x, FAST, inputs=_rng_inputs(), check="fp16")
    calls = []
    run_comparison(loose, lambda x: x + x, FAST, inputs=_rng_inputs(), check=lambda c, b: calls.append(1))
    assert len(calls) == 2
    result = run_comparison(lambda x: x, lambda x: x + x, FAST, inputs=_rng_inputs(), check=False)
    assert any("check=False" in n for n in result.notes)


def test_keyword_inputs_and_tournament_and_measure():
    rng = np.random.default_rng(0)
    make = lambda: {"x": rng.random(32)}  # noqa: E731
    assert run_comparison(lambda x: x * 2, lambda x: x + x, FAST, inputs=make).input_sets == 3
    t = run_tournament({"a": lambda x: x * 2, "b": lambda x: x + x}, FAST, inputs=make)
    assert t.input_sets == 3
    with pytest.raises(inputs.FreshOutputMismatch, match="variant 'b' returns the same output"):
        kept = make()["x"] * 2
        run_tournament({"a": lambda x: x * 2, "b": lambda x: kept}, FAST, inputs=make)
    assert run_measurement(lambda x: x.sum(), FAST, inputs=make).input_sets == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inputs": 3}, "inputs must be a zero-argument callable"),
        ({"inputs": lambda: [1]}, "inputs\\(\\) must return a tuple of arguments or a dict"),
        ({"inputs": lambda: (1,), "check": 3}, "check must be a tolerance policy"),
        ({"check": 3}, "check must be a tolerance policy"),  # without inputs= too: it checks the first outputs
        ({"inputs": lambda: (1, 2)}, "candidate must accept the inputs"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(TypeError, match=message):
        run_comparison(lambda x: x, lambda x: x, FAST, **kwargs)


def test_bimodal_cpu_samples_are_named_with_the_fix():
    # Injected samples: half the calls 16x slower, as torch's thread pool did to a 64^3 matmul on two cores.
    fast, steady = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({
        fast: lambda rng, now: 1e-3 if rng.random() < 0.5 else 16e-3,
        steady: lambda rng, now: 1e-3 * (1 + 0.01 * rng.random()),
    })
    notes = run_comparison(fast, steady, Budget(max_time=0.5, warmup=0.0, seed=0), timer=timer).notes
    spread = [n for n in notes if "bimodal or widely spread" in n]
    assert len(spread) == 1 and spread[0].startswith("candidate's") and "--kernel-ab-cpu-threads 1" in spread[0]


def test_steady_cpu_samples_get_no_spread_note():
    one, two = (lambda: None), (lambda: None)
    timer = timing.SimulatedTimer({f: lambda rng, now: 1e-3 * (1 + 0.05 * rng.random()) for f in (one, two)})
    notes = run_comparison(one, two, Budget(max_time=0.5, warmup=0.0, seed=0), timer=timer).notes
    assert not any("bimodal" in n for n in notes)
