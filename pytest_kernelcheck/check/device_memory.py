"""The device memory cap (``--kernel-device-memory SIZE``): a smaller GPU on a big one.

:func:`parse_size` reads the option's value; :func:`apply_cap` gives every visible CUDA device's caching allocator
the fraction ``cap / total`` (``torch.cuda.set_per_process_memory_fraction``), so a test that allocates past the
cap gets the out-of-memory error it would get on a GPU of that size; :func:`header_line` states it in the run's
header. The ``memory`` marker compares estimates with the cap (:func:`pytest_kernelcheck.check.memory.memory_shortfall`).

Example::

    >>> cap = parse_size("4GiB")
    >>> cap, human_bytes(cap)
    (4294967296, '4 GiB')
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .memory import human_bytes

__all__ = ["ACCEPTED_SIZES", "DeviceFraction", "apply_cap", "header_line", "parse_size"]

OPTION = "--kernel-device-memory"
INI = "kernel_device_memory"
ACCEPTED_SIZES = (
    "plain bytes (4294967296) or a number and a unit: binary KiB, MiB, GiB, TiB (512MiB, 4GiB, 1.5GiB) or decimal "
    "KB, MB, GB, TB (4GB = 4e9 bytes)"
)

_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
# ASCII digits ([0-9], not \d, which also matches "٣"), at most 30 of them: more is no size, and Fraction() of
# thousands of digits fails with an error of its own.
_SIZE = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from a size: plain bytes, or a number with a binary (KiB..TiB) or decimal (KB..TB) unit; the unit's
    case does not matter. Sizes must be a whole number of bytes, at least one: a fraction with a unit is
    accepted when it comes to whole bytes (1.5GiB), not otherwise (1.5, 0.1KiB).

    >>> parse_size("512MiB"), parse_size("4GB"), parse_size("1.5 gib"), parse_size("4096")
    (536870912, 4000000000, 1610612736, 4096)
    >>> parse_size("4 gigs")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: not a size: '4 gigs'; give plain bytes (4294967296) or a number and a unit: binary KiB, ...
    >>> parse_size("1.5")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: not a size in whole bytes: '1.5' does not come to a whole number of bytes; give plain bytes ...
    """
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r}; give {ACCEPTED_SIZES}")
    # Exact arithmetic, not float: 1.001KB is 1001 bytes, where float arithmetic gives 1000.9999999999999.
    exact = Fraction(match.group(1)) * _UNITS[unit]
    if exact.denominator != 1:
        # Truncating would turn "1.5" into a cap of 1 byte without a word; a fraction of a byte is a typo.
        raise ValueError(
            f"not a size in whole bytes: {text!r} does not come to a whole number of bytes; give {ACCEPTED_SIZES}"
        )
    size = int(exact)
    if size < 1:
        raise ValueError(f"not a size of at least one byte: {text!r}; give {ACCEPTED_SIZES}")
    return size


@dataclass(frozen=True)
class DeviceFraction:
    """What the cap set on one CUDA device: its total memory and the fraction of it this process may use."""

    index: int
    total: int
    fraction: float

    def describe(self) -> str:
        """``cuda:0 0.0288 of 139 GiB``

        >>> DeviceFraction(0, 140 * 2**30, 4 / 140).describe()
        'cuda:0 0.0286 of 140 GiB'
        """
        return f"cuda:{self.index} {self.fraction:.3g} of {human_bytes(self.total)}"


def apply_cap(cap: int) -> list[DeviceFraction]:
    """Let this process's CUDA allocator use at most ``cap`` bytes of each visible device: the fraction
    ``cap / total`` (1.0 where the device is smaller than the cap). No CUDA: nothing to set, an empty list.

    The allocator counts what it has reserved, its cache included, and frees its cache before it gives up, so a
    test meets the out-of-memory error at about the cap; memory outside the allocator (the CUDA context, other
    processes) is not counted.

    >>> apply_cap(2**30) if not __import__("torch").cuda.is_available() else []
    []
    """
    import torch

    if not torch.cuda.is_available():
        return []
    applied = []
    for index in range(torch.cuda.device_count()):
        total = int(torch.cuda.get_device_properties(index).total_memory)
        fraction = min(1.0, cap / total)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        applied.append(DeviceFraction(index, total, fraction))
    return applied


def header_line(cap: int, applied: list[DeviceFraction] | None) -> str:
    """The run's header line for the cap; ``applied`` is None where this process did not apply it (an xdist
    controller, which runs no tests), else what :func:`apply_cap` returned.

    >>> header_line(2**32, [DeviceFraction(0, 140 * 2**30, 4 / 140)])
    'kernelcheck: device memory capped at 4 GiB per CUDA device (cuda:0 0.0286 of 140 GiB)'
    >>> header_line(2**32, [])
    'kernelcheck: device memory capped at 4 GiB; no CUDA device here, so memory markers compare host estimates with it'
    """
    text = f"kernelcheck: device memory capped at {human_bytes(cap)}"
    if applied is None:
        return f"{text} per CUDA device (set in each test process)"
    if not applied:
        return f"{text}; no CUDA device here, so memory markers compare host estimates with it"
    return f"{text} per CUDA device ({', '.join(device.describe() for device in applied)})"

