"""assert_close refuses a result compared with itself whether it is given as a tensor, a numpy array or a mix of
both, through any view or slice that reads the same elements; other views of one buffer are compared as usual."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pytest_kernelcheck import assert_close
from pytest_kernelcheck.check.aliasing import same_elements

ITSELF = r"expected is actual itself .* so the comparison cannot fail"


def _aliased_pairs():
    rng = np.random.default_rng()
    array = rng.standard_normal((6, 10))
    tensor = torch.randn(6, 10, dtype=torch.float32)
    integers = torch.randint(-100, 100, (5, 7))
    row = torch.randn(10)
    return {
        "numpy array and itself": (array, array),
        "numpy array and a view": (array, array.view()),
        "numpy equal slices": (array[1:, ::2], array[1:, ::2]),
        "tensor and its numpy": (tensor, tensor.numpy()),
        "numpy of a tensor and the tensor": (tensor.numpy(), tensor),
        "numpy array and torch.from_numpy": (array, torch.from_numpy(array)),
        "tensor slice and its numpy": (tensor[2:, 3:7], tensor.numpy()[2:, 3:7]),
        "integer tensor and its numpy": (integers, integers.numpy()),
        "a size-1 axis with another stride": (row.view(1, 10), row.unsqueeze(0).as_strided((1, 10), (99, 1))),
        "0-d views of one element": (array[0, 0, ...], array[0, 0, ...]),
    }


@pytest.mark.parametrize("case", list(_aliased_pairs()))
def test_a_result_compared_with_itself_is_refused_across_numpy_and_torch(case):
    actual, expected = _aliased_pairs()[case]
    assert same_elements(actual, expected)
    with pytest.raises(ValueError, match=ITSELF):
        assert_close(actual, expected)


def test_a_baseline_that_is_actual_given_as_numpy_is_refused():
    actual = torch.randn(4, 9, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"baseline is actual itself .* so the comparison cannot fail"):
        assert_close(actual, actual.double() + 1.0, baseline=actual.numpy())


def test_other_views_of_the_same_memory_are_compared_and_can_fail():
    array = np.random.default_rng().standard_normal((6, 10))
    tensor = torch.from_numpy(array)
    # Shifted slices read other (random) elements, a transpose other positions, another dtype other values.
    for actual, expected in ((array[1:], array[:-1]), (tensor[:, 1:], array[:, :-1]),
                             (array[:6, :6], array[:6, :6].T), (tensor.view(torch.int64), array)):
        assert not same_elements(actual, expected)
        with pytest.raises(AssertionError, match="mismatched elements"):
            assert_close(actual, expected)
    assert assert_close(array, array.copy()).passed
    assert assert_close(tensor.float(), array).passed  # a float32 result against its float64 source
