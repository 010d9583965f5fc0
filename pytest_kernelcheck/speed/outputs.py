"""Output snapshots and exact diffs: snapshot a callable's output and say exactly how a later one differs.

The A/B engine keeps each callable's first output (:func:`snapshot`, so that in-place reuse of a buffer cannot
change it), calls it again after timing and asks :func:`output_difference` whether anything changed: a timing
says nothing if the callable skipped work or returned something else. Equality is exact; NaN counts as a
change; a type without an exact, True/False ``==`` raises :class:`OutputNotComparable` instead of guessing.

>>> output_difference([1, {"k": 2}], [1, {"k": 3}])
"output[1]['k'] changed: 2 -> 3"
"""
from __future__ import annotations

import cmath
import collections.abc
import enum
import inspect
import sys
from typing import Any


class OutputChanged(Exception):
    """A compared callable returned something different after timing than on its first call."""


class OutputNotComparable(TypeError):
    """The output check cannot tell whether an output changed: its type has no exact, True/False equality.

    Raised instead of reporting a change that may not have happened (or missing one): objects without ``==`` of
    their own compare by identity, and an ``==`` that answers with an array or frame says nothing as a whole.
    """


class LazyOutput(TypeError):
    """A compared callable returned a generator, iterator or coroutine: its work waits until the output is consumed.

    Timing such a callable times making the generator, not the work (a generator over sorting read as a 1700x win
    over the sort itself), whether or not the output is checked, so it is refused before timing.
    """


# What output_difference compares, for the message that refuses anything else.
COMPARABLE_OUTPUTS = (
    "comparable: torch tensors, numpy arrays and numpy scalars, None, enum members, classes, torch dtypes, values "
    "whose == returns True or False (numbers, str, bytes, dataclasses of such values), and tuples, lists and dicts "
    "of these"
)


