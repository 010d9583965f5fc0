"""The packed variable-length reference against one dense float64 computation over all tokens with a
block-diagonal mask (written out here, not through the per-sequence reference), and its input checks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pytest_kernelcheck import attention_reference_varlen


def dense_block_diagonal(q, k, v, cu_q, cu_k, *, causal=False, window=None, softcap=None, slopes=None):
    """All tokens at once: [H, total_q, total_k] float64 scores, keys of other sequences masked."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    qq = q.double().transpose(0, 1)
    kk = k.double().repeat_interleave(group, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = qq @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    seq_of_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), torch.diff(torch.tensor(cu_q)))
    seq_of_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), torch.diff(torch.tensor(cu_k)))
    pos_q = torch.arange(q.shape[0]) - torch.tensor(cu_q)[seq_of_q]
    pos_k = torch.arange(k.shape[0]) - torch.tensor(cu_k)[seq_of_k]
    # i' of each query token: its position in its sequence, shifted by that sequence's S_k - S_q for lower-right
    len_q_of_q = torch.diff(torch.tensor(cu_q))[seq_of_q]
    len_k_of_q = torch.diff(torch.tensor(cu_k))[seq_of_q]
    aligned = pos_q + (len_k_of_q - len_q_of_q if causal == "lower_right" else 0)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        per_row = slopes.double()[:, None] if slopes.dim() == 1 else slopes.double()[seq_of_q].T
        scores = scores - per_row[:, :, None] * (aligned[:, None] - pos_k[None, :]).abs()
    seen = seq_of_q[:, None] == seq_of_k[None, :]
    if causal:
        seen &= pos_k[None, :] <= aligned[:, None]
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= pos_k[None, :] >= aligned[:, None] - left
        if right >= 0:
            seen &= pos_k[None, :] <= aligned[:, None] + right
    empty = ~seen.any(-1)
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    out = (weights @ vv).transpose(0, 1)
    out[empty] = 0.0
    return out


def packed(cu_q, cu_k, heads=4, kv_heads=2, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(cu_q[-1], heads, head_dim, generator=gen)
    k, v = (torch.randn(cu_k[-1], kv_heads, head_dim, generator=gen) for _ in range(2))
    return q, k, v


# Odd lengths, a sequence of one token, an empty one (no queries and no keys), and S_q != S_k per sequence.
CU_Q = [0, 5, 6, 6, 19]
CU_K = [0, 7, 8, 8, 19]


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(causal="lower_right"),
                                     dict(causal=True, window=(3, -1)), dict(window=(2, 1), softcap=1.5),
                                     dict(causal="lower_right", slopes="heads"),
                                     dict(causal=True, slopes="batch")])
def test_packed_reference_matches_one_block_diagonal_computation(options):
    q, k, v = packed(CU_Q, CU_K, seed=len(options))
    slopes = options.pop("slopes", None)
    if slopes == "heads":
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    elif slopes == "batch":
        slopes = torch.rand(len(CU_Q) - 1, 4, generator=torch.Generator().manual_seed(3))
    got = attention_reference_varlen(q, k, v, torch.tensor(CU_Q, dtype=torch.int32), CU_K, alibi_slopes=slopes,
                                     **options)
    expected = dense_block_diagonal(q, k, v, CU_Q, CU_K, slopes=slopes, **options)
    assert got.dtype == torch.float64 and got.shape == (q.shape[0], 4, 8)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_rows_of_a_sequence_without_keys_are_zeros():
    q, k, v = packed([0, 3, 7], [0, 0, 5])
    out = attention_reference_varlen(q, k, v, [0, 3, 7], [0, 0, 5])
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert out[3:].abs().sum() > 0


@pytest.mark.parametrize("cu_q, cu_k, error, match", [
    ([0, 5, 4, 19], [0, 7, 8, 19], ValueError, "never decrease"),
    ([1, 5, 19], [0, 7, 19], ValueError, "start at 0"),
    ([0, 5, 18], [0, 7, 19], ValueError, "end at the total"),
    ([0, 5, 19], [0, 19], ValueError, "different sequence counts"),
    (torch.tensor([0.0, 19.0]), [0, 19], TypeError, "int32 or int64"),
])
def test_bad_offsets_are_named(cu_q, cu_k, error, match):
    q, k, v = packed([0, 19], [0, 19])
    with pytest.raises(error, match=match):
        attention_reference_varlen(q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("cu_q, shown", [
    ([0, 5.7, 19], r"cu_seqlens_q\[1\] is 5\.7 \(float\)"),
    (np.array([0.0, 5.0, 19.0]), r"cu_seqlens_q\[0\] is (np\.float64\()?0\.0\)? \(float64\)"),
    ([False, True], r"cu_seqlens_q\[0\] is False \(bool\)"),
], ids=["float", "numpy-float", "bool"])
def test_offsets_that_are_not_integers_are_refused_not_truncated(cu_q, shown):
    # Before: int() truncated them, so [0, 5.7, 19] split the tokens as [0, 5, 19] and nothing said so.
    q, k, v = packed([0, 19], [0, 19])
    accepted = "offsets are integers: ints, numpy integers, or a 1-D int32 or int64 tensor"
    with pytest.raises(TypeError, match=rf"{shown}; {accepted}"):
        attention_reference_varlen(q, k, v, cu_q, [0, 6, 19] if len(cu_q) == 3 else [0, 19])
    # Integers of any of those kinds are read as they are.
    cu_k = [0, 6, 19]
    expected = dense_block_diagonal(q, k, v, [0, 5, 19], cu_k)
    for cu in ([0, 5, 19], np.array([0, 5, 19]), [torch.tensor(0), np.int32(5), 19]):
        torch.testing.assert_close(attention_reference_varlen(q, k, v, cu, cu_k), expected, rtol=1e-12, atol=1e-12)


def test_bad_layouts_and_slopes_are_named():
    q, k, v = packed([0, 19], [0, 19])
    with pytest.raises(TypeError, match="q must be a 3-D floating tensor"):
        attention_reference_varlen(q[None], k, v, [0, 19], [0, 19])
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        attention_reference_varlen(q, k, v, [0, 19], [0, 19], alibi_slopes=torch.rand(2, 4))
