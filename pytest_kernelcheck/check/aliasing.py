"""Whether two arrays read the very same memory as the very same values, across torch tensors and numpy arrays.

:func:`pytest_kernelcheck.check.tolerance.assert_close` refuses such a pair: a result compared with itself passes
whatever the kernel did. Two views alias element for element when, at every index, they read the same address
as the same dtype: a tensor and its ``.numpy()``, an array and itself, two equal slices or views of one buffer.
A view that reads other elements (a shifted slice, a transpose) or the same bytes as another dtype can differ,
so it is compared as usual.

>>> import numpy as np, torch
>>> t = torch.arange(6.0)
>>> same_elements(t, t.numpy()), same_elements(t[1:], t[:-1])
(True, False)
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch


class _Layout(NamedTuple):
    """Where each element of an array lives: device, first element's address, element type, shape and the byte
    step per dimension (dimensions of size 1 step nowhere, so their stride does not count)."""

    device: str
    address: int
    dtype: str
    shape: tuple[int, ...]
    byte_strides: tuple[int, ...]


def _layout(value: Any) -> _Layout | None:
    """The layout of a dense torch tensor or numpy array with elements; None for anything else."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested or value.device.type == "meta" or value.numel() == 0:
            return None
        if value.is_neg() or value.is_conj():  # a lazily negated view reads other values from the same memory
            return None
        size = value.element_size()
        # numpy's name for the dtype, where it has one, so that a tensor and its .numpy() compare equal.
        dtype = str(torch.empty((), dtype=value.dtype).numpy().dtype) if _numpy_has(value.dtype) else str(value.dtype)
        device = str(value.device) if value.device.type != "cpu" else "cpu"
        strides = tuple(step * size for step in value.stride())
        return _Layout(device, value.data_ptr(), dtype, tuple(value.shape), _steps(value.shape, strides))
    if isinstance(value, np.ndarray):
        if value.size == 0:
            return None
        address = value.__array_interface__["data"][0]
        return _Layout("cpu", address, str(value.dtype), tuple(value.shape), _steps(value.shape, value.strides))
    return None


def _numpy_has(dtype: torch.dtype) -> bool:
    try:
        torch.empty((), dtype=dtype).numpy()
    except (TypeError, RuntimeError):  # bfloat16, float8 and the like have no numpy dtype
        return False
    return True


def _steps(shape: Any, strides: Any) -> tuple[int, ...]:
    return tuple(0 if extent == 1 else stride for extent, stride in zip(shape, strides))


def same_elements(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (torch tensors or numpy arrays, in any mix) read the same memory as the same values
    at every index, so that comparing them cannot fail.

    >>> import numpy as np
    >>> x = np.ones((3, 4))
    >>> same_elements(x, x), same_elements(x[:, 1:3], x[:, 1:3]), same_elements(x, x.copy())
    (True, True, False)
    """
    first, second = _layout(a), _layout(b)
    return first is not None and first == second
