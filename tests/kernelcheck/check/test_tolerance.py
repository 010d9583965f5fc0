"""Tolerance policies, the baseline rule, assert_close's messages and errors, and the tolerance marker."""
import math
import warnings
import re

import pytest
import torch

from pytest_kernelcheck import TolerancePolicy, assert_close, policy_for
from pytest_kernelcheck.check.tolerance import parse_tolerance_marker, use_override


def _attention64(q, k, v):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def _flash_style(q, k, v, dtype):
    """Attention the way a fused kernel computes it: fp32 scores, probabilities rounded to ``dtype`` before P @ V."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    return ((weights.to(dtype).float() @ v.float()) / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_default_policy_accepts_a_correct_low_precision_attention(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 96, 32).to(dtype) for _ in range(3))
    expected = _attention64(q.double(), k.double(), v.double())
    actual = _flash_style(q, k, v, dtype) if dtype in (torch.float16, torch.bfloat16) else _attention64(q, k, v)
    report = assert_close(actual, expected)
    assert report.passed and report.policy.name == {
        torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"
    }[dtype]


@pytest.mark.parametrize(
    "name, dtype, exponent_bits",
    [("fp16", torch.float16, None), ("bf16", torch.bfloat16, None), ("fp32", torch.float32, None),
     ("fp64", torch.float64, None), ("tf32", torch.float32, None),
     ("fp8_e4m3", torch.float8_e4m3fn, None), ("fp8_e5m2", torch.float8_e5m2, None)],
)
def test_each_policy_passes_rounding_error_and_fails_a_real_error(name, dtype, exponent_bits):
    torch.manual_seed(1)
    policy = policy_for(name)
    expected = torch.randn(64, 48, dtype=torch.float64)
    rounded = expected.to(dtype, copy=True)  # a copy for fp64 too: assert_close refuses a tensor against itself
    if name == "tf32":  # tf32 keeps 10 mantissa bits: round the float32 value to them
        bits = rounded.contiguous().view(torch.int32)
        rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    assert assert_close(rounded, expected, policy=name).passed
    wrong = rounded.to(torch.float64).clone()
    wrong[5, 7] += 20 * (policy.atol + policy.rtol * abs(float(expected[5, 7])))
    with pytest.raises(AssertionError, match=r"mismatched elements: 1 / 3072 .*\n.*at index \(5, 7\)"):
        assert_close(wrong, expected, policy=policy)


def test_policy_lookup_by_dtype_name_and_object():
    assert policy_for(torch.bfloat16) is policy_for("bfloat16") is policy_for("bf16")
    assert policy_for("TF32").rtol == 1e-3
    assert policy_for(torch.float8_e5m2).name == "fp8_e5m2"
    assert policy_for(torch.int32).atol == 0.0
    custom = TolerancePolicy(atol=1.0, rtol=0.0, name="mine")
    assert policy_for(custom) is custom
    with pytest.raises(ValueError, match="unknown tolerance policy name 'fp12'; known names: .*tf32"):
        policy_for("fp12")
    with pytest.raises(TypeError, match="got float"):
        policy_for(1e-3)
    with pytest.raises(ValueError, match="atol must be a finite number >= 0"):
        TolerancePolicy(atol=-1.0, rtol=0.0)


def test_failure_message_gives_every_figure():
    expected = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    actual = expected.to(torch.float16).clone()
    actual[1, 2] = 6.5
    actual[0, 1] = 2.5
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected)
    text = str(failure.value)
    assert "policy 'fp16' (atol=0.001, rtol=0.001)" in text
    assert "mismatched elements: 2 / 6 (33.33%)" in text
    assert "max abs error: 0.5 at index (0, 1) (actual 2.5, expected 2)" in text
    assert "max rel error: 0.25 at index (0, 1) (actual 2.5, expected 2)" in text
    assert "NaN: 0 in actual, 0 in expected; Inf: 0 in actual, 0 in expected" in text


def test_nan_never_passes_even_where_expected_is_nan():
    expected = torch.randn(4, 4, dtype=torch.float64)
    actual = expected.clone()
    actual[2, 3] = float("nan")
    with pytest.raises(AssertionError, match=r"(?s)mismatched elements: 1 / 16.*NaN: 1 in actual, 0 in expected.*NaN never passes"):
        assert_close(actual, expected, policy=TolerancePolicy(atol=1e9, rtol=1e9))
    expected[2, 3] = float("nan")
    with pytest.raises(AssertionError, match=r"(?s)NaN: 1 in actual, 1 in expected.*must not produce NaN"):
        assert_close(actual, expected, policy=TolerancePolicy(atol=1e9, rtol=1e9))


def test_inf_must_match_exactly():
    expected = torch.tensor([1.0, math.inf, -math.inf], dtype=torch.float64)
    assert assert_close(expected.clone(), expected).passed
    with pytest.raises(AssertionError, match="1 without the same Inf opposite"):
        assert_close(torch.tensor([1.0, math.inf, math.inf], dtype=torch.float64), expected)
    with pytest.raises(AssertionError, match="Inf: 1 in actual, 0 in expected, 1 without"):
        assert_close(torch.tensor([math.inf, 2.0], dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_baseline_rule_allows_twice_pytorch_error_plus_floor():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 64, 32).half() for _ in range(3))
    expected = _attention64(q.double(), k.double(), v.double())
    baseline = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    good = _flash_style(q, k, v, torch.float16)
    report = assert_close(good, expected, baseline=baseline)
    baseline_error = (baseline.double() - expected).abs().max().item()
    assert report.baseline_error == pytest.approx(baseline_error)
    assert report.allowed_error == pytest.approx(2 * baseline_error + policy_for("fp16").baseline_floor)

    bad = good.clone()
    bad[0, 1, 10, 3] += 3 * report.allowed_error
    with pytest.raises(AssertionError) as failure:
        assert_close(bad, expected, baseline=baseline)
    text = str(failure.value)
    assert "baseline rule of policy 'fp16': max|actual - expected| <= 2 * max|baseline - expected| + 0.00025" in text
    assert "worst violation at index (0, 1, 10, 3)" in text
    ratio = float(re.search(r"error ratio actual/baseline = ([0-9.e+-]+)", text).group(1))
    assert ratio > 2


def test_inputs_that_cannot_be_compared_are_named():
    a = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="expected must be a dense torch.Tensor, .*; got list"):
        assert_close(a, [[0.0] * 3] * 2)
    with pytest.raises(ValueError, match=r"shapes differ: actual \(2, 3\), expected \(3, 2\)"):
        assert_close(a, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="devices differ: actual on cpu, expected on meta"):
        assert_close(a, torch.zeros(2, 3, device="meta"))
    with pytest.raises(ValueError, match=r"shapes differ: actual \(2, 3\), baseline \(6,\)"):
        assert_close(a, a.double(), baseline=torch.zeros(6))
    with pytest.raises(ValueError, match="baseline holds NaN or Inf"):
        assert_close(a, a.double(), baseline=torch.full((2, 3), math.nan))
    with pytest.raises(TypeError, match="complex"):
        assert_close(torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64))


def test_a_tensor_compared_with_itself_is_refused():
    actual = torch.randn(6, 10, dtype=torch.float16)
    itself = r"expected is actual itself \(the same memory, dtype, shape and strides\), so the comparison cannot fail"
    for same in (actual, actual.view(6, 10), actual.detach(), actual.to(torch.float16), actual[:, :]):
        with pytest.raises(ValueError, match=itself):
            assert_close(actual, same)
    with pytest.raises(ValueError, match=itself):
        assert_close(actual[2:], actual[2:])  # two view objects of the same elements
    with pytest.raises(ValueError, match=r"baseline is actual itself .* so the comparison cannot fail"):
        assert_close(actual, actual.double() + 1.0, baseline=actual)
    # The same memory read as other elements is a real comparison (random rows differ), and a copy is as good.
    with pytest.raises(AssertionError, match="mismatched elements"):
        assert_close(actual[1:], actual[:-1])
    assert assert_close(actual, actual.clone()).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_tensors_without_elements_are_refused(dtype):
    shape = (int(torch.randint(1, 9, ())), 0)
    with pytest.raises(ValueError, match=rf"actual and expected hold no elements \(shape {re.escape(str(shape))}\), "
                                         "so the comparison would assert nothing"):
        assert_close(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=torch.float64))


def test_large_tensors_are_streamed_in_blocks(monkeypatch):
    import pytest_kernelcheck.check.tolerance as tolerance

    monkeypatch.setattr(tolerance, "_BLOCK_ELEMENTS", 100)
    expected = torch.randn(7, 9, 11, dtype=torch.float64)
    actual = expected.float()
    actual[6, 8, 10] += 1.0
    actual[3, 0, 0] = math.nan
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected)
    text = str(failure.value)
    assert "mismatched elements: 2 / 693" in text and "max abs error: 1 at index (6, 8, 10)" in text
    assert "worst violation at index (3, 0, 0): actual nan" in text and "NaN: 1 in actual" in text
    assert "first 2 of 2 mismatched elements:\n    (3, 0, 0): actual nan" in text and "\n    (6, 8, 10): " in text


def test_override_resolution():
    fields = parse_tolerance_marker((), {"atol": 0.5, "baseline_factor": 3})
    assert fields.resolve(torch.float16).atol == 0.5 and fields.resolve(torch.float16).rtol == 1e-3
    assert fields.resolve(torch.bfloat16).baseline_factor == 3
    named = parse_tolerance_marker(("tf32",), {})
    assert named.resolve(torch.float32) == policy_for("tf32")
    per_dtype = parse_tolerance_marker(({torch.float16: dict(atol=2e-3), "bfloat16": "fp32"},), {})
    assert per_dtype.resolve(torch.float16).atol == 2e-3
    assert per_dtype.resolve(torch.bfloat16) == policy_for("fp32")
    assert per_dtype.resolve(torch.float32) == policy_for("fp32")
    with use_override(fields):
        assert assert_close(torch.ones(2, dtype=torch.float16) + 0.25, torch.ones(2, dtype=torch.float64)).passed
    with pytest.raises(AssertionError):
        assert_close(torch.ones(2, dtype=torch.float16) + 0.25, torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((), {}, "the tolerance marker is empty"),
        ((), {"atl": 1e-2}, r"unknown tolerance field\(s\) \['atl'\]"),
        ((), {"atol": -1}, "atol must be a finite number >= 0"),
        (("fp12",), {}, "unknown tolerance policy name 'fp12'"),
        (({"tf32": dict(atol=1)},), {}, "per-dtype tolerance keys must name a torch dtype"),
        ((1, 2), {}, "at most one positional argument"),
        (("tf32",), {"policy": "bf16"}, r"a policy both positionally \('tf32'\) and as policy='bf16'; give it once"),
        (({torch.int64: dict(atol=1)},), {}, "must name a floating-point dtype; got torch.int64: integer and bool"),
    ],
)
def test_bad_tolerance_markers_are_named(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        parse_tolerance_marker(args, kwargs)


def test_the_policy_keyword_is_the_positional_policy():
    # The marker's help reads tolerance(policy=None, **fields); policy= was refused as an unknown field.
    assert parse_tolerance_marker((), {"policy": "tf32"}) == parse_tolerance_marker(("tf32",), {})
    keyword = parse_tolerance_marker((), {"policy": torch.bfloat16, "baseline_factor": 3})
    assert keyword.resolve(torch.float16) == policy_for("bf16").replace(baseline_factor=3)
    per_dtype = parse_tolerance_marker((), {"policy": {torch.float16: dict(atol=2e-3)}})
    assert per_dtype.resolve(torch.float16).atol == 2e-3 and per_dtype.resolve(torch.float32) == policy_for("fp32")
    assert parse_tolerance_marker((), {"policy": None, "atol": 0.5}).resolve(torch.float32).atol == 0.5
    with pytest.raises(ValueError, match="the tolerance marker is empty"):
        parse_tolerance_marker((), {"policy": None})


def test_a_tolerance_marker_leaves_integer_comparisons_exact():
    counts = torch.randint(1000, 5000, (37,), dtype=torch.int64)
    off = counts.clone()
    off[int(torch.randint(0, 37, ()))] += 15  # within the marker's atol + rtol * |expected| (17 and more here)
    loosened = torch.randn(37, dtype=torch.float64)
    with use_override(parse_tolerance_marker(("bf16",), {"atol": 1.0})):
        with pytest.raises(AssertionError, match=r"policy 'exact'.*compared exactly as integers"):
            assert_close(off, counts)
        with pytest.raises(AssertionError, match="policy 'exact'"):
            assert_close(off.to(torch.int32), counts.to(torch.float64))  # an integer result against floats too
        # Floating-point results are what the marker loosens, and a call's own policy still applies to integers.
        assert assert_close(loosened + 0.5, loosened).policy.name == "bf16 (atol=1)"
        assert assert_close(off, counts, policy="bf16").passed


def test_tolerance_marker_applies_inside_the_test_only(pytester):
    pytester.makepyfile(
        """
        import pytest, torch
        from pytest_kernelcheck import assert_close

        actual = torch.ones(8, dtype=torch.float16) + 0.005
        expected = torch.ones(8, dtype=torch.float64)

        @pytest.mark.tolerance(atol=1e-2, rtol=1e-2)
        def test_loosened():
            assert assert_close(actual, expected).policy.name == "fp16 (atol=0.01, rtol=0.01)"

        @pytest.mark.tolerance("bf16")
        def test_named():
            assert_close(actual, expected)

        @pytest.mark.tolerance(policy="bf16")
        def test_named_by_keyword():
            assert assert_close(actual, expected).policy.name == "bf16"

        @pytest.mark.tolerance({torch.float16: dict(rtol=1e-2)})
        def test_per_dtype():
            assert_close(actual, expected)

        @pytest.mark.tolerance(atol=1e-2, rtol=1e-2)
        def test_explicit_policy_wins():
            assert_close(actual, expected, policy="fp16")

        def test_default_still_strict():
            assert_close(actual, expected)
        """
    )
    result = pytester.runpytest("-q")
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines(["*test_explicit_policy_wins*", "*Tensors are not close under policy 'fp16'*"])


def test_bad_tolerance_marker_is_a_collection_error(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.tolerance(atol="big")
        def test_bad_marker():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*::test_bad_marker: tolerance field atol must be a finite number >= 0; got 'big'"])
    assert "During handling" not in result.stdout.str()


# --------------------------------------------------------------------------------------------------------------
# Arguments are never modified


def _bits(tensor):
    """The tensor's bit pattern, so NaN payloads and signed zeros count as changes."""
    return tensor.contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("fails", [False, True], ids=["passing", "failing"])
