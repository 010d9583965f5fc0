"""Whether the installed Triton is one flashlite is tested with, and a warning, once per process, when it is not.

flashlite's kernels lean on details that change between Triton releases (how the interpreter evaluates constant
expressions, the fields of Gluon's tensor descriptors, which autotuning keys the autotuner accepts), so a Triton
outside the tested range may fail to compile a kernel or, worse, run it differently. The range here is the one
``pyproject.toml`` pins and CI runs: the oldest and the newest release in it.
"""
from __future__ import annotations

import re
import warnings
from typing import Optional

# (major, minor) of the oldest and the newest Triton release flashlite is tested with, both included.
TESTED_TRITON = ((3, 6), (3, 9))


class UntestedTritonWarning(UserWarning):
    """The installed Triton is outside the range flashlite is tested with."""


_warned = False


def release(version: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a Triton version string, None when it does not start with two numbers.

    Example:
        >>> release("3.9.0"), release("3.6.0+git1a2b3c"), release("nightly")
        ((3, 9), (3, 6), None)
    """
    match = re.match(r"(\d+)\.(\d+)", version.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def untested_message(version: str) -> Optional[str]:
    """Why Triton ``version`` is untested, None when it is in the tested range.

    Example:
        >>> untested_message("3.9.1") is None
        True
        >>> print(untested_message("3.10.0"))  # doctest: +ELLIPSIS
        flashlite is tested with Triton 3.6 to 3.9, not 3.10.0: ...
    """
    (low, high), found = TESTED_TRITON, release(version)
    if found is not None and low <= found <= high:
        return None
    return (f"flashlite is tested with Triton {low[0]}.{low[1]} to {high[0]}.{high[1]}, not {version}: its kernels "
            f"may fail to compile or run differently. Install a tested one with "
            f"pip install 'triton>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'.")


def warn_if_untested(version: Optional[str] = None) -> None:
    """Warn (``UntestedTritonWarning``, once per process) when Triton ``version`` (default: the installed one) is
    outside the tested range. Without Triton nothing is said: no kernel runs then.

    Example:
        >>> warn_if_untested("3.6.0")  # tested: silent
    """
    global _warned
    if _warned:
        return
    if version is None:
        try:
            import triton
        except ImportError:
            return
        version = str(getattr(triton, "__version__", "unknown"))
    message = untested_message(version)
    if message is not None:
        _warned = True
        warnings.warn(message, UntestedTritonWarning, stacklevel=2)
