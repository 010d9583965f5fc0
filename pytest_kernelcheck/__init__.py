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
    "assert_close": "check.tolerance",
    "CloseReport": "check.tolerance",
    "TolerancePolicy": "check.tolerance",
    "policy_for": "check.tolerance",
    "Shape": "check.shapes",
    "format_id": "check.shapes",
    "attention_reference": "check.reference",
    "attention_reference_varlen": "check.reference_varlen",
    "sample_query_rows": "check.reference_plan",
    "SdpaReference": "check.reference",
    "ReferenceCheck": "check.reference",
    "human_bytes": "check.memory",
    "KernelAB": "speed.ab",
    "Budget": "speed.budget",
    "ComparisonResult": "speed.ab_results",
    "TournamentResult": "speed.ab_results",
    "run_comparison": "speed.runs",
    "run_tournament": "speed.runs",
    "MeasureResult": "speed.ab_results",
    "run_measurement": "speed.runs",
    "CeilingMeter": "speed.throughput",
    "ABSpec": "speed.spec",
    "ModeRecord": "results.records",
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
