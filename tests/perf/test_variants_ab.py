"""A/B of the attention variants (key padding, sliding window, softcap, ALiBi) against what a user would otherwise
write (GPU only).

Baselines: SDPA with the equivalent dense mask or bias, built inside the timed call (a user's code builds it per
call, or at least per shape), or, for softcapping, which SDPA cannot take, the same math from explicit scores; and
FlexAttention, compiled, with the equivalent block mask or score function, where it runs. Each forward test first
checks that both sides agree on fresh inputs; the forward+backward ones ("fwd+bwd ..." comparisons) time a forward
and a backward with one random incoming gradient and leave the gradients to tests/flashlite (SDPA's backward
accumulates with atomics, so its own repeats differ by rounding). Every shape names its variant
(``shape["variant"]``), which ``tools/make_dispatch_table.py`` keys the dispatch table on. bf16, H=16, causal.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashlite.attention import attention
from flashlite.cases import attention_io_bytes
from pytest_kernelcheck import assert_close

from .conftest import forward_backward, needs_cuda, qkv

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


def _memory(shape, copies=8, dense="head", dense_bytes=6) -> int:
    """Inputs and outputs (``copies`` of q's size), plus the baseline's dense [S, S] mask, bias or scores, as
    many of them as ``dense`` says: "shared" (one [S, S] mask broadcast over batch and heads), "batch" (one per
    batch entry), "head" (one per batch entry and head: materialized scores), or "none" (FlexAttention's block mask,
    which is tiny). ``dense_bytes`` an element, 6 by default: the bool mask and the fp32 bias SDPA turns it into, or
    fp32 scores and a bf16 bias; a backward through materialized scores keeps several of them. Counted per head, the 64k
    window runs would ask 385 GiB; their one shared mask is 24 GiB."""
    per = {"none": 0, "shared": 1, "batch": shape.B, "head": shape.B * shape.H}[dense]
    return int(copies * shape.B * shape.H * shape.S * shape.D * 2 + dense_bytes * per * shape.S * shape.S)


PADDING = [dict(variant="key_padding", B=8, S=2048, H=16, D=D) for D in (64, 128)]


def _padded_pair(shape, q, k, v):
    """(auto with key lengths, SDPA with the padding and causal mask built in the call): random lengths in
    [S/2, S], the issue's padded batch; `auto` must send it to the kernel."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths = torch.randint(shape.S // 2, shape.S + 1, (shape.B,), device="cuda", generator=gen)

    def baseline():
        keep = torch.arange(shape.S, device="cuda")[None, :] < lengths[:, None]
        mask = _causal(shape.S)[None, None] & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return (lambda: attention(q, k, v, causal=True, key_lengths=lengths)), baseline


@pytest.mark.shape(*PADDING, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, dense="batch"))
def test_key_padding_auto_vs_sdpa_with_its_mask(shape, kernel_ab):
    candidate, baseline = _padded_pair(shape, *qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype))
    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name="key padding auto vs sdpa+mask", **_work(shape))


@pytest.mark.shape(*PADDING, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=16, dense="batch"))
def test_key_padding_forward_backward_auto_vs_sdpa_with_its_mask(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype, requires_grad=True)
    candidate, baseline = _padded_pair(shape, q, k, v)
    kernel_ab.compare(forward_backward((q, k, v), candidate), forward_backward((q, k, v), baseline),
                      name="fwd+bwd key padding auto vs sdpa+mask", check_output=False,
                      **_work(shape, passes="forward+backward"))


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

    def dense():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(shape.S))

    candidate = forward_backward((q, k, v), lambda: attention(q, k, v, causal=True, window=(WINDOW, 0)))
    kernel_ab.compare(candidate, forward_backward((q, k, v), dense), name=f"fwd+bwd window {WINDOW} vs sdpa+mask",
                      check_output=False, **_work(shape, window=WINDOW, passes="forward+backward"))


@pytest.mark.shape(*WINDOWED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=16, dense="none"))
def test_sliding_window_forward_backward_vs_flex_attention(shape, kernel_ab):
    flex_attention, create_block_mask = _flex()
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype, requires_grad=True)
    block_mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= WINDOW), B=None, H=None,
                                   Q_LEN=shape.S, KV_LEN=shape.S, device="cuda")
    candidate = forward_backward((q, k, v), lambda: attention(q, k, v, causal=True, window=(WINDOW, 0)))
    baseline = forward_backward((q, k, v), lambda: flex_attention(q, k, v, block_mask=block_mask))
    kernel_ab.compare(candidate, baseline, name=f"fwd+bwd window {WINDOW} vs flex", check_output=False,
                      **_work(shape, window=WINDOW, passes="forward+backward"))


SCORED = [dict(variant=variant, B=1, S=8192, H=16, D=D) for variant in ("softcap", "alibi") for D in (64, 128)]


def _scored_candidate(shape, q, k, v):
    options = dict(alibi_slopes=_slopes(shape.H)) if shape.variant == "alibi" else dict(softcap=SOFTCAP)
    return lambda: attention(q, k, v, causal=True, **options)


def _materialized(shape, q, k, v):
    """SDPA takes ALiBi as a dense bias; softcapping it cannot take at all, so that baseline is the same math from
    explicit scores (what a user without a fused kernel writes). Masks and biases are built inside the call."""
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
    return baseline


@pytest.mark.shape(*SCORED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape))
def test_softcap_and_alibi_vs_materialized_scores(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    candidate, baseline = _scored_candidate(shape, q, k, v), _materialized(shape, q, k, v)
    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name=f"{shape.variant} vs materialized", **_work(shape))


@pytest.mark.shape(*SCORED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=16, dense_bytes=24))
def test_softcap_and_alibi_forward_backward_vs_materialized_scores(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype, requires_grad=True)
    kernel_ab.compare(forward_backward((q, k, v), _scored_candidate(shape, q, k, v)),
                      forward_backward((q, k, v), _materialized(shape, q, k, v)),
                      name=f"fwd+bwd {shape.variant} vs materialized", check_output=False,
                      **_work(shape, passes="forward+backward"))


def _flex_scored(shape, q, k, v):
    """FlexAttention compiled with the causal block mask and the variant as its score_mod."""
    flex_attention, create_block_mask = _flex()
    slopes = _slopes(shape.H)
    block_mask = create_block_mask(lambda b, h, i, j: j <= i, B=None, H=None, Q_LEN=shape.S, KV_LEN=shape.S,
                                   device="cuda")
    if shape.variant == "alibi":
        def score_mod(score, b, h, i, j):
            return score - slopes[h] * (i - j).abs()
    else:
        def score_mod(score, b, h, i, j):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
    return lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


@pytest.mark.shape(*SCORED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=10, dense="none"))
def test_softcap_and_alibi_vs_flex_attention(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    candidate, baseline = _scored_candidate(shape, q, k, v), _flex_scored(shape, q, k, v)
    _agree(candidate, baseline)
    kernel_ab.compare(candidate, baseline, name=f"{shape.variant} vs flex", **_work(shape))


@pytest.mark.shape(*SCORED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=16, dense="none"))
def test_softcap_and_alibi_forward_backward_vs_flex_attention(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype, requires_grad=True)
    kernel_ab.compare(forward_backward((q, k, v), _scored_candidate(shape, q, k, v)),
                      forward_backward((q, k, v), _flex_scored(shape, q, k, v)),
                      name=f"fwd+bwd {shape.variant} vs flex", check_output=False,
                      **_work(shape, passes="forward+backward"))
