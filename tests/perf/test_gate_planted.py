"""A regression planted on purpose, to show that the A/B gate fails a session on it (GPU only).

One comparison that flashlite wins clearly (case 11: B=256, S=64, the kernel against SDPA). With
``KERNELCHECK_PLANTED_REGRESSION=1`` the candidate also runs the baseline twice per call, so the same comparison
becomes a loss. Save a run without it, then run with it against the saved run:

    pytest tests/perf/test_gate_planted.py --kernel-ab --kernel-ab-save clean
    KERNELCHECK_PLANTED_REGRESSION=1 pytest tests/perf/test_gate_planted.py --kernel-ab \\
        --kernel-ab-compare clean --kernel-ab-compare-fail verdict

The second session must exit non-zero, naming the comparison whose verdict went from win to loss.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from flashlite.attention import attention
from flashlite.cases import CASES

from .conftest import attention_work, needs_cuda, qkv

pytestmark = needs_cuda

PLANTED = os.environ.get("KERNELCHECK_PLANTED_REGRESSION", "0") not in ("", "0")
CASE_11 = next(c for c in CASES if c.number == 11)


@pytest.mark.shape(dict(case=11, B=CASE_11.B, S=CASE_11.S, H=CASE_11.H, D=CASE_11.D), dtype=[torch.bfloat16])
def test_gate_catches_a_planted_regression(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)

    def baseline():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def candidate():
        out = attention(q, k, v, causal=True, backend="triton")
        if PLANTED:
            baseline()
            baseline()
        return out

    torch.testing.assert_close(candidate(), baseline(), atol=2e-2, rtol=2e-2)
    kernel_ab.compare(candidate, baseline, name="planted-regression probe", **attention_work(shape))