@pytest.mark.parametrize("with_baseline", [False, True], ids=["per-element", "baseline"])
def test_no_argument_is_modified(fails, with_baseline):
    expected = torch.randn(13, 7, dtype=torch.float64)
    baseline = expected.to(torch.float16).to(torch.float64)  # float64 holding fp16-rounded values
    actual = expected + (baseline - expected) * torch.rand(13, 7, dtype=torch.float64)  # within the baseline's error
    if fails:
        actual[4, 5] += 3.0
        actual[11, 2] = math.nan
    before = [_bits(t) for t in (actual, expected, baseline)]
    kwargs = dict(baseline=baseline) if with_baseline else dict(policy="fp16")
    if fails:
        with pytest.raises(AssertionError):
            assert_close(actual, expected, **kwargs)
    else:
        assert assert_close(actual, expected, **kwargs).passed
    for label, tensor, bits in zip(("actual", "expected", "baseline"), (actual, expected, baseline), before):
        assert torch.equal(_bits(tensor), bits), f"{label} was modified"


@pytest.mark.parametrize("fails", [False, True], ids=["passing", "failing"])
def test_no_integer_argument_is_modified(fails):
    expected = torch.randint(-2**62, 2**62, (9, 5), dtype=torch.int64)
    actual, baseline = expected.clone(), expected.clone()
    baseline[0, 0] += 1  # allows an error of 2 * 1 under the 'exact' policy's baseline rule
    if fails:
        actual[8, 4] -= 5
    before = [t.clone() for t in (actual, expected, baseline)]
    if fails:
        with pytest.raises(AssertionError):
            assert_close(actual, expected, baseline=baseline)
    else:
        assert assert_close(actual, expected, baseline=baseline).passed
    assert all(torch.equal(t, b) for t, b in zip((actual, expected, baseline), before))


