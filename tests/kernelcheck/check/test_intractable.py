"""The intractable marker: cases not run, skipped with their reason and listed in the terminal summary."""
import os

import numpy as np
import pytest
import torch

from pytest_kernelcheck import Shape, human_bytes
from pytest_kernelcheck.check.intractable import (
    intractable_reason,
    parse_intractable_marker,
)

INTRACTABLE_TESTS = """
import pytest
from pytest_kernelcheck import human_bytes

def scores_bytes(s):
    return s.B * s.H * s.S**2 * 4

@pytest.mark.shape(dict(B=32, S=100_000, H=16, D=64), dict(B=2, S=128, H=2, D=64))
@pytest.mark.intractable(lambda s: f"materialized scores need {human_bytes(scores_bytes(s))}"
                         if scores_bytes(s) > 2**40 else None)
def test_reference(shape):
    assert shape.S == 128

@pytest.mark.intractable(True, reason="needs a cluster")
def test_flagged():
    raise AssertionError("must not run")

@pytest.mark.shape(dict(S=8), dict(S=9))
@pytest.mark.intractable(lambda s: s.S % 2 == 1, reason="odd lengths unsupported")
def test_odd(shape):
    assert shape.S == 8

@pytest.mark.intractable(False)
def test_tractable():
    pass
"""


def test_reason_from_bool_callable_and_string():
    shape = Shape({"S": 100_000})
    assert intractable_reason(True, None, shape) == "marked intractable"
    assert intractable_reason(True, "too big", shape) == "too big"
    assert intractable_reason(False, "too big", shape) is None
    assert intractable_reason(lambda s: s.S > 10, "long", shape) == "long"
    assert intractable_reason(lambda s: f"needs {human_bytes(s.S**2 * 8)}", None, shape) == "needs 74.5 GiB"
    assert intractable_reason(lambda s: None, None, shape) is None
    with pytest.raises(TypeError, match=r"`when` returned 3 \(int\); return a reason string, a bool"):
        intractable_reason(lambda s: 3, None, shape)


def test_numpy_and_torch_bools_are_verdicts():
    shape = Shape({"S": 100_003})
    assert intractable_reason(lambda s: np.int64(s.S) % 2 == 1, "odd length", shape) == "odd length"
    assert intractable_reason(lambda s: np.int64(s.S) > 10**6, "too long", shape) is None
    assert intractable_reason(lambda s: torch.tensor(s.S) > 10**5, "too long", shape) == "too long"
    assert intractable_reason(np.bool_(True), None, shape) == "marked intractable"
    when, reason = parse_intractable_marker((np.bool_(True),), {"reason": "needs 3 GPUs"}, has_shape=False)
    assert (type(when), when, reason) == (bool, True, "needs 3 GPUs")
    accepted = r"return a reason string, a bool \(numpy bools and 0-d bool tensors too\) or None"
    for bad, shown in [
        (np.int64(1), r"(np\.int64\(1\)|1) \(int64\)"),  # numpy 2 writes np.int64(1)
        (torch.tensor([True, False]), r"tensor\(\[ True, False\]\) \(Tensor\)"),
    ]:
        with pytest.raises(TypeError, match=rf"intractable marker: `when` returned {shown}; {accepted}"):
            intractable_reason(lambda s, bad=bad: bad, None, shape)


def test_numpy_verdicts_in_a_test_file(pytester):
    pytester.makepyfile(
        """
        import numpy as np, pytest

        @pytest.mark.shape(dict(S=100_003), dict(S=129))
        @pytest.mark.intractable(lambda s: np.int64(s.S) > 10**5, reason="longer than 100k")
        def test_long(shape):
            assert shape.S == 129

        @pytest.mark.intractable(np.bool_(True), reason="flagged by numpy")
        def test_flagged():
            raise AssertionError("must not run")
        """
    )
    result = pytester.runpytest("-ra")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines_random(
        ["*::test_long[[]S100003[]]: longer than 100k", "*::test_flagged: flagged by numpy"]
    )


