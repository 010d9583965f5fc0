"""pytest-kernelcheck: correctness and speed assertions for GPU kernels.

Public names are loaded on first use, so that loading the pytest plugin does not import torch::

    from pytest_kernelcheck import assert_close, policy_for
    assert_close(out, reference_float64)                 # per-dtype policy, or the test's tolerance marker
    assert_close(out, reference_float64, baseline=out_in_input_precision_by_pytorch)
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "assert_close": "tolerance",
    "CloseReport": "tolerance",
    "TolerancePolicy": "tolerance",
    "policy_for": "tolerance",
    "Shape": "shapes",
    "format_id": "shapes",
    "attention_reference": "reference",
    "attention_reference_varlen": "reference_varlen",
    "sample_query_rows": "reference",
    "SdpaReference": "reference",
    "ReferenceCheck": "reference",
    "human_bytes": "memory",
    "KernelAB": "ab",
    "Budget": "ab",
    "ComparisonResult": "ab",
    "TournamentResult": "ab",
    "run_comparison": "ab",
    "run_tournament": "ab",
    "MeasureResult": "ab",
    "run_measurement": "ab",
    "CeilingMeter": "throughput",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_kernelcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
