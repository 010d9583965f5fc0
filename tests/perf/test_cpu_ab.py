"""A/B comparisons that run on any machine, timed with the CPU clock (they say nothing about GPU speed).

They show the engine end to end where no GPU exists, and measure what ``flashlite.attention(backend="auto")``
costs over calling SDPA directly on the CPU: about 2 microseconds of Python per call (a plan lookup), which on
these ~1 ms calls comes out as a tie, inconclusive, or now and then a loss of about 1%; the report says which.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashlite.attention import attention

from .conftest import attention_work

CPU_SHAPES = [dict(B=1, S=256, H=8, D=64), dict(B=4, S=128, H=8, D=64)]


def _cpu_qkv(shape):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape.B, shape.H, shape.S, shape.D, generator=gen) for _ in range(3)]


def materialized_attention(q, k, v):
    """Attention that builds the full [B, H, S, S] score matrix: what online softmax avoids."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


@pytest.mark.shape(*CPU_SHAPES)
def test_cpu_sdpa_vs_materialized(shape, kernel_ab):
    q, k, v = _cpu_qkv(shape)
    candidate = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    baseline = lambda: materialized_attention(q, k, v)  # noqa: E731
    torch.testing.assert_close(candidate(), baseline(), rtol=1e-4, atol=1e-5)
    kernel_ab.compare(candidate, baseline, name="cpu: sdpa vs materialized", max_time=1.0,
                      **attention_work(shape, dtype=torch.float32))


@pytest.mark.shape(*CPU_SHAPES)
def test_cpu_auto_dispatch_overhead(shape, kernel_ab):
    q, k, v = _cpu_qkv(shape)
    candidate = lambda: attention(q, k, v, causal=True, backend="auto")  # noqa: E731
    baseline = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    torch.testing.assert_close(candidate(), baseline())
    kernel_ab.compare(candidate, baseline, name="cpu: auto vs sdpa", max_time=1.0,
                      **attention_work(shape, dtype=torch.float32))