def snapshot(value: Any) -> Any:
    """A copy of an output that later calls cannot overwrite (tensors and arrays are cloned, containers rebuilt).

    >>> import numpy as np
    >>> buffer = np.zeros(2)
    >>> kept = snapshot({"out": [buffer]})
    >>> buffer += 1
    >>> kept["out"][0]
    array([0., 0.])
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().clone()
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value) if not hasattr(value, "_fields") else type(value)(
            *(snapshot(v) for v in value)
        )
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


def lazy_output(value: Any, path: str = "output") -> str | None:
    """What in an output defers its work until consumed or awaited (generators, iterators such as ``map``,
    coroutines), looking inside tuples, lists and dicts; None when nothing does.

    >>> lazy_output([1, (v for v in "ab")])
    'output[1], a generator,'
    >>> lazy_output({"out": [1, 2]}) is None
    True
    """
    if isinstance(value, (list, tuple)):
        items: Any = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{path}[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, (collections.abc.Iterator, collections.abc.AsyncIterator)) or inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # never to be awaited: closed now rather than warned about at garbage collection
        return f"{path}, a {type(value).__name__},"
    else:
        return None
    return next((found for found in (lazy_output(item, where) for where, item in items) if found), None)


def output_difference(first: Any, again: Any, path: str = "output") -> str | None:
    """Describe how ``again`` differs from ``first`` (exact equality), or ``None`` when it does not.

    NaN counts as a difference: an output with NaN is never accepted as unchanged. An output whose type cannot
    be compared exactly (see ``COMPARABLE_OUTPUTS``) raises :class:`OutputNotComparable` naming where it sits,
    whatever the values: identity or an abridged text would report changes that did not happen, or miss some.

    >>> output_difference((1, [2, 3]), (1, [2, 4]))
    'output[1][1] changed: 3 -> 4'
    >>> output_difference({"out": object()}, {"out": object()})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.speed.outputs.OutputNotComparable: output['out']: cannot compare outputs of type object: ...
    """
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    if torch is not None and isinstance(first, torch.Tensor):
        return _tensor_difference(torch, first, again, path)
    if numpy is not None and isinstance(first, numpy.ndarray):
        if not isinstance(again, numpy.ndarray):
            return f"{path} changed type: ndarray -> {type(again).__name__}"
        if first.shape != again.shape or first.dtype != again.dtype:
            return f"{path} changed: shape {first.shape} {first.dtype} -> {again.shape} {again.dtype}"
        if first.dtype.kind == "O":
            # Elements are Python objects: numpy would compare them with their own == (identity for many), so
            # each is compared by these rules instead.
            for index in numpy.ndindex(first.shape):
                where = f"{path}[{', '.join(map(str, index))}]"
                difference = output_difference(first[index], again[index], where)
                if difference:
                    return difference
            return None
        if first.dtype.kind in "fc" and (numpy.isnan(first).any() or numpy.isnan(again).any()):
            return f"{path} contains NaN; an output with NaN is not worth timing"
        if not numpy.array_equal(first, again):
            return f"{path} values changed ({int(numpy.sum(first != again))} of {first.size} elements differ)"
        return None
    if isinstance(first, (list, tuple)):
        if not isinstance(again, (list, tuple)) or len(first) != len(again):
            return f"{path} changed structure: {_brief(first)} -> {_brief(again)}"
        for index, (a, b) in enumerate(zip(first, again)):
            difference = output_difference(a, b, f"{path}[{index}]")
            if difference:
                return difference
        return None
    if isinstance(first, dict):
        if not isinstance(again, dict) or first.keys() != again.keys():
            return f"{path} changed structure: {_brief(first)} -> {_brief(again)}"
        for key in first:
            difference = output_difference(first[key], again[key], f"{path}[{key!r}]")
            if difference:
                return difference
        return None
    if _is_nan_scalar(first, numpy):
        return f"{path} is NaN"
    return None if _scalars_equal(first, again, path, numpy) else f"{path} changed: {first!r} -> {again!r}"


def _is_nan_scalar(value: Any, numpy: Any) -> bool:
    """NaN as a Python float or complex or a numpy floating or complex scalar (NaN never equals itself)."""
    if isinstance(value, (float, complex)):
        return cmath.isnan(value)
    return numpy is not None and isinstance(value, numpy.generic) and value.dtype.kind in "fc" and bool(
        numpy.isnan(value)
    )


def _identity_is_exact(value: Any) -> bool:
    """Values that exist once each, so that identity is their equality: None, enum members, classes, dtypes."""
    if value is None or value is Ellipsis or isinstance(value, (enum.Enum, type)):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def _scalars_equal(first: Any, again: Any, path: str, numpy: Any) -> bool:
    """``first == again`` when that is an exact answer; raise ``OutputNotComparable`` when it is not."""
    kind = type(first).__name__
    if _identity_is_exact(first):
        return first is again
    if type(first).__eq__ is object.__eq__:
        raise OutputNotComparable(
            f"{path}: cannot compare outputs of type {kind}: it has no == of its own, so two equal results would "
            f"compare by identity and look changed; {COMPARABLE_OUTPUTS}"
        )
    try:
        result = first == again
    except Exception as exc:  # e.g. a dataclass holding tensors: its == asks bool() of a whole tensor
        raise OutputNotComparable(
            f"{path}: cannot compare outputs of type {kind}: its == raised {type(exc).__name__}: {exc}; "
            f"{COMPARABLE_OUTPUTS}"
        ) from exc
    if isinstance(result, bool) or (numpy is not None and isinstance(result, numpy.bool_)):
        return bool(result)
    # An elementwise answer (an array, a frame): its text is abridged, so comparing text would miss changes.
    raise OutputNotComparable(
        f"{path}: cannot compare outputs of type {kind}: its == returns {type(result).__name__}, not True or "
        f"False; {COMPARABLE_OUTPUTS}"
    )


def _tensor_difference(torch: Any, first: Any, again: Any, path: str) -> str | None:
    if not isinstance(again, torch.Tensor):
        return f"{path} changed type: Tensor -> {type(again).__name__}"
    if first.shape != again.shape or first.dtype != again.dtype:
        return f"{path} changed: shape {tuple(first.shape)} {first.dtype} -> {tuple(again.shape)} {again.dtype}"
    if first.is_floating_point() or first.is_complex():
        if bool(torch.isnan(first).any()) or bool(torch.isnan(again).any()):
            return f"{path} contains NaN; an output with NaN is not worth timing"
    again = again.to(first.device)
    if torch.equal(first, again):
        return None
    differing = first != again
    message = f"{path} values changed ({int(differing.sum())} of {first.numel()} elements differ"
    if first.is_floating_point():
        message += f", max |diff| {float((first.double() - again.double()).abs().max()):.3g}"
    return message + ")"


def brief_value(value: Any) -> str:
    """A value as messages name it: its type, and a tensor's or array's shape, dtype and device; never its
    elements (a tensor's text is a hundred lines), and other values' text cut to 60 characters.

    >>> import numpy as np
    >>> brief_value(np.zeros((2, 3), dtype=np.float32)), brief_value(3)
    ('ndarray of shape (2, 3), float32 on cpu', 'int 3')
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        device = getattr(value, "device", None)
        return (f"{type(value).__name__} of shape {tuple(shape)}, {str(dtype).replace('torch.', '')}"
                + (f" on {device}" if device is not None else ""))
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _brief(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"dict with keys {sorted(map(str, value))}"
    return type(value).__name__
