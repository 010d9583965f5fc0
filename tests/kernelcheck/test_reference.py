"""The float64 attention reference against an independent computation and torch SDPA; chunked and sampled
paths; the check with its baseline rule; the plan for B=32, S=100,000, H=16, D=64."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from pytest_kernelcheck.reference import (
    AttentionProblem,
    SdpaReference,
    attention_reference,
    describe_problem,
    plan_reference,
    sample_query_rows,
)


def naive_attention(q, k, v, *, allowed=None, bias=None, scale=None):
    """softmax(q k^T * scale + bias) v in float64, one (batch, head, row) at a time; rows with no key are 0."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, q_len, _ = q.shape
    group = heads // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros(batch, heads, q_len, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                scores = (k[b, h // group] @ q[b, h, i]) * scale
                if bias is not None:
                    scores = scores + bias.expand(batch, heads, q_len, -1)[b, h, i].double()
                keep = torch.ones_like(scores, dtype=torch.bool)
                if allowed is not None:
                    keep = allowed.expand(batch, heads, q_len, -1)[b, h, i]
                if keep.any():
                    weights = torch.exp(scores[keep] - scores[keep].max())
                    out[b, h, i] = (weights / weights.sum()) @ v[b, h // group][keep]
    return out


def causal_allowed(q_len, k_len, lower_right=False):
    offset = k_len - q_len if lower_right else 0
    return torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + offset


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.parametrize("q_len, k_len", [(7, 7), (5, 11), (11, 5)])
def test_plain_and_top_left_causal_match_naive_and_sdpa(q_len, k_len):
    q, k, v = randn(2, 3, q_len, 8), randn(2, 3, k_len, 8), randn(2, 3, k_len, 6)
    plain = attention_reference(q, k, v)
    torch.testing.assert_close(plain, naive_attention(q, k, v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plain, F.scaled_dot_product_attention(q, k, v), rtol=1e-12, atol=1e-12)
    causal = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(causal, naive_attention(q, k, v, allowed=causal_allowed(q_len, k_len)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q_len, k_len", [(5, 11), (7, 7)])
def test_lower_right_causal_matches_sdpa_bias(q_len, k_len):
    q, k, v = randn(1, 2, q_len, 8), randn(1, 2, k_len, 8), randn(1, 2, k_len, 8)
    ours = attention_reference(q, k, v, causal="lower_right")
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, k_len))
    torch.testing.assert_close(ours, sdpa, rtol=1e-12, atol=1e-12)
    expected = naive_attention(q, k, v, allowed=causal_allowed(q_len, k_len, lower_right=True))
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_lower_right_with_more_queries_than_keys_gives_zero_rows():
    q, k, v = randn(1, 2, 9, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 8)
    ours = attention_reference(q, k, v, causal="lower_right")
    assert torch.count_nonzero(ours[:, :, :5]) == 0  # rows 0..4 see no key
    expected = naive_attention(q, k, v, allowed=causal_allowed(9, 4, lower_right=True))
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    with pytest.warns(UserWarning, match="NaN"):
        bias = causal_lower_right(9, 4)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    # Older torch builds give NaN in those rows, recent ones zeros; the reference always gives zeros.
    assert bool((torch.isnan(sdpa[:, :, :5]) | (sdpa[:, :, :5] == 0)).all())
    torch.testing.assert_close(ours[:, :, 5:], sdpa[:, :, 5:], rtol=1e-12, atol=1e-12)


def test_grouped_query_attention():
    q, k, v = randn(2, 6, 5, 8), randn(2, 2, 7, 8), randn(2, 2, 7, 8)
    ours = attention_reference(q, k, v, enable_gqa=True, causal=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, sdpa, rtol=1e-12, atol=1e-12)
    expected = naive_attention(q, k, v, allowed=causal_allowed(5, 7))
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="q has 6 heads but k and v have 2; pass enable_gqa=True"):
        attention_reference(q, k, v)
    with pytest.raises(ValueError, match=r"q heads \(6\) divisible by kv heads \(4\)"):
        attention_reference(q, randn(2, 4, 7, 8), randn(2, 4, 7, 8), enable_gqa=True)


def test_bool_and_float_masks_and_a_fully_masked_row():
    q, k, v = randn(2, 3, 6, 8), randn(2, 3, 9, 8), randn(2, 3, 9, 8)
    allowed = torch.rand(2, 1, 6, 9) > 0.4
    allowed[1, 0, 2] = False  # this row sees nothing in every head of batch entry 1
    ours = attention_reference(q, k, v, attn_mask=allowed, scale=0.3)
    torch.testing.assert_close(ours, naive_attention(q, k, v, allowed=allowed, scale=0.3), rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(ours[1, :, 2]) == 0
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3)
    has_keys = allowed.any(-1, keepdim=True).expand_as(sdpa)
    torch.testing.assert_close(ours[has_keys], sdpa[has_keys], rtol=1e-12, atol=1e-12)

    bias = randn(6, 9)
    ours = attention_reference(q, k, v, attn_mask=bias)
    torch.testing.assert_close(ours, naive_attention(q, k, v, bias=bias), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=bias), rtol=1e-12, atol=1e-12)


