"""Byte estimates, free memory per device, out-of-memory recognition and clean-up.

Device rule for the ``memory`` marker (:func:`resolve_device`): an explicit ``device=`` wins; otherwise a
``device`` entry of the test's shape, then a ``device`` parameter of the test; otherwise CUDA when available, else
the host. Free memory is ``torch.cuda.mem_get_info`` on CUDA devices and ``MemAvailable`` from /proc/meminfo (or
psutil, when installed, on systems without /proc) for the host.

torch is imported lazily: collecting a test suite that never touches these functions does not import it.
"""
from __future__ import annotations

import gc
import math
import numbers
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from .shapes import marker_values, python_scalar, short_repr

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
_ESTIMATES = "give an int or float (numpy numbers and 0-d integer or float torch tensors also work)"


def human_bytes(count: float) -> str:
    """Bytes in binary units (B to YiB) with three significant figures; 1000 to 1023 of a unit as whole numbers,
    and counts past 1023 YiB in powers of ten of bytes.

    Example::

        >>> human_bytes(20.5 * 2**40), human_bytes(512), human_bytes(1023 * 2**30), human_bytes(2**100)
        ('20.5 TiB', '512 B', '1023 GiB', '1.27e+30 B')
    """
    value = float(count)
    for unit in _UNITS:
        # Move up a unit where the number would round to 1024: 1023.7 KiB reads "1 MiB", not "1024 KiB".
        if abs(value) < 1023.5:
            # .3g writes 1000..1023 as "1e+03"/"1.02e+03"; whole numbers read better there (and for bytes).
            return f"{value:.0f} {unit}" if unit == "B" or abs(value) >= 999.5 else f"{value:.3g} {unit}"
        value /= 1024
    # Nobody reads "1.05e+06 YiB" at a glance; a power of ten of bytes gives the magnitude directly.
    return f"{float(count):.3g} B"


def validate_estimate(value: Any, source: str = "memory estimate") -> int:
    """Check that ``value`` is a usable byte count (a finite number >= 0) and return it as an int.

    Python ints and floats, numpy integers and floats (and 0-d arrays of them) and 0-d integer or float torch
    tensors are accepted: an estimate computed with ``np.prod`` or tensor arithmetic is a number of bytes too.

    Example::

        >>> import numpy as np
        >>> validate_estimate(2.5e9), validate_estimate(np.int64(3) * 2**30)
        (2500000000, 3221225472)

    Raises:
        TypeError: not a number (bools, numpy bools and bool tensors are refused too, and so are complex
            numbers and arrays or tensors of more than one element).
        ValueError: negative, NaN or infinite.
    """
    number = python_scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise TypeError(
            f"{source} must be a number of bytes; got {short_repr(value, 60)} ({type(value).__name__}); {_ESTIMATES}"
        )
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{source} must be a finite number of bytes >= 0; got {number!r}")
    return int(number)


def evaluate_estimate(estimate: Any, shape: Any) -> int:
    """The byte count of a ``memory`` marker: a number, or a callable of the shape returning one.

    Example::

        >>> evaluate_estimate(lambda s: s["n"] * 8, {"n": 4})
        32
    """
    if callable(estimate):
        return validate_estimate(estimate(shape), source=f"memory estimate {_name(estimate)}(shape)")
    return validate_estimate(estimate)


def resolve_device(requested: Any = None, shape: Any = None, params: dict[str, Any] | None = None) -> str:
    """The device whose memory a test needs, as text: explicit, else shape's or params' ``device``, else default.

    A device is "cpu", "cuda" or "cuda:N" (N an integer >= 0), as a string or a torch.device, or the CUDA index N
    as an int.

    Example::

        >>> resolve_device("cpu"), resolve_device(None, {"device": "cuda:1"}), resolve_device(2)
        ('cpu', 'cuda:1', 'cuda:2')
    """
    sources = ("device=", "the shape's `device`", "the test's `device` parameter")
    for where, candidate in zip(sources, (requested, _lookup(shape, "device"), (params or {}).get("device"))):
        if candidate is not None:
            return _device_text(where, candidate)
    return "cuda" if _cuda_available() else "cpu"