def test_marker_arguments_are_checked():
    assert parse_intractable_marker((), {"when": True, "reason": "r"}, has_shape=False) == (True, "r")
    with pytest.raises(
        TypeError, match=r"`when` must be a bool \(numpy bools too\) or a callable of the shape; got 'always' \(str\)"
    ):
        parse_intractable_marker(("always",), {}, has_shape=False)
    with pytest.raises(TypeError, match="receives the shape, but the test has no @pytest.mark.shape"):
        parse_intractable_marker((lambda s: True,), {}, has_shape=False)
    with pytest.raises(TypeError, match="takes \\(when, reason=None\\)"):
        parse_intractable_marker((), {}, has_shape=False)
    with pytest.raises(TypeError, match=r"intractable marker: `reason` must be a string or None; got 5 \(int\)"):
        parse_intractable_marker((True, 5), {}, has_shape=False)


def test_intractable_cases_are_skipped_and_listed(pytester):
    pytester.makepyfile(INTRACTABLE_TESTS)
    result = pytester.runpytest("-ra")
    result.assert_outcomes(passed=3, skipped=3)
    result.stdout.fnmatch_lines(
        [
            "*- kernelcheck: intractable cases -*",
            "*::test_reference[[]B32-S100000-H16-D64[]]: materialized scores need 18.6 TiB",
            "*::test_flagged: needs a cluster",
            "*::test_odd[[]S9[]]: odd lengths unsupported",
        ]
    )
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *.py:*: intractable: materialized scores need 18.6 TiB"])
    assert "test_tractable:" not in result.stdout.str()


def test_every_stacked_intractable_marker_is_checked(pytester):
    # Stacked markers (on the test, its class, its module) each name cases not to run, as stacked skipif markers
    # each name a reason to skip: the one closest to the test must not hide the others.
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.intractable(lambda s: s.H > 32 and "module: too many heads")

        @pytest.mark.intractable(lambda s: s.S > 100 and "class: S too long")
        class TestStacked:
            @pytest.mark.shape(S=[8, 1000], D=[16, 512], H=[4, 64])
            @pytest.mark.intractable(lambda s: s.D > 256 and "test: D too wide")
            def test_a(self, shape):
                assert (shape.S, shape.D, shape.H) == (8, 16, 4)

        @pytest.mark.shape(S=[8, 1000], D=[16, 512], H=[4])
        @pytest.mark.intractable(lambda s: s.D > 256 and "D too wide")
        @pytest.mark.intractable(lambda s: s.S > 100 and "S too long")
        def test_b(shape):
            assert (shape.S, shape.D) == (8, 16)
        """
    )
    result = pytester.runpytest("-ra")
    result.assert_outcomes(passed=2, skipped=10)
    # The closest marker that gives a reason names it: the test's own first, then the class's, then the module's.
    result.stdout.fnmatch_lines_random([
        "*::TestStacked::test_a[[]S1000-D16-H4[]]: class: S too long",
        "*::TestStacked::test_a[[]S8-D16-H64[]]: module: too many heads",
        "*::TestStacked::test_a[[]S1000-D512-H64[]]: test: D too wide",
        "*::test_b[[]S8-D512-H4[]]: D too wide",
        "*::test_b[[]S1000-D16-H4[]]: S too long",
    ])


def test_every_stacked_intractable_marker_is_checked_at_collection(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.intractable("always")  # the farther of the two: validated too
        @pytest.mark.intractable(False)
        def test_a():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*::test_a: intractable marker: `when` must be a bool*got 'always' (str)"])


def test_no_summary_section_without_intractable_cases(pytester):
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    assert "kernelcheck: intractable cases" not in result.stdout.str()


def test_bad_intractable_marker_is_a_collection_error(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.intractable("always")
        def test_a():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*::test_a: intractable marker: `when` must be a bool (numpy bools too) or a callable of the shape; "
            "got 'always' (str)"
        ]
    )


def test_summary_works_under_xdist(pytester, monkeypatch):
    # Worker processes import the plugin afresh; make sure they find this checkout.
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(INTRACTABLE_TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist")
    result.assert_outcomes(passed=3, skipped=3)
    result.stdout.fnmatch_lines_random(
        [
            "*::test_reference[[]B32-S100000-H16-D64[]]: materialized scores need 18.6 TiB",
            "*::test_flagged: needs a cluster",
            "*::test_odd[[]S9[]]: odd lengths unsupported",
        ]
    )
