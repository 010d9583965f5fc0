"""Output re-check: snapshots, exact diffs, outputs that cannot be compared, and the check inside a comparison."""
from __future__ import annotations

import dataclasses
import enum

import numpy as np
import pytest
import torch

from pytest_kernelcheck import Budget, run_comparison
from pytest_kernelcheck.speed import outputs
from pytest_kernelcheck.speed.timing import SimulatedTimer

QUICK = Budget(max_time=0.2, warmup=0.0)


def constant(seconds: float):
    return lambda rng, now: seconds


def assert_difference(first, again, expected: str | None) -> None:
    """``output_difference`` finds no change (expected None), or a change whose text starts with ``expected``."""
    difference = outputs.output_difference(first, again)
    if expected is None:
        assert difference is None
    else:
        assert difference is not None and difference.startswith(expected)


def test_output_changing_shape_between_calls_is_detected():
    state = {"n": 0}

    def growing():
        state["n"] += 1
        return torch.zeros(4, 4 + state["n"] // 50)

    with pytest.raises(outputs.OutputChanged, match=r"candidate output is not the same.*shape \(4, 4\)"):
        run_comparison(growing, lambda: torch.zeros(4, 4), QUICK)


def test_nan_outputs_are_refused_before_timing():
    with pytest.raises(ValueError, match="baseline output contains NaN"):
        run_comparison(lambda: torch.ones(2), lambda: torch.tensor([1.0, float("nan")]), QUICK)
    with pytest.raises(ValueError, match=r"candidate output\[0\] contains NaN"):
        run_comparison(lambda: [np.array([np.nan])], lambda: None, QUICK)


def test_output_check_can_be_disabled_for_nondeterministic_kernels():
    noisy = lambda: torch.rand(3)  # noqa: E731
    result = run_comparison(noisy, noisy, QUICK.replace(check_output=False), check=False)
    assert result.verdict in ("win", "loss", "tie", "inconclusive")


@pytest.mark.parametrize(
    "first, again, expected",
    [
        (torch.ones(3), torch.ones(3), None),
        (torch.ones(3), torch.ones(4), "output changed: shape (3,) torch.float32 -> (4,) torch.float32"),
        (torch.ones(3), torch.tensor([1.0, 2.0, 1.0]), "output values changed (1 of 3 elements differ, max |diff| 1)"),
        (torch.tensor([float("nan")]), torch.tensor([float("nan")]), "output contains NaN"),
        ((torch.ones(2), None), (torch.ones(2), None), None),
        ([1, {"k": np.arange(3)}], [1, {"k": np.array([0, 1, 3])}], "output[1]['k'] values changed"),
        ((1, 2), (1, 2, 3), "output changed structure: tuple of 2 -> tuple of 3"),
        (None, None, None),
        (float("nan"), float("nan"), "output is NaN"),
    ],
)
def test_output_difference(first, again, expected):
    assert_difference(first, again, expected)


class Opaque:
    """No == of its own: Python would compare two equal results by identity."""

    def __init__(self, value):
        self.value = value


class ArrayEquality:
    """== answers with an array, as numpy arrays and data frames do; the text hides the values."""

    def __init__(self, values):
        self.values = np.asarray(values)

    def __eq__(self, other):
        return self.values == other.values

    def __repr__(self):
        return "ArrayEquality(...)"


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass
class Pair:
    low: int
    high: int


@dataclasses.dataclass
class TensorHolder:
    values: torch.Tensor


@pytest.mark.parametrize(
    "first, again, expected",
    [
        (np.float32("nan"), np.float32("nan"), "output is NaN"),
        (complex("nan"), complex("nan"), "output is NaN"),
        (np.float32(1.5), np.float32(1.5), None),
        (Pair(1, 2), Pair(1, 2), None),  # a type with its own == returning True/False is compared by it
        (Pair(1, 2), Pair(1, 3), "output changed: Pair(low=1, high=2) -> Pair(low=1, high=3)"),
        (np.array([1, "a", None], dtype=object), np.array([1, "a", None], dtype=object), None),
        (np.array([[1, 2]], dtype=object), np.array([[1, 3]], dtype=object), "output[0, 1] changed: 2 -> 3"),
        # Identity is exact for values that exist once each (no == of their own, yet comparable).
        ((Colour.RED, torch.float16, int), (Colour.RED, torch.float16, int), None),
        ((Colour.RED,), (Colour.BLUE,), "output[0] changed: <Colour.RED: 1> -> <Colour.BLUE: 2>"),
        ([torch.float16], [torch.bfloat16], "output[0] changed: torch.float16 -> torch.bfloat16"),
    ],
)
def test_output_difference_of_numpy_scalars_value_types_and_object_arrays(first, again, expected):
    assert_difference(first, again, expected)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Opaque(1), "output: cannot compare outputs of type Opaque: it has no == of its own"),
        (lambda: (1, [Opaque(1)]), r"output\[1\]\[0\]: cannot compare outputs of type Opaque"),
        (lambda: {"k": ArrayEquality([1, 2])},
         r"output\['k'\]: cannot compare outputs of type ArrayEquality: its == returns ndarray, not True or False"),
        (lambda: TensorHolder(torch.ones(3)),
         "output: cannot compare outputs of type TensorHolder: its == raised RuntimeError"),
        (lambda: np.array([Opaque(1)], dtype=object), r"output\[0\]: cannot compare outputs of type Opaque"),
    ],
)
def test_outputs_that_cannot_be_compared_say_so_instead_of_changed(make, message):
    with pytest.raises(outputs.OutputNotComparable, match=message + ".*comparable: torch tensors, numpy arrays"):
        outputs.output_difference(make(), make())


