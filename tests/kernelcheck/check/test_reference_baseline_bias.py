"""The check's SDPA baseline computes a bias as a correct implementation does, so it catches one that does not.

A kernel that rounds an ALiBi bias (or a float32 attn_mask) to bfloat16 as it comes is off by many times the
output's own rounding error. The baseline used to round its bias the same way, so its error was as large and the
baseline rule (kernel error <= 2 * baseline error + floor) passed the defect. Here the old computation is the
"kernel": the check must fail it, and pass the exact result rounded to the output dtype.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from pytest_kernelcheck import attention_reference
from pytest_kernelcheck.check.reference import SdpaReference, describe_problem, sdpa_baseline


def rand(*size, seed, dtype=torch.float32):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rounded_as_it_comes(q, k, v, bias):
    """The defect: SDPA with the float32 bias (-inf where hidden) rounded straight to q's dtype."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


def alibi_bias(slopes, seq_q, seq_k, shift=0):
    distance = (torch.arange(seq_q)[:, None] + shift - torch.arange(seq_k)[None, :]).abs().float()
    return -slopes[:, None, None] * distance


def slopes_for(heads, seed):
    return torch.rand(heads, generator=torch.Generator().manual_seed(seed)) + 0.2  # not powers of two


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_fails_a_kernel_that_rounds_the_alibi_bias_as_it_comes(dtype):
    # 64 query rows against 8 keys: distances of 56 and more, where bfloat16's grid is 0.25 wide.
    q = rand(2, 3, 64, 16, seed=1, dtype=dtype)
    k, v = rand(2, 3, 8, 16, seed=2, dtype=dtype), rand(2, 3, 8, 16, seed=3, dtype=dtype)
    slopes = slopes_for(3, seed=4)
    defective = rounded_as_it_comes(q, k, v, alibi_bias(slopes, 64, 8))
    with pytest.raises(AssertionError, match="baseline rule"):
        SdpaReference().check(defective, q, k, v, alibi_slopes=slopes)
    exact = attention_reference(q, k, v, alibi_slopes=slopes).to(dtype)
    assert SdpaReference().check(exact, q, k, v, alibi_slopes=slopes).baseline_used


@pytest.mark.parametrize("causal", [False, True])
def test_the_check_fails_a_kernel_that_rounds_a_float32_mask_as_it_comes(causal):
    # No variant: the plain path of the baseline (and its causal merge) rounded the mask the same way.
    q = rand(1, 2, 37, 16, seed=11, dtype=torch.bfloat16)
    k, v = rand(1, 2, 45, 16, seed=12, dtype=torch.bfloat16), rand(1, 2, 45, 16, seed=13, dtype=torch.bfloat16)
    mask = rand(37, 45, seed=14) * 6 + 20  # large values: on bfloat16's grid of 0.125 there
    bias = mask if not causal else mask.masked_fill(torch.ones(37, 45, dtype=torch.bool).triu(1), -math.inf)
    defective = rounded_as_it_comes(q, k, v, bias)
    with pytest.raises(AssertionError, match="baseline rule"):
        SdpaReference().check(defective, q, k, v, attn_mask=mask, causal=causal)
    exact = attention_reference(q, k, v, attn_mask=mask, causal=causal).to(torch.bfloat16)
    SdpaReference().check(exact, q, k, v, attn_mask=mask, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_baseline_with_alibi_and_a_window_is_about_as_accurate_as_rounding(dtype):
    q = rand(2, 4, 41, 16, seed=21, dtype=dtype)
    k, v = rand(2, 4, 53, 16, seed=22, dtype=dtype), rand(2, 4, 53, 16, seed=23, dtype=dtype)
    slopes = slopes_for(4, seed=24)
    mask = rand(41, 53, seed=25) * 3  # float32, added to ALiBi
    options = dict(causal="lower_right", window=(30, -1), alibi_slopes=slopes, attn_mask=mask)
    problem = describe_problem(q, k, v, **options)
    exact = attention_reference(q, k, v, **options)
    base = sdpa_baseline(q, k, v, problem, mask, alibi_slopes=slopes)
    rounding = (exact.to(dtype).double() - exact).abs().max()
    # Rounded without the row shift this is 4 to 20 times the rounding error; the baseline rule's factor is 2.
    assert (base.double() - exact).abs().max() <= 1.5 * rounding


def test_a_mask_already_in_the_input_dtype_is_passed_unchanged():
    # Shifting a bias the input dtype holds exactly could only round it.
    q, k, v = (rand(1, 2, 9, 16, seed=s, dtype=torch.bfloat16) for s in (31, 32, 33))
    mask = (rand(9, 9, seed=34) * 50).to(torch.bfloat16)
    problem = describe_problem(q, k, v, attn_mask=mask)
    base = sdpa_baseline(q, k, v, problem, mask)
    assert torch.equal(base, F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None]))