# --------------------------------------------------------------------------------------------------------------
# Integer and bool tensors are compared exactly

INT64_MAX, INT64_MIN = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min


@pytest.mark.parametrize(
    "actual, expected",
    [(2**53 + 1, 2**53), (INT64_MAX, INT64_MAX - 1), (INT64_MIN, INT64_MIN + 1), (INT64_MIN, INT64_MAX)],
    ids=["2**53+1", "int64-max", "int64-min", "min-vs-max"],
)
def test_integers_beyond_float64_precision_are_compared_exactly(actual, expected):
    n = 11
    values = torch.randint(-2**62, 2**62, (n,), dtype=torch.int64)
    a, e = values.clone(), values.clone()
    where = int(torch.randint(0, n, ()))
    a[where], e[where] = actual, expected
    with pytest.raises(AssertionError) as failure:
        assert_close(a, e)
    text = str(failure.value)
    assert "mismatched elements: 1 / 11" in text
    difference = abs(actual - expected)
    assert f"worst violation at index ({where},): actual {actual}, expected {expected}, differ by {difference}" in text
    assert assert_close(a.clone(), a).passed


def test_unsigned_and_mixed_integer_tensors_are_compared_exactly():
    top = 2**64 - 1
    with pytest.raises(AssertionError, match=f"actual {top}, expected {top - 1}, differ by 1"):
        assert_close(torch.tensor([7, top], dtype=torch.uint64), torch.tensor([7, top - 1], dtype=torch.uint64))
    # uint64 against int64: 2**63 is one more than int64's largest value, not equal to it.
    with pytest.raises(AssertionError, match=f"actual {2**63}, expected {INT64_MAX}, differ by 1"):
        assert_close(torch.tensor([2**63], dtype=torch.uint64), torch.tensor([INT64_MAX]))
    with pytest.raises(AssertionError, match=f"actual 0, expected {INT64_MIN}, differ by {2**63}"):
        assert_close(torch.tensor([0], dtype=torch.uint64), torch.tensor([INT64_MIN]))
    small = torch.randint(0, 200, (17,), dtype=torch.int64)
    assert assert_close(small.to(torch.uint8), small).passed and assert_close(small.to(torch.int16), small).passed