def test_causal_combined_with_a_mask():
    q, k, v = randn(1, 2, 6, 8), randn(1, 2, 6, 8), randn(1, 2, 6, 8)
    allowed = torch.rand(6, 6) > 0.3
    ours = attention_reference(q, k, v, causal=True, attn_mask=allowed)
    expected = naive_attention(q, k, v, allowed=allowed & causal_allowed(6, 6))
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_chunked_path_equals_the_full_result():
    q, k, v = randn(2, 4, 33, 8, dtype=torch.float16), randn(2, 4, 40, 8, dtype=torch.float16), randn(2, 4, 40, 8, dtype=torch.float16)
    mask = torch.rand(2, 4, 33, 40) > 0.2
    full = attention_reference(q, k, v, causal="lower_right", attn_mask=mask)
    problem = describe_problem(q, k, v, causal="lower_right", attn_mask=mask)
    budget = 40_000  # room for a few rows of one head at a time
    plan = plan_reference(problem, memory_budget=budget, flop_budget=math.inf)
    assert plan.mode == "chunked" and plan.heads_per_block < 4 and plan.rows_per_block < 33
    assert plan.block_bytes <= budget
    chunked = attention_reference(q, k, v, causal="lower_right", attn_mask=mask, memory_budget=budget)
    torch.testing.assert_close(chunked, full, rtol=1e-13, atol=1e-13)
    assert plan_reference(problem, memory_budget=10**9, flop_budget=math.inf).mode == "full"


def test_rows_argument_and_sampling():
    q, k, v = randn(1, 2, 50, 8), randn(1, 2, 50, 8), randn(1, 2, 50, 8)
    rows = sample_query_rows(50, 7, seed=3)
    assert rows.numel() == 7 and rows[0] == 0 and rows[-1] == 49 and torch.all(rows[1:] > rows[:-1])
    assert torch.equal(rows, sample_query_rows(50, 7, seed=3))
    assert not torch.equal(rows, sample_query_rows(50, 7, seed=4))
    full = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(attention_reference(q, k, v, causal=True, rows=rows), full[:, :, rows], rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 50\)"):
        attention_reference(q, k, v, rows=[0, 50])


