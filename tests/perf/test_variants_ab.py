"""A/B of the attention variants (key padding, sliding window, softcap, ALiBi) against what a user would otherwise
write (GPU only).

Baselines: SDPA with the equivalent dense mask or bias, built inside the timed call (a user's code builds it per
call, or at least per shape), or, for softcapping, which SDPA cannot take, the same math from explicit scores; and
FlexAttention, compiled, with the equivalent block mask or score function, where it runs. Each test first checks
that both sides agree on fresh inputs. Every shape names its variant (``shape["variant"]``), which
``scripts/make_dispatch_table.py`` keys the dispatch table on. bf16, H=16, causal.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashlite.attention import attention
from flashlite.cases import attention_io_bytes
from pytest_kernelcheck import assert_close

from .conftest import needs_cuda, qkv

pytestmark = needs_cuda

WINDOW = 1024
SOFTCAP = 30.0


def _flex():
    """(FlexAttention compiled, create_block_mask); the test skips where this torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        pytest.skip("this torch has no FlexAttention")
    return torch.compile(flex_attention), create_block_mask


def _window_mask(S: int) -> torch.Tensor:
    """Bool [S, S]: causal, and at most WINDOW keys to the left, as a user builds it for SDPA."""
    rows = torch.arange(S, device="cuda")[:, None]
    cols = torch.arange(S, device="cuda")[None, :]
    return (cols <= rows) & (rows - cols <= WINDOW)


def _slopes(heads: int) -> torch.Tensor:
    # The geometric slopes of the ALiBi paper's recipe for a power-of-two head count: 2^(-8 i / H).
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device="cuda")


def _visible_pairs(S: int, window: int | None) -> int:
    """(query, key) pairs a causal call with a left window computes (all of them when ``window`` is None)."""
    if window is None:
        return S * (S + 1) // 2
    return S * (window + 1) - window * (window + 1) // 2


def _work(shape, *, window=None, passes="forward") -> dict:
    # 4 * D FLOPs per visible (query, key) pair in the forward (QK^T and PV); the backward 2.5x that.
    factor = {"forward": 1.0, "forward+backward": 3.5}[passes]
    flops = 4.0 * shape.B * shape.H * shape.D * _visible_pairs(shape.S, window) * factor
    return {"flops": flops, "bytes": attention_io_bytes(shape.B, shape.H, shape.S, shape.S, shape.D, shape.dtype,
                                                        passes=passes), "dtype": shape.dtype}


def _causal(S: int) -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool, device="cuda").tril()


def _agree(candidate, baseline) -> None:
    out, expected = candidate(), baseline()
    assert_close(out.float(), expected.double(), policy=out.dtype)


def _memory(shape, copies=8, dense="head") -> int:
    """Inputs and outputs (``copies`` of q's size), plus the baseline's dense [S, S] mask, bias or scores, as
    many of them as ``dense`` says: "shared" (one [S, S] mask broadcast over batch and heads), "batch" (one per
    batch entry), "head" (one per batch entry and head: materialized scores), or "none" (FlexAttention's block
    mask, which is tiny). 6 bytes an element: the bool mask and the fp32 bias SDPA turns it into, or fp32 scores
    and a bf16 bias. The 64k window runs skipped on 385 GiB when every mask was counted per head; one shared
    mask there is 24 GiB."""
    per = {"none": 0, "shared": 1, "batch": shape.B, "head": shape.B * shape.H}[dense]
    return int(copies * shape.B * shape.H * shape.S * shape.D * 2 + 6 * per * shape.S * shape.S)


PADDING = [dict(variant="key_padding", B=8, S=2048, H=16, D=D) for D in (64, 128)]


@pytest.mark.shape(*PADDING, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, dense="batch"))
def test_key_padding_auto_vs_sdpa_with_its_mask(shape, kernel_ab):
    # Random lengths in [S/2, S], the padded batch; `auto` must send it to the kernel.
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths = torch.randint(shape.S // 2, shape.S + 1, (shape.B,), device="cuda", generator=gen)

    def baseline():
        keep = torch.arange(shape.S, device="cuda")[None, :] < lengths[:, None]
        mask = _causal(shape.S)[None, None] & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def candidate():
        return attention(q, k, v, causal=True, key_lengths=lengths)

    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name="key padding auto vs sdpa+mask", **_work(shape))