def test_an_equality_that_is_not_true_or_false_is_not_replaced_by_comparing_text():
    # The text of large arrays and frames is abridged: equal text said "unchanged" for different values.
    with pytest.raises(outputs.OutputNotComparable, match="its == returns ndarray"):
        outputs.output_difference(ArrayEquality([1, 2]), ArrayEquality([1, 3]))


def test_an_uncomparable_output_is_refused_before_timing_with_the_way_out():
    a, b = (lambda: Opaque(1)), (lambda: torch.ones(2))
    timer = SimulatedTimer({a: constant(1e-3), b: constant(2e-3)})
    with pytest.raises(outputs.OutputNotComparable,
                       match=r"candidate output: cannot compare outputs of type Opaque.*pass check_output=False"):
        run_comparison(a, b, QUICK, timer=timer)
    assert run_comparison(a, b, QUICK.replace(check_output=False), timer=timer).verdict == "win"
    pair = lambda: Pair(1, 2)  # noqa: E731  (a fresh, equal object each call is not a change)
    timer = SimulatedTimer({pair: constant(1e-3), b: constant(2e-3)})
    assert run_comparison(pair, b, QUICK, timer=timer).verdict == "win"


def test_snapshot_protects_the_first_output_from_in_place_reuse():
    buffer = torch.arange(4.0)
    kept = outputs.snapshot((buffer, [buffer]))
    buffer.add_(1)
    assert torch.equal(kept[0], torch.arange(4.0)) and torch.equal(kept[1][0], torch.arange(4.0))


def _lazy_outputs(data):
    """Callables whose output does the work only when consumed (or awaited): timing one times almost nothing."""
    async def later():
        return np.sort(data)

    return {
        "generator": lambda: (v * 2 for v in data),
        "map": lambda: map(float, data),
        "coroutine": later,
        "tuple holding a generator": lambda: (np.sort(data), (v for v in data)),
    }


@pytest.mark.parametrize("kind", ["generator", "map", "coroutine", "tuple holding a generator"])
@pytest.mark.parametrize("side", ["candidate", "baseline"])
def test_a_lazy_output_is_refused_before_timing_even_without_the_output_check(kind, side):
    # Timed, a generator's creation read as a 1700x "win" over sorting the same data, and check_output=False (the
    # way out the refusal of an uncomparable output offers) let it through.
    data = np.random.default_rng().random(int(np.random.default_rng().integers(1_000, 5_000)))
    lazy, eager = _lazy_outputs(data)[kind], (lambda: np.sort(data))
    timer = SimulatedTimer({lazy: constant(1e-6), eager: constant(1e-3)})
    pair = (lazy, eager) if side == "candidate" else (eager, lazy)
    for budget in (QUICK, QUICK.replace(check_output=False)):
        with pytest.raises(outputs.LazyOutput, match=rf"^{side} returned .*only when .*list\(\.\.\.\)"):
            run_comparison(*pair, budget, timer=timer)