def test_bool_tensors_are_compared_exactly():
    expected = torch.rand(3, 5) > 0.5
    assert assert_close(expected.clone(), expected).passed
    assert assert_close(expected.to(torch.int32), expected).passed  # True == 1, False == 0
    actual = expected.clone()
    actual[2, 1] = not bool(expected[2, 1])
    with pytest.raises(AssertionError, match=(
        rf"mismatched elements: 1 / 15 .*\n  worst violation at index \(2, 1\): actual {bool(actual[2, 1])}, "
        rf"expected {bool(expected[2, 1])}, differ by 1"
    )):
        assert_close(actual, expected)


def test_integer_tolerance_is_applied_in_exact_arithmetic():
    # Near 2**60 float64 steps by 256, so a float64 comparison could not tell 1 from 2.
    expected = torch.randint(2**60, 2**61, (7, 3), dtype=torch.int64)
    off_by_one = expected.clone()
    off_by_one[3, 1] += 1
    policy = TolerancePolicy(atol=1.0, rtol=0.0, name="one")
    assert assert_close(off_by_one, expected, policy=policy).passed
    off_by_two = expected.clone()
    off_by_two[5, 2] -= 2
    with pytest.raises(AssertionError, match=r"worst violation at index \(5, 2\).*\|actual - expected\| 2 > bound 1"):
        assert_close(off_by_two, expected, policy=policy)


