"""The ``shape`` marker: named problem sizes, their cross product with keyword axes, and readable test ids.

A marker such as ``shape(dict(B=4, S=2048), dtype=[torch.float16, torch.bfloat16], causal=True)`` expands into
one :class:`Shape` per (case, axis combination). Cases come first in the order given; for each case the keyword
axes are crossed in the order they were written (the last axis varies fastest). A keyword axis may be a list,
tuple, range, 1-D numpy array or 1-D torch tensor; numpy and torch scalars (0-d arrays and tensors too) become
the Python bool, int or float they hold, so ids and ``shape.S`` read as plain numbers.

Stacked markers (several ``shape`` markers on one test, or on its class or module) are crossed like stacked
``parametrize``: the marker closest to the test comes first in the id and varies slowest
(:func:`expand_shape_markers`). Two stacked markers may not name the same size.

Test ids join one piece per entry with ``-``:

- a number: the name followed by the value, ``B4``, ``S2048``, ``p0.1`` (``name=value`` when the name ends in a
  digit, so ``D2=64`` cannot be misread);
- a torch dtype: its bare name, ``float16``, ``bfloat16``;
- a bool: the name when true, ``no`` + the name when false: ``causal`` / ``nocausal``;
- a string: the string itself, ``lower_right``;
- a torch device: its text, ``cuda:0``;
- anything else: ``name=value``.

This module does not import torch: torch values are recognised through ``sys.modules``.
"""
from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any


class ShapeSpecError(ValueError):
    """A ``shape`` marker that cannot be expanded; the message names the problem."""


class Shape(Mapping):
    """One test case: an ordered, immutable, hashable set of named sizes and options.

    Entries read as attributes (``shape.B``) or items (``shape["B"]``); a name that is also a method of a
    mapping (``items``, ``keys``, ``values``, ``get``) or ``id`` reads as an item only.

    Example::

        >>> s = Shape({"B": 4, "S": 2048, "H": 16, "D": 64})
        >>> s.B, s.get("causal", False), s.as_dict()["S"]
        (4, False, 2048)
        >>> s.id
        'B4-S2048-H16-D64'
    """

    __slots__ = ("_items", "_hash")

    def __init__(self, entries: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()) -> None:
        items = tuple(entries.items()) if isinstance(entries, Mapping) else tuple(entries)
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ShapeSpecError(f"a shape may name each size once; got {names}")
        for name in names:
            _check_name(name)
        object.__setattr__(self, "_items", items)
        object.__setattr__(self, "_hash", None)

    # Mapping protocol: ``dict(shape)`` and ``**shape`` work.
    def __getitem__(self, name: str) -> Any:
        for key, value in self._items:
            if key == name:
                return value
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails, so slots and methods are never shadowed.
        if name.startswith("__"):
            raise AttributeError(name)
        for key, value in self._items:
            if key == name:
                return value
        available = ", ".join(key for key, _ in self._items) or "(none)"
        raise AttributeError(f"this shape has no entry {name!r}; available: {available}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Shape is immutable; build a new one with Shape({**shape.as_dict(), ...})")

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(tuple((k, _hashable(v)) for k, v in self._items)))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Shape):
            return self._items == other._items
        return NotImplemented

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={short_repr(v)}" for k, v in self._items)
        return f"Shape({inner})"

    def __reduce__(self):
        # Picklable for pytest-xdist, whose workers may send parameters home.
        return (Shape, (self._items,))

    def as_dict(self) -> dict[str, Any]:
        """A new ``dict`` of the entries, in order."""
        return dict(self._items)

    def get(self, name: str, default: Any = None) -> Any:
        """The value of ``name``, or ``default`` when this shape has no such entry."""
        for key, value in self._items:
            if key == name:
                return value
        return default

    @property
    def id(self) -> str:
        """The test id piece for this shape, e.g. ``B4-S2048-H16-D64-bfloat16-causal``."""
        return format_id(self)


def format_id(shape: Mapping[str, Any]) -> str:
    """The test id for ``shape``: one piece per entry, joined with ``-`` (rules in the module docstring).

    Example::

        >>> format_id({"B": 2, "causal": False, "mask": "lower_right"})
        'B2-nocausal-lower_right'
    """
    return "-".join(_id_piece(name, value) for name, value in shape.items()) or "noshape"


def python_scalar(value: Any) -> Any:
    """``value`` as a plain Python number when it is a numpy or torch scalar (or a 0-d array or tensor) of a
    bool, integer, float or complex type; anything else is returned unchanged.

    Example::

        >>> import numpy as np
        >>> python_scalar(np.int64(384)), python_scalar(np.array(0.5)), python_scalar(np.bool_(False))
        (384, 0.5, False)
    """
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        # Only numbers and bools: .item() would turn a datetime64 or an object array into something else.
        return value.item() if value.ndim == 0 and value.dtype.kind in "biufc" else value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    return value


