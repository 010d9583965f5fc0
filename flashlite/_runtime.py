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

# Read once: Triton decides between compiling and interpreting when a kernel is defined, at import, so a later
# change of the variable would not change how the kernels run (and launch code asks on every call).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
