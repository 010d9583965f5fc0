"""A bias on the SDPA path (ALiBi, a float attn_mask) costs no accuracy beyond rounding the exact result.

SDPA takes a bias in q's dtype. Rounded to bfloat16 as it comes, ALiBi's -slope * |i' - j| lands on a grid of
0.25 at a distance of 60: the output was off by 20 times its own rounding error. The rule here is the project's
baseline rule with the most demanding baseline there is, the float64 result rounded to the output dtype:
max|out - exact| <= 2 * max|round(exact) - exact| + the dtype's floor. float32 arithmetic cannot meet that for
float32 outputs (the bias itself is a float32 number), so they are held to the plugin's check, whose baseline is
SDPA in float32. Sizes are odd, slopes random (slopes that are powers of two give biases every dtype holds
exactly), inputs fresh for every case.
"""
import math

import pytest
import torch

from flashlite.attention import attention, attention_varlen, attention_with_kvcache
from pytest_kernelcheck import (
    SdpaReference,
    assert_close,
    attention_reference,
    attention_reference_varlen,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rand(*size, seed, dtype=torch.float32):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def slopes_for(heads, seed):
    """Random slopes in [0.2, 1.2): not powers of two, so -slope * distance is not exact in a 16-bit dtype."""
    return torch.rand(heads, generator=torch.Generator().manual_seed(seed)) + 0.2


def assert_rounding_accurate(out, exact):
    """The baseline rule against the exact result rounded to out's dtype."""
    assert_close(out, exact, baseline=exact.to(out.dtype).clone())


def assert_accurate(out, q, k, v, **options):
    """Half precision: as accurate as rounding the exact result; float32: the plugin's check."""
    if out.dtype == torch.float32:
        SdpaReference().check(out, q, k, v, **options)
    else:
        assert_rounding_accurate(out, attention_reference(q, k, v, **options))


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_on_the_sdpa_path_is_as_accurate_as_rounding(dtype):
    # The reported call: 64 query rows against 8 keys, so that rows sit 56 and more positions from their keys.
    q, k, v = rand(2, 3, 64, 16, seed=1, dtype=dtype), rand(2, 3, 8, 16, seed=2, dtype=dtype), \
        rand(2, 3, 8, 16, seed=3, dtype=dtype)
    slopes = slopes_for(3, seed=4)
    out = attention(q, k, v, alibi_slopes=slopes, backend="sdpa")
    assert_accurate(out, q, k, v, alibi_slopes=slopes)


# Every combination the SDPA path builds a bias for: ALiBi with the masks and window, a float attn_mask of another
# dtype than q's, alone and with ALiBi, and with softcap (computed in float32 from explicit scores).
COMBINATIONS = {
    "alibi+causal_lower_right+window": dict(causal="lower_right", window=(19, 3), alibi=True),
    "alibi+bool_mask+key_lengths": dict(mask="bool", key_lengths=True, alibi=True),
    "float32_mask": dict(mask="float"),
    "float32_mask+alibi+causal": dict(mask="float", causal=True, alibi=True),
    "float32_mask+alibi+softcap": dict(mask="float", alibi=True, softcap=7.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("combination", COMBINATIONS)
def test_every_bias_combination_is_as_accurate_as_rounding(dtype, combination):
    options = COMBINATIONS[combination]
    seed = 10 + list(COMBINATIONS).index(combination)
    batch, heads, kv_heads, seq_q, seq_k, dim = 2, 4, 2, 37, 53, 16
    q = rand(batch, heads, seq_q, dim, seed=seed, dtype=dtype)
    k, v = (rand(batch, kv_heads, seq_k, dim, seed=seed + i, dtype=dtype) for i in (1, 2))
    call = dict(causal=options.get("causal", False), window=options.get("window"), softcap=options.get("softcap"))
    reference = dict(call, enable_gqa=True)
    if options.get("alibi"):
        call["alibi_slopes"] = reference["alibi_slopes"] = slopes_for(heads, seed + 3)
    mask = None
    if options.get("mask") == "bool":
        mask = rand(seq_q, seq_k, seed=seed + 4) > -0.7
        mask[:, 0] = True
    elif options.get("mask") == "float":  # float32 values of every size, -inf on some keys
        mask = (rand(batch, 1, seq_q, seq_k, seed=seed + 4) * 6).masked_fill(
            rand(batch, 1, seq_q, seq_k, seed=seed + 5) < -1.2, -math.inf)
        mask[..., 0] = 0.0
    reference_mask = mask
    if options.get("key_lengths"):
        lengths = torch.tensor([seq_k, 29])
        call["key_lengths"] = lengths
        reference_mask = mask & (torch.arange(seq_k)[None, :] < lengths[:, None])[:, None, None, :]
    out = attention(q, k, v, attn_mask=mask, backend="sdpa", **call)
    assert_accurate(out, q, k, v, attn_mask=reference_mask, **reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_gradients_on_the_sdpa_path_are_as_accurate_as_rounding(dtype):
    q, k, v, grad_out = (rand(1, 2, 45, 16, seed=s, dtype=dtype) for s in (21, 22, 23, 24))
    slopes = slopes_for(2, seed=25)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*leaves, alibi_slopes=slopes, causal=True, backend="sdpa").backward(grad_out)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    scores = exact[0] @ exact[1].transpose(-1, -2) / 4.0
    distance = (torch.arange(45)[:, None] - torch.arange(45)[None, :]).abs().double()
    scores = (scores - slopes.double()[:, None, None] * distance).masked_fill(
        torch.ones(45, 45, dtype=torch.bool).triu(1), -math.inf)
    (torch.softmax(scores, dim=-1) @ exact[2]).backward(grad_out.double())
    for leaf, want in zip(leaves, exact):
        assert_rounding_accurate(leaf.grad, want.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_and_kvcache_sdpa_fallbacks_with_alibi_are_as_accurate_as_rounding(dtype):
    # Both build their call on the same SDPA path: varlen pads and masks, the cache passes a float bias.
    heads, dim = 3, 16
    slopes = slopes_for(heads, seed=31)
    cu_q = torch.tensor([0, 41, 48], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 70], dtype=torch.int32)
    q, k, v = rand(48, heads, dim, seed=32, dtype=dtype), rand(70, heads, dim, seed=33, dtype=dtype), \
        rand(70, heads, dim, seed=34, dtype=dtype)
    out = attention_varlen(q, k, v, cu_q, cu_k, 41, 61, alibi_slopes=slopes, backend="sdpa")
    assert_rounding_accurate(out, attention_reference_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes))

    q = rand(2, heads, 3, dim, seed=35, dtype=dtype)
    k_cache, v_cache = (rand(2, heads, 67, dim, seed=s, dtype=dtype) for s in (36, 37))
    lengths = torch.tensor([67, 40], dtype=torch.int32)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, alibi_slopes=slopes, backend="sdpa")
    for b, n in enumerate(lengths.tolist()):
        exact = attention_reference(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                                    causal="lower_right", alibi_slopes=slopes)
        assert_rounding_accurate(out[b:b + 1], exact)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_large_offset_along_a_row_does_not_swallow_the_scores(dtype):
    # float32's grid at 1e9 is 64 wide: -1e9 on every key of a row, added to the scores as given, left a uniform
    # softmax. Softmax cancels an offset equal along a row, and only the differences count.
    q, k, v = (rand(2, 2, 11, 16, seed=s, dtype=dtype) for s in (41, 42, 43))
    mask = rand(2, 1, 11, 11, seed=44)
    mask[:, :, 2] = -1e9
    mask[:, :, 5] -= 3e5
    out = attention(q, k, v, attn_mask=mask, backend="sdpa")
    assert_accurate(out, q, k, v, attn_mask=mask)
