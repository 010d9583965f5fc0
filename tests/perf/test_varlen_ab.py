"""A/B of packed variable-length attention against what a user would otherwise write (GPU only).

16 causal sequences of mixed lengths (64 to 8,192, odd ones among them) totalling 32,768 tokens, H=16, bf16:
``flashlite.attention_varlen`` on the packed tensors against SDPA on the same batch padded to its longest sequence
(the padded copy and its key-padding mask made once, outside the timed call, as a user would) and against
FlexAttention with a document mask (its block mask made once too). Forward, and forward with backward. Only the
candidate's useful work is counted for throughput: 4 * D FLOPs per visible (query, key) pair of each sequence.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashlite.attention import attention_varlen
from flashlite.cases import attention_flops, attention_io_bytes
from pytest_kernelcheck import assert_close

from .conftest import forward_backward, needs_cuda

pytestmark = needs_cuda

LENGTHS = [8192, 5631, 4001, 3000, 2500, 2047, 1800, 1500, 1200, 1000, 700, 500, 333, 200, 100, 64]
assert sum(LENGTHS) == 32768
SHAPES = [dict(variant="varlen", B=len(LENGTHS), S=max(LENGTHS), H=16, D=D) for D in (64, 128)]


def _work(shape, passes="forward") -> dict:
    return {"flops": sum(attention_flops(1, shape.H, n, n, shape.D, causal=True, passes=passes) for n in LENGTHS),
            "bytes": attention_io_bytes(1, shape.H, sum(LENGTHS), sum(LENGTHS), shape.D, shape.dtype,
                                        passes=passes),
            "dtype": shape.dtype}


def _memory(shape, copies=12) -> int:
    # The packed tensors, the padded copies (B x max S, four times the packed size here) and SDPA's bool mask.
    padded = shape.B * shape.H * shape.S * shape.D * 2
    return int(copies * padded + shape.B * shape.S * shape.S * 5)


def _inputs(shape, requires_grad=False):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, shape.H, shape.D, device="cuda", dtype=shape.dtype, generator=gen)
               .requires_grad_(requires_grad) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _padded(t: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, H, max S, D] copy of packed [total, H, D], zeros past each sequence's end."""
    out = t.new_zeros(len(LENGTHS), max_len, *t.shape[1:])
    for b, (start, n) in enumerate(zip(cu.tolist(), LENGTHS)):
        out[b, :n] = t[start:start + n]
    return out.transpose(1, 2)


def _unpadded(out: torch.Tensor) -> torch.Tensor:
    return torch.cat([out[b, :, :n].transpose(0, 1) for b, n in enumerate(LENGTHS)])


def _sdpa_padded(shape, q, k, v, cu):
    """SDPA on the padded batch, causal within each sequence and the padding keys masked."""
    qp, kp, vp = (_padded(t.detach(), cu, shape.S).requires_grad_(q.requires_grad) for t in (q, k, v))
    lengths = torch.tensor(LENGTHS, device="cuda")
    keep = torch.arange(shape.S, device="cuda")[None, :] < lengths[:, None]
    mask = torch.ones(shape.S, shape.S, dtype=torch.bool, device="cuda").tril()[None, None] & keep[:, None, None, :]
    return (qp, kp, vp), lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)


def _flex_document(shape, q, k, v, cu):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        pytest.skip("this torch has no FlexAttention")
    total = sum(LENGTHS)
    document = torch.repeat_interleave(torch.arange(len(LENGTHS), device="cuda"),
                                       torch.tensor(LENGTHS, device="cuda"))
    block_mask = create_block_mask(lambda b, h, i, j: (document[i] == document[j]) & (j <= i), B=None, H=None,
                                   Q_LEN=total, KV_LEN=total, device="cuda")
    flex = torch.compile(flex_attention)
    # FlexAttention takes [B, H, S, D]: the packed tokens as one sequence.
    qf, kf, vf = (t.transpose(0, 1)[None] for t in (q, k, v))
    return lambda: flex(qf, kf, vf, block_mask=block_mask)[0].transpose(0, 1)


def _candidate(shape, q, k, v, cu):
    return lambda: attention_varlen(q, k, v, cu, cu, shape.S, shape.S, causal=True)


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape))
def test_varlen_vs_sdpa_on_the_padded_batch(shape, kernel_ab):
    q, k, v, cu = _inputs(shape)
    candidate = _candidate(shape, q, k, v, cu)
    _, padded = _sdpa_padded(shape, q, k, v, cu)
    out = candidate()
    assert_close(out.float(), _unpadded(padded()).double(), policy=out.dtype)
    kernel_ab.compare(candidate, padded, name="varlen vs sdpa padded", **_work(shape))


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=4))
def test_varlen_vs_flex_attention_with_a_document_mask(shape, kernel_ab):
    q, k, v, cu = _inputs(shape)
    candidate, baseline = _candidate(shape, q, k, v, cu), _flex_document(shape, q, k, v, cu)
    out = candidate()
    assert_close(out.float(), baseline().double(), policy=out.dtype)
    kernel_ab.compare(candidate, baseline, name="varlen vs flex", **_work(shape))


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=24))
def test_varlen_forward_backward_vs_sdpa_on_the_padded_batch(shape, kernel_ab):
    q, k, v, cu = _inputs(shape, requires_grad=True)
    padded_inputs, padded = _sdpa_padded(shape, q, k, v, cu)
    kernel_ab.compare(forward_backward((q, k, v), _candidate(shape, q, k, v, cu)),
                      forward_backward(padded_inputs, padded), name="fwd+bwd varlen vs sdpa padded",
                      check_output=False, **_work(shape, passes="forward+backward"))


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=8))
def test_varlen_forward_backward_vs_flex_attention(shape, kernel_ab):
    q, k, v, cu = _inputs(shape, requires_grad=True)
    kernel_ab.compare(forward_backward((q, k, v), _candidate(shape, q, k, v, cu)),
                      forward_backward((q, k, v), _flex_document(shape, q, k, v, cu)),
                      name="fwd+bwd varlen vs flex", check_output=False, **_work(shape, passes="forward+backward"))


@pytest.mark.shape(SHAPES[0], dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: _memory(shape, copies=4))
def test_varlen_cost_of_value_checks(shape, kernel_ab):
    # check_values=True reads cu_seqlens back to the host (a device synchronisation per call): its cost, as the
    # speedup of the default unchecked call over the checked one. Both compute the same output.
    q, k, v, cu = _inputs(shape)

    def call(check_values):
        return lambda: attention_varlen(q, k, v, cu, cu, shape.S, shape.S, causal=True, check_values=check_values)
    unchecked, checked = call(False), call(True)
    assert torch.equal(unchecked(), checked())
    kernel_ab.compare(unchecked, checked, name="varlen unchecked vs check_values=True", **_work(shape))
