"""The float64 attention reference against an independent computation and torch SDPA; chunked and sampled
paths; the check with its baseline rule; the plan for B=32, S=100,000, H=16, D=64."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from pytest_kernelcheck import SdpaReference, attention_reference, sample_query_rows
from pytest_kernelcheck.check.attention_problem import (
    AttentionProblem,
    describe_problem,
)
from pytest_kernelcheck.check.reference_plan import plan_reference


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


def test_rows_that_are_not_integer_indices_are_refused_not_converted():
    # Before: a bool row mask became the indices 0 and 1 (rows [1, 0, 1, ...]) and 2.7 was truncated to row 2.
    q, k, v = randn(1, 2, 6, 8), randn(1, 2, 6, 8), randn(1, 2, 6, 8)
    mask = torch.tensor([True, False, True, False, False, True])
    accepted = r"rows must be integer query-row indices \(ints or an integer tensor\)"
    with pytest.raises(TypeError, match=rf"{accepted}; got torch\.bool \(for a bool mask of rows pass "
                                        r"mask\.nonzero\(\)\.flatten\(\)\)"):
        attention_reference(q, k, v, rows=mask)
    with pytest.raises(TypeError, match=rf"{accepted}; got torch\.float32"):
        attention_reference(q, k, v, rows=[0.5, 2.7])
    full = naive_attention(q, k, v)
    torch.testing.assert_close(attention_reference(q, k, v, rows=mask.nonzero().flatten()), full[:, :, [0, 2, 5]],
                               rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="rows is empty"):
        attention_reference(q, k, v, rows=[])


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


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_check_with_a_key_mask_of_one_dimension_uses_the_sdpa_baseline(kind, causal):
    # A [S_k] mask broadcasts to [B, H, S_q, S_k]; SDPA raised IndexError on it, which escaped the check.
    q, k, v = (randn(2, 3, 24, 16, dtype=torch.float16) for _ in range(3))
    visible = torch.rand(29) > 0.3
    visible[0] = True  # every causal row sees a key
    k, v = (randn(2, 3, 29, 16, dtype=torch.float16) for _ in range(2))
    mask = visible if kind == "bool" else torch.where(visible, torch.rand(29) - 0.5, torch.tensor(-math.inf))
    allowed = visible.expand(24, 29)
    bias = None if kind == "bool" else torch.where(visible, mask, 0.0).double()
    if causal:
        allowed = allowed & causal_allowed(24, 29)
    expected = naive_attention(q.double(), k.double(), v.double(), allowed=allowed, bias=bias)
    # A kernel's rounding: the float64 result in the inputs' precision.
    out = expected.to(torch.float16)
    reference = SdpaReference()
    result = reference.check(out, q, k, v, causal=causal, attn_mask=mask)
    assert result.passed and result.baseline_used
    wrong = out.clone()
    wrong[1, 2, 5, 7] += 0.1
    with pytest.raises(AssertionError, match=r"at index \(1, 2, 5, 7\)"):
        reference.check(wrong, q, k, v, causal=causal, attn_mask=mask)


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


def test_sampled_check_never_passes_nan_or_inf_in_rows_it_does_not_compare():
    # The sample spares the float64 reference of most rows; before, a NaN or Inf in one of those rows passed.
    q, k, v = (randn(2, 2, 300, 16, dtype=torch.float16) for _ in range(3))
    out = flash_style(q, k, v, causal=True)
    reference = SdpaReference(flop_budget=2 * 2 * 2 * 300 * 32 * 20)  # about 20 rows per (batch, head)
    result = reference.check(out, q, k, v, causal=True)
    assert result.passed and result.mode == "sampled" and result.rows_checked == 20
    skipped = [row for row in range(300) if row not in set(result.rows.tolist())]
    gen = torch.Generator().manual_seed(7)
    row = skipped[int(torch.randint(len(skipped), (1,), generator=gen))]

    with_nan = out.clone()
    with_nan[1, 0, row, 5] = math.nan
    kept = with_nan.clone()
    with pytest.raises(AssertionError, match=rf"out holds 1 NaN in query rows the sampled check does not compare, the "
                       rf"first at index \(1, 0, {row}, 5\): NaN is never a correct attention output \(the check "
                       rf"compares 20 of 300 query rows"):
        reference.check(with_nan, q, k, v, causal=True)
    assert not reference.last_check.passed and reference.last_check.rows_checked == 20
    assert torch.equal(with_nan.isnan(), kept.isnan()) and torch.equal(with_nan.nan_to_num(), kept.nan_to_num())

    with_inf = out.clone()
    with_inf[0, 1, row, :3] = -math.inf  # v is finite, so every correct output is too
    with pytest.raises(AssertionError, match=rf"out holds 3 Inf .* first at index \(0, 1, {row}, 0\): with finite v"):
        reference.check(with_inf, q, k, v, causal=True)

    # In a row it compares, the comparison itself reports them, as before.
    in_sample = out.clone()
    in_sample[0, 0, -1, 0] = math.nan
    with pytest.raises(AssertionError, match="NaN: 1 in actual"):
        reference.check(in_sample, q, k, v, causal=True)


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


@pytest.mark.parametrize(
    "sizes, named",
    [
        (dict(B=0), r"B=0"),
        (dict(H=0, H_kv=0), r"H=0, H_kv=0"),
        (dict(S_q=0), r"S_q=0"),
        (dict(S_k=0), r"S_k=0"),
        (dict(D=0), r"D=0"),
        (dict(D_v=0), r"D_v=0"),
        (dict(B=0, S_k=0), r"B=0, S_k=0"),
    ],
)
@pytest.mark.parametrize("causal", [False, "lower_right"])
def test_an_empty_problem_is_refused_naming_the_empty_sizes(sizes, named, causal):
    # Before: B=0 passed comparing no element; H=0 recursed without end in the plan, S_q=0 and S_k=0 broke inside
    # the reference's loops, D=0 divided by zero for the default scale.
    size = {"B": 2, "H": 2, "H_kv": 2, "S_q": 5, "S_k": 7, "D": 4, "D_v": 3, **sizes}
    q = randn(size["B"], size["H"], size["S_q"], size["D"])
    k = randn(size["B"], size["H_kv"], size["S_k"], size["D"])
    v = randn(size["B"], size["H_kv"], size["S_k"], size["D_v"])
    out = randn(size["B"], size["H"], size["S_q"], size["D_v"], dtype=torch.float16)
    message = rf"the attention problem is empty \({named}; q \({size['B']}, .*\): there is nothing to compute or check"
    reference = SdpaReference()
    with pytest.raises(ValueError, match=message):
        reference.check(out, q.half(), k.half(), v.half(), causal=causal)
    assert reference.last_check is None
    with pytest.raises(ValueError, match=message):
        reference(q, k, v, causal=causal)
    with pytest.raises(ValueError, match=message):
        attention_reference(q, k, v, causal=causal, rows=[0] if size["S_q"] else None)


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


def record_matmul_sizes(monkeypatch):
    """The element counts of every torch.matmul result from now on, in a list that grows as they run."""
    sizes = []
    real_matmul = torch.matmul

    def recording_matmul(a, b):
        result = real_matmul(a, b)
        sizes.append(result.numel())
        return result

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    return sizes


def test_case_14_runs_through_the_sampled_path_without_an_s_by_s_block(monkeypatch):
    # Meta tensors carry shapes without memory, so the whole loop runs here; every matmul is recorded.
    from pytest_kernelcheck.check.reference import compute_reference

    q, k, v = (torch.empty(32, 16, 100_000, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    problem = describe_problem(q, k, v, causal=True)
    plan = plan_reference(problem, memory_budget=60 * 2**30, flop_budget=5e13)
    largest = record_matmul_sizes(monkeypatch)
    out, has_keys = compute_reference(q, k, v, problem, plan)
    assert plan.mode == "sampled" and out.shape == (32, 16, plan.rows_checked, 64) and out.dtype == torch.float64
    assert has_keys.shape == (32, 16, plan.rows_checked)
    assert max(largest) <= plan.heads_per_block * plan.rows_per_block * 100_000 < 100_000**2


# --------------------------------------------------------------------------------------------------------------
# Variants: sliding window, softcap, ALiBi (issue 15)


def variant_inputs(batch, heads, kv_heads, q_len, k_len, dim, *, dtype=torch.float64, seed=0):
    """Fresh q, k, v and positive ALiBi slopes [H] and [B, H] from a seeded generator (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, kv_heads, k_len, dim + 1, generator=gen, dtype=torch.float64).to(dtype)
    slopes_h = (torch.rand(heads, generator=gen) * 0.6 + 0.05).float()
    slopes_bh = (torch.rand(batch, heads, generator=gen) * 0.6 + 0.05).float()
    return q, k, v, slopes_h, slopes_bh