def flash_style(q, k, v, *, causal=False):
    """Attention as a fused kernel computes it, in q's dtype: fp32 scores, probabilities rounded before P @ V."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~causal_allowed(q.shape[2], k.shape[2]), -math.inf)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    return ((weights.to(q.dtype).float() @ v.float()) / weights.sum(-1, keepdim=True)).to(q.dtype)


def test_check_passes_a_correct_kernel_with_the_baseline_and_fails_a_wrong_one():
    q, k, v = (randn(2, 2, 40, 16, dtype=torch.float16) for _ in range(3))
    reference = SdpaReference()
    out = flash_style(q, k, v, causal=True)
    result = reference.check(out, q, k, v, causal=True)
    assert result.passed and result.mode == "full" and result.baseline_used
    assert result.rows_checked == result.rows_total == 40
    assert reference.last_check is result and result.close.baseline_ratio < 2

    wrong = out.clone()
    wrong[1, 0, 17, 3] += 0.05
    with pytest.raises(AssertionError, match=r"(?s)baseline rule.*at index \(1, 0, 17, 3\).*error ratio"):
        reference.check(wrong, q, k, v, causal=True)
    assert not reference.last_check.passed

    shifted = flash_style(q, k, v, causal=False)  # a kernel that ignores the causal flag
    with pytest.raises(AssertionError, match="mismatched elements"):
        reference.check(shifted, q, k, v, causal=True)


def test_check_on_sampled_rows_says_how_many_it_checked():
    q, k, v = (randn(1, 2, 300, 16, dtype=torch.float16) for _ in range(3))
    out = flash_style(q, k, v, causal=True)
    reference = SdpaReference(flop_budget=2 * 2 * 300 * 32 * 20)  # about 20 rows per (batch, head)
    result = reference.check(out, q, k, v, causal=True)
    assert result.mode == "sampled" and result.rows_checked == 20 and result.rows_total == 300
    assert result.rows[0] == 0 and result.rows[-1] == 299
    assert "checked 20 of 300 query rows" in result.message and result.baseline_used

    # The sampled reference rows are exactly the full reference's rows.
    full = attention_reference(q, k, v, causal=True)
    problem = describe_problem(q, k, v, causal=True)
    plan = plan_reference(problem, flop_budget=reference.flop_budget)
    torch.testing.assert_close(attention_reference(q, k, v, causal=True, rows=plan.rows), full[:, :, plan.rows], rtol=0, atol=0)

    wrong = out.clone()
    wrong[0, 1, -1] += 0.1  # the last row is always sampled
    with pytest.raises(AssertionError, match="checked 20 of 300 query rows"):
        reference.check(wrong, q, k, v, causal=True)
    forced = SdpaReference().check(out, q, k, v, causal=True, sample_rows=5)
    assert forced.rows_checked == 5 and forced.mode == "sampled"


def test_check_never_passes_nan_and_wants_zeros_in_rows_without_keys():
    q, k, v = randn(1, 1, 6, 8, dtype=torch.float16), randn(1, 1, 3, 8, dtype=torch.float16), randn(1, 1, 3, 8, dtype=torch.float16)
    reference = SdpaReference()
    out = attention_reference(q, k, v, causal="lower_right").half()
    assert reference.check(out, q, k, v, causal="lower_right").passed  # SDPA's NaN rows do not spoil the baseline
    with_nan = out.clone()
    with_nan[0, 0, 0] = math.nan  # a row that sees no key: the reference says zeros
    with pytest.raises(AssertionError, match="NaN: 8 in actual"):
        reference.check(with_nan, q, k, v, causal="lower_right")


def test_check_without_an_sdpa_baseline_says_so():
    q, k, v = (randn(1, 2, 8, 16).to(torch.float8_e4m3fn) for _ in range(3))
    out = attention_reference(q, k, v).to(torch.bfloat16)
    result = SdpaReference().check(out, q, k, v)
    assert result.passed and not result.baseline_used
    assert "no SDPA baseline for torch.float8_e4m3fn on cpu" in result.message


def test_check_and_reference_reject_bad_input():
    q = randn(1, 2, 8, 16)
    reference = SdpaReference()
    with pytest.raises(ValueError, match=r"out has shape \(1, 2, 8, 8\); attention of these inputs gives \(1, 2, 8, 16\)"):
        reference.check(torch.zeros(1, 2, 8, 8), q, q, q)
    with pytest.raises(ValueError, match="causal must be False, True, 'top_left' or 'lower_right'; got 'upper'"):
        reference(q, q, q, causal="upper")
    with pytest.raises(ValueError, match="does not broadcast to"):
        reference(q, q, q, attn_mask=torch.ones(3, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"q must be 4-D \[B, H, S, D\]"):
        reference(q[0], q, q)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        reference(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.int64))


def test_case_14_is_checked_on_sampled_rows_within_budgets():
    # B=32, S=100,000, H=16, D=64 on a GPU with 60 GiB to spare: the plan alone (no GPU here).
    problem = AttentionProblem(
        batch=32, heads=16, kv_heads=16, q_len=100_000, k_len=100_000, head_dim=64, v_dim=64, causal="top_left",
        scale=0.125, device=torch.device("cuda"),
    )
    for budget in (60 * 2**30, 2 * 2**30):
        plan = plan_reference(problem, memory_budget=budget)
        assert plan.mode == "sampled" and plan.block_bytes <= budget
        assert plan.total_flops <= plan.flop_budget
        assert 2 <= plan.rows_checked < 100_000 and plan.rows[0] == 0 and plan.rows[-1] == 99_999
        # never S x S: one block holds at most rows_per_block rows of scores per head
        assert plan.rows_per_block * 100_000 * 8 * plan.heads_per_block <= budget
    with pytest.raises(MemoryError, match="needs at least"):
        attention_reference(*(torch.empty(32, 16, 100_000, 64, device="meta") for _ in range(3)), memory_budget=2**30)


def test_sdpa_reference_fixture(pytester):
    pytester.makepyfile(
        """
        import torch

        def test_kernel(sdpa_reference):
            q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64).half() for _ in range(3))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert sdpa_reference.check(out, q, k, v, causal=True).baseline_used
            assert sdpa_reference(q, k, v).dtype == torch.float64

        def test_wrong(sdpa_reference):
            q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64).half() for _ in range(3))
            sdpa_reference.check(torch.zeros_like(q), q, k, v)
        """
    )
    result = pytester.runpytest("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*sdpa_reference.check(torch.zeros_like(q), q, k, v)", "E*Tensors are not close*"])


def test_case_14_runs_through_the_sampled_path_without_an_s_by_s_block(monkeypatch):
    # Meta tensors carry shapes without memory, so the whole loop runs here; every matmul is recorded.
    from pytest_kernelcheck.reference import compute_reference

    q, k, v = (torch.empty(32, 16, 100_000, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    problem = describe_problem(q, k, v, causal=True)
    plan = plan_reference(problem, memory_budget=60 * 2**30, flop_budget=5e13)
    largest = []
    real_matmul = torch.matmul

    def recording_matmul(a, b):
        result = real_matmul(a, b)
        largest.append(result.numel())
        return result

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    out, has_keys = compute_reference(q, k, v, problem, plan)
    assert plan.mode == "sampled" and out.shape == (32, 16, plan.rows_checked, 64) and out.dtype == torch.float64
    assert has_keys.shape == (32, 16, plan.rows_checked)
    assert max(largest) <= plan.heads_per_block * plan.rows_per_block * 100_000 < 100_000**2