WINDOWED = [dict(variant="window", B=1, S=S, H=16, D=D) for S in (16_384, 65_536) for D in (64, 128)]


@pytest.mark.shape(*WINDOWED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, dense="shared"))
def test_sliding_window_vs_sdpa_with_a_dense_mask(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)

    def baseline():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(shape.S))

    def candidate():
        return attention(q, k, v, causal=True, window=(WINDOW, 0))

    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name=f"window {WINDOW} vs sdpa+mask", **_work(shape, window=WINDOW))


@pytest.mark.shape(*WINDOWED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=10, dense="none"))
def test_sliding_window_vs_flex_attention(shape, kernel_ab):
    flex_attention, create_block_mask = _flex()
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    block_mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= WINDOW), B=None, H=None,
                                   Q_LEN=shape.S, KV_LEN=shape.S, device="cuda")

    def candidate():
        return attention(q, k, v, causal=True, window=(WINDOW, 0))

    baseline = lambda: flex_attention(q, k, v, block_mask=block_mask)  # noqa: E731
    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name=f"window {WINDOW} vs flex", **_work(shape, window=WINDOW))


@pytest.mark.shape(*WINDOWED[:2], dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=16, dense="shared"))
def test_sliding_window_forward_backward_vs_sdpa_with_a_dense_mask(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype, requires_grad=True)
    grad_out = torch.randn_like(q)

    def step(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn().backward(grad_out)
            return q.grad
        return run

    def dense():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(shape.S))

    candidate = step(lambda: attention(q, k, v, causal=True, window=(WINDOW, 0)))
    kernel_ab.compare(candidate, step(dense), name=f"fwd+bwd window {WINDOW} vs sdpa+mask", check_output=False,
                      **_work(shape, window=WINDOW, passes="forward+backward"))


SCORED = [dict(variant=variant, B=1, S=8192, H=16, D=D) for variant in ("softcap", "alibi") for D in (64, 128)]


@pytest.mark.shape(*SCORED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape))
def test_softcap_and_alibi_vs_materialized_scores(shape, kernel_ab):
    # SDPA takes ALiBi as a dense bias; softcapping it cannot take at all, so its baseline is the same math from
    # explicit scores (what a user without a fused kernel writes).
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    slopes = _slopes(shape.H)
    scale = 1 / math.sqrt(shape.D)

    def baseline():
        causal = _causal(shape.S)
        if shape.variant == "alibi":
            rows = torch.arange(shape.S, device="cuda")[:, None]
            distance = (rows - torch.arange(shape.S, device="cuda")[None, :]).abs()
            bias = (-slopes[:, None, None] * distance).masked_fill(~causal, float("-inf")).to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
        scores = (q @ k.transpose(-2, -1)).float() * scale
        scores = (SOFTCAP * torch.tanh(scores / SOFTCAP)).masked_fill(~causal, float("-inf"))
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v

    options = dict(alibi_slopes=slopes) if shape.variant == "alibi" else dict(softcap=SOFTCAP)

    def candidate():
        return attention(q, k, v, causal=True, **options)

    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name=f"{shape.variant} vs materialized", **_work(shape))


@pytest.mark.shape(*SCORED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=10, dense="none"))
def test_softcap_and_alibi_vs_flex_attention(shape, kernel_ab):
    flex_attention, create_block_mask = _flex()
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    slopes = _slopes(shape.H)
    block_mask = create_block_mask(lambda b, h, i, j: j <= i, B=None, H=None, Q_LEN=shape.S, KV_LEN=shape.S,
                                   device="cuda")
    if shape.variant == "alibi":
        def score_mod(score, b, h, i, j):
            return score - slopes[h] * (i - j).abs()
        options = dict(alibi_slopes=slopes)
    else:
        def score_mod(score, b, h, i, j):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
        options = dict(softcap=SOFTCAP)

    def candidate():
        return attention(q, k, v, causal=True, **options)

    baseline = lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name=f"{shape.variant} vs flex", **_work(shape))
