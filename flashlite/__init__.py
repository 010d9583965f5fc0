"""flashlite: a Triton online-softmax attention kernel and a transformer layer built on it.

Example:
    >>> import torch, flashlite
    >>> q = k = v = torch.randn(1, 2, 16, 16)
    >>> flashlite.attention(q, k, v, causal=True, backend="sdpa").shape
    torch.Size([1, 2, 16, 16])
"""
from __future__ import annotations

import importlib
from typing import Any

from flashlite import _runtime  # noqa: F401  (sets TRITON_INTERPRET before any kernel module is imported)

# Public names and the module that defines each; imported on first use so that `import flashlite` stays cheap.
_EXPORTS = {
    "attention": "flashlite.attention",
    "explain_dispatch": "flashlite.attention",
    "layer_norm": "flashlite.norm",
    "TransformerLayer": "flashlite.layer",
    "CASES": "flashlite.cases",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashlite' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