def dense_variant_attention(q, k, v, *, causal=False, window=None, softcap=None, alibi=None, scale=None, attn_mask=None):
    """The variants written out plainly: whole [B, H, S_q, S_k] float64 scores, each key's visibility and ALiBi
    distance decided one (i, j) at a time; rows that see no key are zeros."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, q_len, dim = q.shape
    k_len = k.shape[2]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(dim) if scale is None else scale
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    shift = k_len - q_len if causal == "lower_right" else 0
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    distance = torch.zeros(q_len, k_len, dtype=torch.float64)
    for i in range(q_len):
        aligned = i + shift
        for j in range(k_len):
            distance[i, j] = abs(aligned - j)
            if causal and j > aligned:
                visible[i, j] = False
            if window is not None:
                left, right = window
                if left != -1 and j < aligned - left:
                    visible[i, j] = False
                if right != -1 and j > aligned + right:
                    visible[i, j] = False
    if alibi is not None:
        per_batch_head = alibi.double().expand(batch, heads) if alibi.dim() == 1 else alibi.double()
        scores = scores - per_batch_head[:, :, None, None] * distance
    visible = visible.expand(batch, heads, q_len, k_len)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask.double()
    scores = scores.masked_fill(~visible, -math.inf)
    sees = visible.any(-1, keepdim=True)
    weights = torch.where(sees, torch.softmax(torch.where(sees, scores, 0.0), dim=-1), 0.0)
    return weights @ v


def baseline_of(q, k, v, *, attn_mask=None, rows=None, alibi_slopes=None, **options):
    from pytest_kernelcheck.check.reference import sdpa_baseline

    problem = describe_problem(q, k, v, attn_mask=attn_mask, alibi_slopes=alibi_slopes, **options)
    return sdpa_baseline(q, k, v, problem, attn_mask, rows, alibi_slopes=alibi_slopes)


def assert_same_where_seen(actual, expected, tol=1e-12):
    """Equal on rows with a visible key; the baseline may hold NaN on rows without one (the check zeroes them)."""
    seen = expected.abs().sum(-1, keepdim=True) > 0
    torch.testing.assert_close(actual.masked_fill(~seen, 0), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [(2, 1), (0, -1), (-1, 3), (3, 0), (-1, -1), (1, 1)])
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("q_len, k_len", [(7, 7), (5, 11), (11, 5)])
def test_window_with_each_causal_mode_matches_the_dense_computation(q_len, k_len, causal, window):
    q, k, v, *_ = variant_inputs(2, 3, 3, q_len, k_len, 8, seed=q_len * 100 + k_len)
    expected = dense_variant_attention(q, k, v, causal=causal, window=window)
    ours = attention_reference(q, k, v, causal=causal, window=window)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    # The SDPA baseline's dense window mask means the same thing (float64 inputs: SDPA is exact enough to tell).
    assert_same_where_seen(baseline_of(q, k, v, causal=causal, window=window), expected)


@pytest.mark.parametrize("slopes_kind", ["H", "BH"])
@pytest.mark.parametrize(
    "causal, window, q_len, k_len",
    [(False, None, 7, 9), (True, None, 9, 7), ("lower_right", None, 5, 11), ("lower_right", (3, -1), 11, 5),
     (False, (2, 2), 9, 9), (True, (4, 0), 13, 13)],
)
def test_softcap_and_alibi_match_the_dense_computation(slopes_kind, causal, window, q_len, k_len):
    q, k, v, slopes_h, slopes_bh = variant_inputs(2, 4, 4, q_len, k_len, 8, seed=q_len + 7 * k_len)
    slopes = slopes_h if slopes_kind == "H" else slopes_bh
    options = dict(causal=causal, window=window, scale=0.9)
    for softcap, alibi in ((1.5, None), (None, slopes), (1.5, slopes), (30, slopes)):
        expected = dense_variant_attention(q, k, v, softcap=softcap, alibi=alibi, **options)
        ours = attention_reference(q, k, v, softcap=softcap, alibi_slopes=alibi, **options)
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
        assert_same_where_seen(baseline_of(q, k, v, softcap=softcap, alibi_slopes=alibi, **options), expected)
    # The variants are not silently ignored: each one moves the result well past the tolerance above.
    plain = dense_variant_attention(q, k, v, **options)
    assert (dense_variant_attention(q, k, v, softcap=1.5, **options) - plain).abs().max() > 1e-3
    assert (dense_variant_attention(q, k, v, alibi=slopes, **options) - plain).abs().max() > 1e-3


def test_alibi_per_batch_slopes_differ_from_per_head_slopes():
    q, k, v, slopes_h, slopes_bh = variant_inputs(3, 2, 2, 6, 6, 8, seed=5)
    per_batch = attention_reference(q, k, v, alibi_slopes=slopes_bh)
    for b in range(3):  # batch entry b with [B, H] slopes is batch entry b with its own [H] row
        alone = attention_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], alibi_slopes=slopes_bh[b])
        torch.testing.assert_close(per_batch[b:b + 1], alone, rtol=1e-13, atol=1e-13)
    same_for_all = attention_reference(q, k, v, alibi_slopes=slopes_h)
    torch.testing.assert_close(same_for_all, attention_reference(q, k, v, alibi_slopes=slopes_h.expand(3, 2).clone()))


@pytest.mark.parametrize("causal", [False, True, "lower_right"])
def test_variants_with_grouped_query_attention(causal):
    q, k, v, slopes_h, slopes_bh = variant_inputs(2, 6, 2, 7, 10, 8, seed=11)
    options = dict(causal=causal, window=(3, 2), softcap=2.0, enable_gqa=True)
    for slopes in (slopes_h, slopes_bh):
        expected = dense_variant_attention(q, k, v, causal=causal, window=(3, 2), softcap=2.0, alibi=slopes)
        ours = attention_reference(q, k, v, alibi_slopes=slopes, **options)
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
        assert_same_where_seen(baseline_of(q, k, v, alibi_slopes=slopes, **options), expected)
    without_alibi = dense_variant_attention(q, k, v, causal=causal, window=(3, 2))
    ours = attention_reference(q, k, v, causal=causal, window=(3, 2), enable_gqa=True)
    torch.testing.assert_close(ours, without_alibi, rtol=1e-12, atol=1e-12)
    assert_same_where_seen(baseline_of(q, k, v, causal=causal, window=(3, 2), enable_gqa=True), without_alibi)


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_variants_combine_with_bool_and_float_masks(softcap):
    q, k, v, slopes_h, _ = variant_inputs(2, 3, 3, 9, 12, 8, seed=21)
    gen = torch.Generator().manual_seed(22)
    allowed = torch.rand(2, 1, 9, 12, generator=gen) > 0.3
    bias = torch.randn(1, 3, 9, 12, generator=gen, dtype=torch.float64)
    for mask in (allowed, bias):
        options = dict(causal="lower_right", window=(4, 1), softcap=softcap, attn_mask=mask)
        expected = dense_variant_attention(q, k, v, alibi=slopes_h, **options)
        ours = attention_reference(q, k, v, alibi_slopes=slopes_h, **options)
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
        assert_same_where_seen(baseline_of(q, k, v, alibi_slopes=slopes_h, **options), expected)


def test_a_window_that_excludes_every_key_gives_zero_rows():
    q, k, v, slopes_h, _ = variant_inputs(1, 2, 2, 6, 3, 8, seed=31)
    # window (0, 0): row i sees key i only, so rows 3..5 see nothing (there are 3 keys)
    ours = attention_reference(q, k, v, window=(0, 0), softcap=3.0, alibi_slopes=slopes_h)
    assert torch.count_nonzero(ours[:, :, 3:]) == 0
    torch.testing.assert_close(ours[:, :, :3], v.double()[:, :, :3])  # one key seen: its value exactly
    # lower_right aligns row i to i - 3: with a window of 1 to the left and none to the right, rows 0..2 see nothing
    ours = attention_reference(q, k, v, causal="lower_right", window=(1, 0))
    assert torch.count_nonzero(ours[:, :, :3]) == 0 and torch.count_nonzero(ours[:, :, 3:]) > 0
    torch.testing.assert_close(ours, dense_variant_attention(q, k, v, causal="lower_right", window=(1, 0)))
    # the check wants those zeros, and the baseline's NaN rows there do not spoil it
    half = [t.half() for t in (q, k, v)]
    out = attention_reference(*half, causal="lower_right", window=(1, 0), alibi_slopes=slopes_h).half()
    result = SdpaReference().check(out, *half, causal="lower_right", window=(1, 0), alibi_slopes=slopes_h)
    assert result.passed and result.baseline_used
    with_nan = out.clone()
    with_nan[0, 1, 0] = math.nan
    with pytest.raises(AssertionError, match="NaN"):
        SdpaReference().check(with_nan, *half, causal="lower_right", window=(1, 0), alibi_slopes=slopes_h)


def test_chunked_and_sampled_variant_rows_equal_the_dense_ones():
    q, k, v, slopes_h, slopes_bh = variant_inputs(2, 4, 2, 37, 41, 8, dtype=torch.float16, seed=41)
    options = dict(causal="lower_right", window=(9, 2), softcap=4.0, alibi_slopes=slopes_bh, enable_gqa=True)
    dense = dense_variant_attention(q, k, v, causal="lower_right", window=(9, 2), softcap=4.0, alibi=slopes_bh)
    problem = describe_problem(q, k, v, **options)
    budget = 40_000
    plan = plan_reference(problem, memory_budget=budget, flop_budget=math.inf)
    assert plan.mode == "chunked" and plan.rows_per_block < 37 and plan.block_bytes <= budget
    # The window masks and ALiBi distances are counted: fewer rows fit a block than for plain attention.
    plain = plan_reference(describe_problem(q, k, v, causal="lower_right", enable_gqa=True), memory_budget=budget, flop_budget=math.inf)
    assert (plan.heads_per_block, plan.rows_per_block) < (plain.heads_per_block, plain.rows_per_block)
    chunked = attention_reference(q, k, v, memory_budget=budget, **options)
    torch.testing.assert_close(chunked, dense, rtol=1e-12, atol=1e-12)
    rows = sample_query_rows(37, 6, seed=2)
    sampled = attention_reference(q, k, v, rows=rows, memory_budget=budget, **options)
    torch.testing.assert_close(sampled, dense[:, :, rows], rtol=1e-12, atol=1e-12)

    # The check on sampled rows: its reference and baseline rows are those rows of the dense ones.
    reference = SdpaReference(flop_budget=2 * 4 * 41 * 17 * 8)  # about 8 rows per (batch, head)
    result = reference.check(dense.half(), q, k, v, **options)
    assert result.mode == "sampled" and 2 <= result.rows_checked < 37 and result.baseline_used
    assert "the same math in the input precision" in result.message
    assert_same_where_seen(
        baseline_of(q.double(), k.double(), v.double(), rows=result.rows, **options), dense[:, :, result.rows]
    )


def test_variant_plan_for_case_14_stays_within_budget_on_meta_tensors(monkeypatch):
    from pytest_kernelcheck.check.reference import compute_reference

    q, k, v = (torch.empty(32, 16, 100_000, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    slopes = torch.empty(16, device="meta")
    problem = describe_problem(q, k, v, causal=True, window=(1024, 0), softcap=30.0, alibi_slopes=slopes)
    plan = plan_reference(problem, memory_budget=60 * 2**30, flop_budget=5e13)
    assert plan.mode == "sampled" and plan.block_bytes <= 60 * 2**30
    largest = record_matmul_sizes(monkeypatch)
    out, has_keys = compute_reference(q, k, v, problem, plan, alibi_slopes=slopes)
    assert out.shape == (32, 16, plan.rows_checked, 64) and has_keys.shape == (32, 16, plan.rows_checked)
    assert max(largest) <= plan.heads_per_block * plan.rows_per_block * 100_000 < 100_000**2


def test_check_with_variants_passes_a_right_kernel_and_fails_one_that_drops_a_variant():
    q, k, v, slopes_h, _ = variant_inputs(2, 2, 2, 40, 40, 16, dtype=torch.bfloat16, seed=51)
    options = dict(causal=True, window=(8, -1), softcap=2.0)
    right = dense_variant_attention(q, k, v, alibi=slopes_h, **options).to(torch.bfloat16)
    reference = SdpaReference()
    result = reference.check(right, q, k, v, alibi_slopes=slopes_h, **options)
    assert result.passed and result.baseline_used and "SDPA cannot softcap" in result.message
    # The explicit bf16 baseline is a sensible bf16 attention, not something far off.
    baseline = baseline_of(q, k, v, alibi_slopes=slopes_h, **options)
    assert (baseline.double() - right.double()).abs().max() < 5e-2
    no_softcap = dense_variant_attention(q, k, v, alibi=slopes_h, causal=True, window=(8, -1)).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="baseline rule"):
        reference.check(no_softcap, q, k, v, alibi_slopes=slopes_h, **options)
    no_alibi = dense_variant_attention(q, k, v, **options).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        reference.check(no_alibi, q, k, v, alibi_slopes=slopes_h, **options)
    masked = dense_variant_attention(q, k, v, alibi=slopes_h, causal=True, window=(8, -1)).to(torch.bfloat16)
    result = reference.check(masked, q, k, v, alibi_slopes=slopes_h, causal=True, window=(8, -1))
    assert result.passed and "dense mask in the input dtype" in result.message


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(window=(-2, 0)), ValueError, r"window left side must be >= -1 \(-1 = unbounded\); got -2"),
        (dict(window=(0, -5)), ValueError, r"window right side must be >= -1"),
        (dict(window=(1.0, 0)), TypeError, r"window left side must be an int >= -1 .*got 1\.0"),
        (dict(window=(True, 0)), TypeError, r"window left side must be an int"),
        (dict(window=(0, False)), TypeError, r"window right side must be an int"),
        (dict(window=3), TypeError, r"window must be a \(left, right\) pair of ints"),
        (dict(window=(1, 2, 3)), TypeError, r"window must be a \(left, right\) pair of ints"),
        (dict(window="ab"), TypeError, r"window must be a \(left, right\) pair of ints"),
        (dict(softcap=0.0), ValueError, r"softcap must be a finite number > 0; got 0\.0"),
        (dict(softcap=-3), ValueError, r"softcap must be a finite number > 0; got -3"),
        (dict(softcap=math.inf), ValueError, r"softcap must be a finite number > 0; got inf"),
        (dict(softcap=math.nan), ValueError, r"softcap must be a finite number > 0; got nan"),
        (dict(softcap=True), TypeError, r"softcap must be a finite number > 0; got True"),
        (dict(softcap="30"), TypeError, r"softcap must be a finite number > 0; got '30'"),
        (dict(alibi_slopes=[0.5, 0.5, 0.5]), TypeError, r"alibi_slopes must be a floating torch.Tensor .*got list"),
        (dict(alibi_slopes=torch.ones(3, dtype=torch.int32)), TypeError, r"alibi_slopes must be floating point.*int32"),
        (dict(alibi_slopes=torch.ones(4)), ValueError, r"alibi_slopes must have shape \[H\] = \(3,\) or \[B, H\] = \(2, 3\); got \(4,\)"),
        (dict(alibi_slopes=torch.ones(3, 2)), ValueError, r"alibi_slopes must have shape .*got \(3, 2\)"),
        (dict(alibi_slopes=torch.ones(1, 3)), ValueError, r"alibi_slopes must have shape .*got \(1, 3\)"),
        (dict(alibi_slopes=torch.ones(2, 3, 1)), ValueError, r"alibi_slopes must have shape .*got \(2, 3, 1\)"),
        (dict(alibi_slopes=torch.ones(3, device="meta")), ValueError, r"q is on cpu but alibi_slopes is on meta"),
    ],
)
def test_bad_variant_input_names_the_argument(options, error, message):
    q, k, v, *_ = variant_inputs(2, 3, 3, 5, 5, 4, seed=61)
    with pytest.raises(error, match=message):
        attention_reference(q, k, v, **options)
    with pytest.raises(error, match=message):
        SdpaReference()(q, k, v, **options)
    with pytest.raises(error, match=message):
        SdpaReference().check(q.clone(), q, k, v, **options)


def test_slopes_must_agree_with_the_problem():
    from pytest_kernelcheck.check.reference import compute_reference, sdpa_baseline

    q, k, v, slopes_h, _ = variant_inputs(1, 3, 3, 5, 5, 4, seed=71)
    with_alibi = describe_problem(q, k, v, alibi_slopes=slopes_h)
    without = describe_problem(q, k, v)
    with pytest.raises(ValueError, match="described with alibi_slopes, but none were passed"):
        compute_reference(q, k, v, with_alibi, plan_reference(with_alibi))
    with pytest.raises(ValueError, match="alibi_slopes were passed, but the problem was described without them"):
        sdpa_baseline(q, k, v, without, alibi_slopes=slopes_h)
