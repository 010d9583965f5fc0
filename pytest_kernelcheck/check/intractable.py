"""The ``intractable`` marker: which cases not to run, and the reason each is skipped with.

``@pytest.mark.intractable(when, reason=None)``: ``when`` is a bool, or a callable of the test's shape returning
a reason string (or a bool, or None). The plugin checks the arguments at collection
(:func:`parse_intractable_marker`), skips a case for which any of its ``intractable`` markers (on the test, its
class or module) gives a reason (:func:`case_reason`; the reason is carried on its report) and lists those cases
with their reasons in the terminal summary (:func:`listed_cases`).
"""
from __future__ import annotations

from typing import Any, Iterable

from .shapes import marker_values, python_scalar, short_repr


def parse_intractable_marker(
    args: tuple[Any, ...], kwargs: dict[str, Any], has_shape: bool
) -> tuple[Any, str | None]:
    """Check the arguments of ``@pytest.mark.intractable(when, reason=None)``; returns (when, reason).

    Example::

        >>> parse_intractable_marker((True,), {"reason": "scores need 20 TiB"}, has_shape=False)
        (True, 'scores need 20 TiB')
    """
    values = marker_values("intractable", args, kwargs, "when", {"when", "reason"}, "(when, reason=None)")
    if "reason" in kwargs:
        values.append(kwargs["reason"])
    if not 1 <= len(values) <= 2:
        raise TypeError("intractable marker takes (when, reason=None): a bool or a callable of the shape, and a reason")
    when = values[0] if callable(values[0]) else python_scalar(values[0])
    reason = values[1] if len(values) == 2 else None
    if not (isinstance(when, bool) or callable(when)):
        raise TypeError(
            "intractable marker: `when` must be a bool (numpy bools too) or a callable of the shape; got "
            f"{short_repr(values[0], 60)} ({type(values[0]).__name__})"
        )
    if callable(when) and not has_shape:
        raise TypeError(
            "intractable marker: a callable `when` receives the shape, but the test has no @pytest.mark.shape"
        )
    if reason is not None and not isinstance(reason, str):
        raise TypeError(
            "intractable marker: `reason` must be a string or None; got "
            f"{short_repr(reason, 60)} ({type(reason).__name__})"
        )
    return when, reason


def intractable_reason(when: Any, reason: str | None, shape: Any) -> str | None:
    """Why this case cannot run, or None when it can.

    ``when`` is a bool or a callable of the shape returning a reason string, a bool or None; numpy bools and
    0-d bool tensors count as bools (``lambda s: np.int64(s.S) > 10**5`` returns one). True uses ``reason``
    (or "marked intractable").

    Example::

        >>> from pytest_kernelcheck import human_bytes
        >>> intractable_reason(lambda s: f"scores need {human_bytes(s['n'] ** 2 * 8)}" if s["n"] > 10**5 else None,
        ...                    None, {"n": 10**6})
        'scores need 7.28 TiB'
    """
    verdict = when(shape) if callable(when) else when
    plain = python_scalar(verdict)
    if plain is None or plain is False:
        return None
    if plain is True:
        return reason or "marked intractable"
    if isinstance(plain, str):
        return plain or None
    raise TypeError(
        f"intractable marker: `when` returned {short_repr(verdict, 60)} ({type(verdict).__name__}); return a "
        "reason string, a bool (numpy bools and 0-d bool tensors too) or None"
    )


# The user_properties key that carries an intractable case's reason on its test report: user properties travel
# with the report, so the terminal summary of a pytest-xdist run lists the workers' cases too.
REASON_PROPERTY = "kernelcheck_intractable"


def case_reason(markers: Iterable[tuple[tuple[Any, ...], dict[str, Any]]], shape: Any) -> str | None:
    """Why the case ``shape`` is not to run under its ``intractable`` markers, given as ``(args, kwargs)`` pairs
    closest to the test first, or None when none of them gives a reason.

    Every marker counts, as every stacked ``skipif`` does: a module's or class's marker names cases no test of it
    can run, and a test's own marker adds its own; the closest one only would run the cases the others name. The
    first marker that gives a reason names it. ``shape`` is None for a test without a shape marker. Raises
    ``TypeError`` or ``ValueError`` for bad arguments of any marker.

    Example::

        >>> case_reason([((lambda s: s["S"] > 10**5,), {"reason": "too long"})], {"S": 10**6})
        'too long'
        >>> case_reason([((lambda s: s["D"] > 256,), {"reason": "too wide"}), ((True,), {"reason": "module"})],
        ...             {"D": 64})
        'module'
    """
    checked = [parse_intractable_marker(args, kwargs, shape is not None) for args, kwargs in markers]
    for when, reason in checked:
        found = intractable_reason(when, reason, shape)
        if found is not None:
            return found
    return None


def listed_cases(reports: Iterable[Any]) -> list[tuple[str, str]]:
    """The (test id, reason) of each intractable case among test reports, each test once, in report order.

    Example::

        >>> class Report:
        ...     nodeid, user_properties = "t.py::test_big[S100000]", [(REASON_PROPERTY, "needs 20 TiB")]
        >>> listed_cases([Report(), Report()])
        [('t.py::test_big[S100000]', 'needs 20 TiB')]
    """
    cases = {}
    for report in reports:
        for name, value in getattr(report, "user_properties", ()):
            if name == REASON_PROPERTY and report.nodeid not in cases:
                cases[report.nodeid] = value
    return list(cases.items())