def expand_shape_markers(markers: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> list[Shape]:
    """Cross stacked ``shape`` markers, given as ``(args, kwargs)`` pairs closest to the test first.

    Like stacked ``parametrize``, the closest marker's entries lead each id and its cases vary slowest.

    Example::

        >>> [s.id for s in expand_shape_markers([((dict(B=1), dict(B=2)), {}), ((), {"causal": [True, False]})])]
        ['B1-causal', 'B1-nocausal', 'B2-causal', 'B2-nocausal']

    Raises:
        ShapeSpecError: no marker, a marker :func:`expand_shape_marker` refuses (the message says which one
            when there are several), or two markers that name the same size.
    """
    if not markers:
        raise ShapeSpecError("expand_shape_markers needs at least one (args, kwargs) pair of a shape marker")
    expanded: list[list[Shape]] = []
    for position, (cases, axes) in enumerate(markers):
        try:
            expanded.append(expand_shape_marker(cases, axes))
        except ShapeSpecError as exc:
            if len(markers) == 1:
                raise
            problem = f"shape marker {position + 1} of {len(markers)} (counting from the test): {exc}"
        else:
            continue
        raise ShapeSpecError(problem)  # outside the except block: one message, no chained traceback
    # Cases of one marker may name different sizes; each marker's names in the order they first appear.
    names = [list(dict.fromkeys(name for shape in shapes for name in shape)) for shapes in expanded]
    for first, second in itertools.combinations(range(len(markers)), 2):
        shared = [name for name in names[first] if name in names[second]]
        if shared:
            raise ShapeSpecError(
                f"stacked shape markers {_marker_text(*markers[first])} and {_marker_text(*markers[second])} "
                f"both name {shared[0]!r}; stacked markers are crossed like stacked parametrize, so name each size "
                "in one of them only"
            )
    return [
        Shape([entry for shape in combination for entry in shape.items()])
        for combination in itertools.product(*expanded)
    ]


def expand_shape_marker(cases: Sequence[Any], axes: Mapping[str, Any]) -> list[Shape]:
    """Expand the positional cases and keyword axes of a ``shape`` marker into :class:`Shape` objects.

    Each case is a mapping of named sizes. A keyword given as a list, tuple, range, 1-D numpy array or 1-D
    torch tensor is an axis crossed with every case; any other keyword value (a number, string, bool, dtype,
    0-d array, ...) is added to every case. Numpy and torch scalars become Python numbers (:func:`python_scalar`).
    With no positional case, the axes alone are crossed.

    Example::

        >>> [s.id for s in expand_shape_marker([dict(B=1, S=8)], {"causal": [True, False], "D": 64})]
        ['B1-S8-causal-D64', 'B1-S8-nocausal-D64']

    Raises:
        ShapeSpecError: an empty marker, a case that is not a mapping, a name that is not an identifier, an
            axis that is empty, an unordered collection or an array of more than one dimension, or an axis that
            repeats a name of a case.
    """
    if not cases and not axes:
        raise ShapeSpecError(
            "the shape marker is empty: give at least one case, e.g. shape(dict(B=4, S=2048)), or an axis, "
            "e.g. shape(S=[128, 256])"
        )
    checked_cases: list[dict[str, Any]] = []
    for position, case in enumerate(cases):
        if not isinstance(case, Mapping):
            raise ShapeSpecError(
                f"case {position} of the shape marker is {short_repr(case)} ({type(case).__name__}); each case "
                "must be a mapping of named sizes such as dict(B=4, S=2048)"
            )
        for name in case:
            _check_name(name, where=f"case {position}")
        checked_cases.append({name: python_scalar(value) for name, value in case.items()})
    if not checked_cases:
        checked_cases = [{}]

    axis_values: list[tuple[str, tuple[Any, ...]]] = []
    for name, value in axes.items():
        _check_name(name, where="keyword axis")
        axis_values.append((name, _axis_values(name, value)))
    for position, case in enumerate(checked_cases):
        clash = [name for name, _ in axis_values if name in case]
        if clash:
            raise ShapeSpecError(
                f"keyword axis {clash[0]!r} is also set in case {position} ({short_repr(case)}); set it in one "
                "place only"
            )

    shapes = []
    for case in checked_cases:
        for combination in itertools.product(*(values for _, values in axis_values)):
            entries = list(case.items()) + [(name, v) for (name, _), v in zip(axis_values, combination)]
            shapes.append(Shape(entries))
    return shapes


_AXIS_KINDS = "a list, tuple, range, 1-D numpy array or 1-D tensor (its order sets the test order)"


def _axis_values(name: str, value: Any) -> tuple[Any, ...]:
    ndim = _array_ndim(value)
    if ndim is not None and ndim != 1:
        if ndim == 0:
            return (python_scalar(value),)
        raise ShapeSpecError(
            f"keyword axis {name!r} is a {ndim}-D {type(value).__name__} of shape {tuple(value.shape)}; an axis "
            f"must be {_AXIS_KINDS}, or a single value applied to every case"
        )
    if ndim == 1:
        value = value.tolist()  # Python scalars for numeric arrays and tensors
    if isinstance(value, (list, tuple, range)):
        if len(value) == 0:
            raise ShapeSpecError(f"keyword axis {name!r} is empty; give at least one value")
        return tuple(python_scalar(v) for v in value)
    if isinstance(value, (set, frozenset, Mapping)) or _is_iterator(value):
        raise ShapeSpecError(
            f"keyword axis {name!r} is a {type(value).__name__}; an axis must be {_AXIS_KINDS}, or a single "
            "scalar value applied to every case"
        )
    return (python_scalar(value),)


def _array_ndim(value: Any) -> int | None:
    """The number of dimensions of a numpy array or torch tensor, None for anything else."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return value.ndim
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.ndim
    return None


def _marker_text(cases: Sequence[Any], axes: Mapping[str, Any]) -> str:
    """A marker's arguments as written, shortened: ``shape(dict(B=2, S=64), S=[128, 256])``."""
    pieces = [
        "dict(" + ", ".join(f"{k}={short_repr(v, 30)}" for k, v in case.items()) + ")"
        if isinstance(case, Mapping) else short_repr(case, 30)
        for case in cases
    ]
    pieces += [f"{name}={short_repr(value, 30)}" for name, value in axes.items()]
    return f"shape({', '.join(pieces)})"


def _is_iterator(value: Any) -> bool:
    return hasattr(value, "__next__") and hasattr(value, "__iter__")


def _check_name(name: Any, where: str = "shape") -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ShapeSpecError(f"{where}: size names must be Python identifiers (for shape.NAME); got {name!r}")


def _id_piece(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return name if value else f"no{name}"
    if isinstance(value, str):
        return value
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.dtype):
            return str(value).removeprefix("torch.")
        if isinstance(value, torch.device):
            return str(value)
    if isinstance(value, (int, float)) and not name[-1].isdigit():
        return f"{name}{value}"
    return f"{name}={value}"


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def marker_values(
    marker: str, args: Sequence[Any], kwargs: Mapping[str, Any], first: str, keywords: set[str], signature: str
) -> list[Any]:
    """A marker's positional arguments, with ``first`` in front when it was given by keyword; refuses keywords
    other than ``keywords``, quoting the marker's ``signature`` (the memory and intractable markers share this).

    >>> marker_values("memory", (), {"estimate": 64}, "estimate", {"estimate", "device"}, "(estimate, device=None)")
    [64]
    """
    unknown = set(kwargs) - keywords
    if unknown:
        raise TypeError(f"{marker} marker: unknown keyword(s) {sorted(unknown)}; it takes {signature}")
    values = list(args)
    if first in kwargs:
        values.insert(0, kwargs[first])
    return values


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages that quote what a marker was given.

    >>> short_repr(list(range(100)), 20)
    '[0, 1, 2, 3, 4, 5...'
    """
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def missing_device(shape: Mapping[str, Any] | None, cuda: tuple[bool, int] | None = None) -> str | None:
    """Why a case cannot run here, when its ``device`` names a CUDA device this machine lacks; else None.

    ``device=["cpu", "cuda"]`` on a machine without CUDA would otherwise fail inside the test with torch's
    "Torch not compiled with CUDA enabled"; a skip naming the device says what is missing. ``cuda``: (CUDA
    available, device count), read from torch when None (only for a case that names a CUDA device).

    >>> missing_device({"device": "cuda"}, cuda=(False, 0))
    "device 'cuda': CUDA is not available on this machine"
    >>> missing_device({"device": "cuda:2"}, cuda=(True, 2))
    "device 'cuda:2': this machine has 2 CUDA devices (cuda:0 to cuda:1)"
    >>> missing_device({"device": "cpu"}) is None, missing_device({"S": 1}) is None
    (True, True)
    """
    if shape is None or "device" not in shape:
        return None
    text = str(shape["device"])
    kind, _, index_text = text.partition(":")
    if kind != "cuda":
        return None
    if cuda is None:
        try:
            import torch
        except ImportError:
            return f"device {text!r}: torch is not installed"
        available = torch.cuda.is_available()
        cuda = (available, torch.cuda.device_count() if available else 0)
    available, count = cuda
    if not available or count == 0:
        return f"device {text!r}: CUDA is not available on this machine"
    if index_text.isdigit() and int(index_text) >= count:
        plural = "device (cuda:0)" if count == 1 else f"devices (cuda:0 to cuda:{count - 1})"
        return f"device {text!r}: this machine has {count} CUDA {plural}"
    return None
