"""Where flashlite's Triton kernels run: compiled on a CUDA GPU, interpreted on the CPU otherwise.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so this module must be imported before any module
under ``flashlite.kernels``; ``flashlite/__init__.py`` imports it first.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the only way to execute a Triton kernel is its interpreter; a user who set the variable
    # explicitly (to 0 or 1) keeps their choice.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# CUDA caps grid axis 1 (and 2) at 65,535 blocks; the attention launchers put batch * heads there and switch to a
# flattened 1-D grid past it.
GRID_AXIS1_LIMIT = 65535


def _triton_interprets() -> bool:
    """Whether Triton runs kernels through its interpreter, as Triton itself reads TRITON_INTERPRET: its knobs where
    it has them (Triton 3.4 and later: "1", "true", "yes", "on" or "y", any case), else the older rule, "1" only.
    flashlite must agree with Triton here: it sends CPU tensors to the kernels only when they are interpreted, so
    a value such as "false", read as "on" by a test for "not 0", would hand CPU tensors to compiled kernels."""
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4, or no Triton at all (then no kernel runs either way)
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)


# Read once: Triton decides between compiling and interpreting when a kernel is defined, at import, so a later
# change of the variable would not change how the kernels run (and launch code asks on every call).
_INTERPRETING = _triton_interprets()


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1`` when flashlite was imported).

    Example:
        >>> isinstance(interpreting(), bool)
        True
    """
    return _INTERPRETING


def kernel_device_ok(t: torch.Tensor) -> bool:
    """Whether a tensor lives where the kernels can run: a CUDA device, or the CPU when interpreting.

    Example:
        >>> kernel_device_ok(torch.zeros(1)) == interpreting()
        True
    """
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreting()