def test_integer_against_float_uses_the_float_rule():
    expected = torch.randn(19, dtype=torch.float64) * 100
    actual = expected.round().to(torch.int32)
    # The default policy for an integer result is 'exact' (atol = rtol = 0), applied in float64.
    with pytest.raises(AssertionError, match="policy 'exact'"):
        assert_close(actual, expected)
    assert assert_close(actual, expected, policy=TolerancePolicy(atol=0.5, rtol=0.0)).passed
    assert assert_close(actual, actual.to(torch.float64)).passed


# --------------------------------------------------------------------------------------------------------------
# The failure message names the element that broke the rule


def _policy_1e3():
    return TolerancePolicy(atol=1e-3, rtol=1e-3, name="p")


def test_failure_message_names_the_worst_violation_not_the_largest_errors():
    policy = _policy_1e3()
    expected = torch.rand(5, 7, dtype=torch.float64) + 0.25
    actual = expected + (torch.rand(5, 7, dtype=torch.float64) - 0.5) * 1e-4  # well inside the bound
    expected[0, 6], actual[0, 6] = 1000.0, 1000.9        # the largest absolute error, inside 1e-3 + 1
    expected[1, 0], actual[1, 0] = 1e-6, 5e-4            # the largest relative error, inside 1e-3 + 1e-9
    actual[3, 2] = expected[3, 2] + 0.02                 # violations; this one is over its bound the most
    actual[2, 4] = expected[2, 4] - 0.004
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected, policy=policy)
    text = str(failure.value)
    a, e = float(actual[3, 2]), float(expected[3, 2])
    error, bound = abs(a - e), 1e-3 + 1e-3 * abs(e)
    assert "mismatched elements: 2 / 35" in text
    assert (
        f"worst violation at index (3, 2): actual {a:.8g}, expected {e:.8g}, |actual - expected| {error:.6g} > "
        f"bound {bound:.6g} (atol + rtol * |expected|) by {error - bound:.3g} ({error / bound:.3g}x the bound)"
    ) in text
    # The largest errors are still reported, marked as within their bounds.
    assert "max abs error: 0.9 at index (0, 6) (actual 1000.9, expected 1000), within its bound" in text
    assert re.search(r"max rel error: 499 at index \(1, 0\) \(actual 0.0005, expected 1e-06\), within its bound", text)
    first = text.split("first 2 of 2 mismatched elements:\n")[1].splitlines()
    assert first[0].startswith(f"    (2, 4): actual {float(actual[2, 4]):.8g}, expected {float(expected[2, 4]):.8g}")
    assert first[1].startswith(f"    (3, 2): actual {a:.8g}, expected {e:.8g}")


