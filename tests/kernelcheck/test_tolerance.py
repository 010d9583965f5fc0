"""Tolerance policies, the baseline rule, assert_close's messages and errors, and the tolerance marker."""
import math
import re

import pytest
import torch

from pytest_kernelcheck import TolerancePolicy, assert_close, policy_for
from pytest_kernelcheck.tolerance import parse_tolerance_marker, use_override


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
    rounded = expected.to(dtype)
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
    assert "baseline rule: max|actual - expected| <= 2 * max|baseline - expected| + 0.00025" in text
    assert "at index (0, 1, 10, 3)" in text
    ratio = float(re.search(r"error ratio actual/baseline = ([0-9.e+-]+)", text).group(1))
    assert ratio > 2


def test_inputs_that_cannot_be_compared_are_named():
    a = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="expected must be a torch.Tensor; got list"):
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


def test_large_tensors_are_streamed_in_blocks(monkeypatch):
    import pytest_kernelcheck.tolerance as tolerance

    monkeypatch.setattr(tolerance, "_BLOCK_ELEMENTS", 100)
    expected = torch.randn(7, 9, 11, dtype=torch.float64)
    actual = expected.float()
    actual[6, 8, 10] += 1.0
    actual[3, 0, 0] = math.nan
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected)
    text = str(failure.value)
    assert "mismatched elements: 2 / 693" in text and "at index (6, 8, 10)" in text
    assert "first mismatched element at index (3, 0, 0)" in text and "NaN: 1 in actual" in text


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
    ],
)
def test_bad_tolerance_markers_are_named(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        parse_tolerance_marker(args, kwargs)


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
    result.assert_outcomes(passed=3, failed=2)
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