def _device_text(where: str, device: Any) -> str:
    """``device`` as "cpu", "cuda" or "cuda:N", or the error that names ``where`` it came from."""
    # bool is an int to Python, but device=True is surely a mistake, not CUDA device 1.
    if isinstance(device, numbers.Integral) and not isinstance(device, bool) and device >= 0:
        return f"cuda:{int(device)}"
    torch = sys.modules.get("torch")  # a torch.device exists only once torch is imported
    is_device = torch is not None and isinstance(device, torch.device)
    text = str(device) if isinstance(device, str) or is_device else None
    if text == "cpu" or text == "cuda":
        return text
    # Only ASCII digits: "cuda:-1", "cuda:abc" or "cudafoo" would otherwise reach torch.cuda.mem_get_info.
    if text is not None and text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit():
        return f"cuda:{int(text[5:])}"
    raise ValueError(
        f"memory marker: {where} is {device!r}; memory checks know the devices 'cpu' and 'cuda' or 'cuda:N' with N "
        "an integer >= 0 (as a string or a torch.device), or a CUDA index N as an int"
    )


def free_memory(device: str) -> int | None:
    """Free bytes on ``device`` ("cpu", "cuda", "cuda:N"), or None when it cannot be measured.

    Example::

        >>> free_memory("cpu") > 0
        True
    """
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return _host_available()


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # psutil covers hosts without /proc (macOS, Windows); it is optional
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def memory_shortfall(needed: int, device: str, cap: int | None = None) -> str | None:
    """A skip reason when ``needed`` bytes exceed what ``device`` can give, else None.

    Without ``cap`` that is its free memory. With ``cap`` (bytes, ``--kernel-device-memory``) it is the smaller of
    the cap and the free memory, on a CUDA device, and on the host of a machine without CUDA (where the cap
    stands for the GPU the run pretends to have); host estimates on a machine with CUDA ignore the cap.

    Example::

        >>> memory_shortfall(2**60, "cpu")  # doctest: +ELLIPSIS
        'needs 1 EiB, ... free on cpu'
        >>> memory_shortfall(5 * 2**30, "cuda:0", cap=4 * 2**30)
        'needs 5 GiB, more than the device memory cap of 4 GiB (--kernel-device-memory) on cuda:0'
    """
    free = free_memory(device)
    capped = cap is not None and (device.startswith("cuda") or not _cuda_available())
    if capped and needed > cap and (free is None or cap <= free):
        return f"needs {human_bytes(needed)}, more than the device memory cap of {human_bytes(cap)} " \
               f"(--kernel-device-memory) on {device}"
    if free is None or needed <= free:
        return None
    under_cap = f" (under the device memory cap of {human_bytes(cap)})" if capped else ""
    return f"needs {human_bytes(needed)}, {human_bytes(free)} free on {device}{under_cap}"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` reports memory exhaustion: torch's OutOfMemoryError, MemoryError, or a RuntimeError
    whose message says "out of memory" (older torch builds and some backends raise that) or is the host
    allocator's "can't allocate memory" (torch raises a plain RuntimeError when host memory runs out).

    Example::

        >>> is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
    """
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None:
        oom_types = tuple(
            t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t
        )
        if oom_types and isinstance(exc, oom_types):
            return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return "out of memory" in text or "defaultcpuallocator: can't allocate memory" in text


def oom_skip_reason(exc: BaseException, cap: int | None = None) -> str:
    """The skip reason for an out-of-memory error: its first message line (or its type's name), and the device
    memory cap when the run has one (``--kernel-device-memory``), since the cap, not the GPU, may have run out.

    Example::

        >>> oom_skip_reason(MemoryError("out of memory\\n(allocator details)"))
        'out of memory: out of memory'
        >>> oom_skip_reason(MemoryError(), cap=2**32)
        'out of memory: MemoryError (device memory capped at 4 GiB by --kernel-device-memory)'
    """
    summary = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    capped = f" (device memory capped at {human_bytes(cap)} by --kernel-device-memory)" if cap is not None else ""
    return f"out of memory: {summary}{capped}"


def forget_frames(exc: BaseException) -> None:
    """Drop the local variables held by ``exc``'s traceback (and chained exceptions), so tensors they
    reference can be freed while the exception itself is still reported.

    Safe after the report is built: on Python 3.11 and 3.12 ``frame.clear()`` leaves the ``f_locals`` snapshot
    that pytest takes (it reads ``__tracebackhide__`` from it), so each cleared frame's snapshot is re-synced,
    which drops the cleared names. From 3.13 ``f_locals`` is a live view and the re-read costs nothing.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        if tb is not None:
            traceback.clear_frames(tb)
        while tb is not None:
            tb.tb_frame.f_locals  # noqa: B018 -- re-syncs the snapshot with the cleared frame
            tb = tb.tb_next
        current = current.__cause__ or current.__context__


def release_memory() -> None:
    """Collect garbage and, when CUDA was used in this process, return cached blocks to the driver."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _lookup(shape: Any, name: str) -> Any:
    if shape is None:
        return None
    getter: Callable[[str, Any], Any] | None = getattr(shape, "get", None)
    return getter(name, None) if getter is not None else None


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)


# --------------------------------------------------------------------------------------------------------------
# Marker arguments: ``memory(estimate, device=None)``


class MemoryRequest:
    """The parsed arguments of a ``memory`` marker: a byte count or a callable of the shape, and a device."""

    __slots__ = ("estimate", "device")

    def __init__(self, estimate: Any, device: Any) -> None:
        self.estimate = estimate
        self.device = device


def parse_memory_marker(args: tuple[Any, ...], kwargs: dict[str, Any], has_shape: bool) -> MemoryRequest:
    """Check the arguments of ``@pytest.mark.memory(estimate, device=None)`` at collection time.

    Example::

        >>> parse_memory_marker((2**30,), {"device": "cpu"}, has_shape=False).device
        'cpu'

    Raises:
        TypeError / ValueError: a missing, negative or non-numeric estimate, a callable estimate on a test
            without a shape marker, an unknown keyword or device.
    """
    values = marker_values("memory", args, kwargs, "estimate", {"estimate", "device"}, "(estimate, device=None)")
    if len(values) != 1:
        raise TypeError(f"memory marker takes one estimate (bytes, or a callable of the shape); got {len(values)}")
    estimate = values[0]
    if callable(estimate):
        if not has_shape:
            raise TypeError(
                "memory marker: a callable estimate receives the shape, but the test has no @pytest.mark.shape"
            )
    else:
        validate_estimate(estimate)
    device = kwargs.get("device")
    if device is not None:
        resolve_device(device)
    return MemoryRequest(estimate, device)


def required_memory(
    args: tuple[Any, ...], kwargs: dict[str, Any], shape: Any, params: dict[str, Any]
) -> tuple[int, str]:
    """Bytes a test needs, and the device it needs them on, from its ``memory`` marker's arguments, its case
    (``shape``, None without a shape marker) and its parameters.

    Example::

        >>> required_memory((lambda s: s["n"] * 8,), {"device": "cpu"}, {"n": 4}, {})
        (32, 'cpu')

    Raises:
        TypeError / ValueError: bad marker arguments, or an estimate that is not a byte count.
    """
    request = parse_memory_marker(args, kwargs, shape is not None)
    return evaluate_estimate(request.estimate, shape), resolve_device(request.device, shape, params)


def memory_skip_reason(
    markers: Iterable[tuple[tuple[Any, ...], dict[str, Any]]], shape: Any, params: dict[str, Any],
    cap: int | None = None,
) -> str | None:
    """Why a test does not fit, under its ``memory`` markers given as ``(args, kwargs)`` pairs closest to the test
    first (on the test, its class, its module), or None when every estimate fits on its device.

    Every marker counts, as every stacked ``skipif`` does: reading the closest one only dropped a module's or
    class's estimate under a test's own smaller one, and ran the test anyway. Each estimate is the test's whole
    need on its device, so estimates are not added up; the first marker that does not fit names the reason.
    Every marker's estimate is computed first, so a bad one is an error whether or not another one skips.

    Example::

        >>> memory_skip_reason([((16,), {"device": "cpu"}), ((2**70,), {"device": "cpu"})], None, {})
        'needs 1 ZiB, ... free on cpu'

    Raises:
        TypeError / ValueError: bad arguments of any marker, or an estimate that is not a byte count.
    """
    needs = [required_memory(args, kwargs, shape, params) for args, kwargs in markers]
    for needed, device in needs:
        reason = memory_shortfall(needed, device, cap)
        if reason is not None:
            return reason
    return None