def test_failure_message_lists_the_first_five_mismatches_in_index_order():
    policy = _policy_1e3()
    expected = torch.randn(9, 11, dtype=torch.float64)
    actual = expected.clone()
    flat = torch.randperm(99)[:8].sort().values
    for rank, position in enumerate(flat.tolist()):
        actual.view(-1)[position] += 0.1 * (rank + 1)
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected, policy=policy)
    text = str(failure.value)
    listed = re.findall(r"^    \((\d+), (\d+)\): actual", text.split("first 5 of 8 mismatched elements:\n")[1], re.M)
    assert [int(r) * 11 + int(c) for r, c in listed] == flat[:5].tolist()


def test_nan_and_unmatched_inf_are_the_worst_violations():
    expected = torch.randn(6, 5, dtype=torch.float64)
    actual = expected.clone()
    actual[1, 1] += 5.0
    actual[4, 3] = math.nan
    with pytest.raises(AssertionError, match=r"worst violation at index \(4, 3\): actual nan, expected .*: NaN never"):
        assert_close(actual, expected)
    actual[4, 3] = math.inf
    with pytest.raises(AssertionError, match=r"worst violation at index \(4, 3\): actual inf, .*same Inf"):
        assert_close(actual, expected)


def test_streamed_blocks_find_the_worst_violation_in_a_later_block(monkeypatch):
    import pytest_kernelcheck.check.tolerance as tolerance

    monkeypatch.setattr(tolerance, "_BLOCK_ELEMENTS", 64)
    expected = torch.randn(7, 9, 11, dtype=torch.float64)
    actual = expected.clone()
    actual[0, 0, 3] += 0.01
    actual[6, 2, 9] += 0.5
    with pytest.raises(AssertionError, match=r"(?s)worst violation at index \(6, 2, 9\).*first 2 of 2.*\(0, 0, 3\)"):
        assert_close(actual, expected, policy=_policy_1e3())


