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
# Bound eagerly: the submodule flashlite.attention shares the function's name, and importing the submodule later
# would otherwise leave the package attribute pointing at the module instead of the function.
from flashlite.attention import attention, attention_varlen, attention_with_kvcache, explain_dispatch

# Public names and the module that defines each; imported on first use so that `import flashlite` stays cheap.
_EXPORTS = {
    "layer_norm": "flashlite.norm",
    "TransformerLayer": "flashlite.layer",
    "CASES": "flashlite.cases",
}

__all__ = sorted([*_EXPORTS, "attention", "attention_varlen", "attention_with_kvcache", "explain_dispatch"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashlite' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
