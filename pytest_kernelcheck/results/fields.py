"""The checked fields of a report's JSON: numbers, intervals, and the errors that name a field no run writes."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

# A speedup interval as JSON holds it: None stands for an unbounded end (JSON has no infinity).
Interval = tuple[float | None, float | None]
UNBOUNDED: Interval = (None, None)


class NotAReport(ValueError):
    """The data is not an A/B report: no ``schema`` of ours, or no list of comparisons."""


class DamagedReport(ValueError):
    """A report or record holds a field that no run writes; the message names the field and what is accepted."""


def finite_interval(ci: Sequence[float]) -> Interval:
    """An interval with its infinite ends as None, the form records keep.

    >>> finite_interval((0.0, math.inf))
    (0.0, None)
    """
    low, high = ci
    return (low if math.isfinite(low) else None, high if math.isfinite(high) else None)


def is_number(value: Any) -> bool:
    # bool is an int to Python, but true/false in a report is no number a run writes.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checked_number(data: Mapping[str, Any], key: str, *, positive: bool = False, at_most: float | None = None
                    ) -> float | None:
    """``data[key]`` when it is null or a finite number, above 0 (``positive``) or else 0 or more, and at most
    ``at_most``; ``DamagedReport`` naming the field otherwise.

    >>> checked_number({"speedup": 1.5}, "speedup", positive=True)
    1.5
    >>> checked_number({"speedup": -3}, "speedup", positive=True)
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.fields.DamagedReport: field 'speedup': -3 is refused; accepted: a finite number above 0, or null
    """
    value = data.get(key)
    if value is None:
        return None
    bounds = ("above 0" if positive else "0 or more") + (f" and at most {at_most:g}" if at_most is not None else "")
    if (not is_number(value) or not math.isfinite(value) or value < 0 or (positive and value == 0)
            or (at_most is not None and value > at_most)):
        raise DamagedReport(f"field {key!r}: {value!r} is refused; accepted: a finite number {bounds}, or null")
    return value


def interval_from_json(value: Any, key: str = "ci") -> Interval:
    """An interval as JSON holds it: null (unbounded), or two ends, each null (unbounded) or a number 0 or more
    (speedups and times are never negative), the low end finite and not above the high one. An infinite high end
    is unbounded too, as intervals are before :func:`finite_interval`.

    >>> interval_from_json([1.1, None]), interval_from_json(None)
    ((1.1, None), (None, None))
    >>> interval_from_json([5.0, 1.0])
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.fields.DamagedReport: field 'ci': [5.0, 1.0] is refused; accepted: [low, high] with low <= \
high, each a number 0 or more or null (unbounded)
    """
    if value is None:
        return UNBOUNDED
    accepted = "accepted: [low, high] with low <= high, each a number 0 or more or null (unbounded)"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise DamagedReport(f"field {key!r}: {value!r} is refused; {accepted}")
    low, high = value
    # "not end >= 0" is true of NaN as well as of negative numbers.
    if any(end is not None and (not is_number(end) or not end >= 0) for end in (low, high)) or (
            low is not None and (math.isinf(low) or (high is not None and low > high))):
        raise DamagedReport(f"field {key!r}: {value!r} is refused; {accepted}")
    return (low, high)