def test_baseline_failure_says_the_baseline_rule_decided_with_its_numbers():
    # Values below 0.5, where fp16 steps by at most 2**-12: the baseline's error is at most 2**-13, so the rule
    # allows at most 2 * 2**-13 + 2.5e-4 = 4.9e-4.
    expected = torch.rand(3, 37, dtype=torch.float64) * 0.5
    baseline = expected.to(torch.float16)
    actual = expected.to(torch.float16)
    # Element (0, 0) is 9.8e-4 off: inside fp16's per-element bound (1e-3 + 1e-3 * 0.25), over the baseline rule's.
    expected[0, 0] = baseline[0, 0] = 0.25
    actual[0, 0] = 0.25 + 4 * 2**-12
    baseline_error = (baseline.double() - expected).abs().max().item()
    kernel_error = (actual.double() - expected).abs().max().item()
    allowed = 2 * baseline_error + 2.5e-4
    assert kernel_error > allowed
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected, baseline=baseline)
    text = str(failure.value)
    assert "atol" not in text and "rtol" not in text
    assert text.startswith("Tensors are not close under the baseline rule of policy 'fp16': max|actual - expected| <= "
                           "2 * max|baseline - expected| + 0.00025")
    assert (
        f"the baseline rule decided: max|actual - expected| = {kernel_error:.6g} > allowed 2 * {baseline_error:.6g} "
        f"(max|baseline - expected|) + 0.00025 (floor) = {allowed:.6g}"
    ) in text
    assert "worst violation at index (0, 0)" in text and "the allowed error" in text
    assert f"error ratio actual/baseline = {kernel_error / baseline_error:.3g}" in text


# --------------------------------------------------------------------------------------------------------------
# Unhelpful messages and unusual arguments


def test_relative_error_against_an_exact_zero_prints_inf():
    expected = torch.randn(4, 3, dtype=torch.float64)
    expected[2, 1] = 0.0
    actual = expected.clone()
    actual[2, 1] = 0.5
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected)
    text = str(failure.value)
    assert "max rel error: inf at index (2, 1)" in text and "1.79769e+308" not in text


@pytest.mark.parametrize("label", ["actual", "expected", "baseline"])
def test_sparse_tensors_are_refused_by_name(label):
    dense = torch.randn(5, 3, dtype=torch.float64)
    args = dict(actual=dense.clone(), expected=dense.clone(), baseline=dense.clone())
    args[label] = args[label].to_sparse()
    with pytest.raises(TypeError, match=rf"{label} is a sparse tensor \(torch.sparse_coo\); assert_close accepts dense "
                                        rf"\(strided\) tensors: pass {label}.to_dense\(\)"):
        assert_close(args["actual"], args["expected"], baseline=args["baseline"])


def test_python_numbers_and_numpy_values_behave_like_numbers():
    np = pytest.importorskip("numpy")
    x = float(torch.rand(()))
    # A Python float is a double: exact comparison against a float64 tensor holding it passes (float32 would not).
    assert assert_close(torch.tensor(x, dtype=torch.float64), x, policy="exact").passed
    assert assert_close(x, torch.tensor(x, dtype=torch.float64)).policy.name == "fp64"
    with pytest.raises(AssertionError, match="NaN never passes"):
        assert_close(torch.tensor(1.0), math.nan)
    big = 2**62 + 1
    assert assert_close(torch.tensor(big), big).passed
    with pytest.raises(AssertionError, match=f"actual {big}, expected {big - 1}"):
        assert_close(torch.tensor(big), big - 1)
    assert assert_close(torch.tensor(True), True).passed

    ref = np.random.default_rng().standard_normal((3, 5))
    assert assert_close(torch.from_numpy(ref.copy()), ref).passed
    assert assert_close(ref.astype(np.float32), ref).policy.name == "fp32"  # the array's own dtype picks the policy
    assert assert_close(np.float16(0.5), 0.5).policy.name == "fp16"
    frozen = ref.copy()
    frozen.flags.writeable = False
    assert assert_close(torch.from_numpy(ref.copy()), frozen).passed
    wrong = ref.copy()
    wrong[2, 3] += 1.0
    with pytest.raises(AssertionError, match=r"worst violation at index \(2, 3\)"):
        assert_close(wrong, ref)


def test_values_that_are_not_numbers_are_refused_by_name():
    np = pytest.importorskip("numpy")
    a = torch.randn(3, dtype=torch.float64)
    accepted = "a dense torch.Tensor, a numpy array or scalar, or a Python bool, int or float"
    with pytest.raises(TypeError, match=f"assert_close: expected must be {accepted}; got list"):
        assert_close(a, [1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match=f"assert_close: actual must be {accepted}; got str"):
        assert_close("1", a)
    with pytest.raises(TypeError, match=r"baseline is a numpy array of dtype object, which torch cannot hold"):
        assert_close(a, a, baseline=np.array([1, "x", None], dtype=object))
    with pytest.raises(ValueError, match=f"expected is the Python int {2**70}, outside the int64 and uint64 ranges"):
        assert_close(torch.tensor(1), 2**70)
    with pytest.raises(TypeError, match="expected is complex"):
        assert_close(a, np.ones(3) * 1j)


@pytest.mark.parametrize("close", [True, False])
def test_outputs_that_require_grad_are_compared_quietly_and_left_as_they_were(close):
    # A kernel's output with requires_grad (a forward under autograd) is a value to check: no warning about
    # reading a tensor that requires grad, no autograd graph on the caller's tensors, nothing accumulated.
    torch.manual_seed(3)
    x = torch.randn(37, 129, dtype=torch.float32, requires_grad=True)
    actual = x * 1.0 + (0.0 if close else 0.5)  # a non-leaf output of an autograd graph
    expected = x.detach().double()
    baseline = x.detach().to(torch.bfloat16).float().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if close:
            assert assert_close(actual, expected, baseline=baseline).passed
        else:
            with pytest.raises(AssertionError, match="not close|worst violation"):
                assert_close(actual, expected, baseline=baseline)
    assert actual.requires_grad and x.grad is None and baseline.grad is None
