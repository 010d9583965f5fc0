"""The memory marker, free-memory checks, and out-of-memory errors turned into skips (or failures)."""
import math
import re

import numpy as np
import pytest
import torch

from pytest_kernelcheck.check.memory import (
    evaluate_estimate,
    forget_frames,
    free_memory,
    human_bytes,
    is_out_of_memory,
    memory_shortfall,
    parse_memory_marker,
    resolve_device,
    validate_estimate,
)


def test_human_bytes_uses_binary_units():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(23.1 * 2**30) == "23.1 GiB"
    # materialized float32 scores of B=32, H=16, S=100,000
    assert human_bytes(32 * 16 * 100_000**2 * 4) == "18.6 TiB"  # the "about 20 TB" of the scores that cannot exist


def test_human_bytes_at_unit_boundaries_never_writes_an_exponent_inside_a_unit():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1024) == "1 KiB"
    assert human_bytes(1.5 * 2**30) == "1.5 GiB"
    assert human_bytes(1000 * 2**20) == "1000 MiB"  # .3g wrote "1e+03 MiB"
    assert human_bytes(1023 * 2**30) == "1023 GiB"  # and "1.02e+03 GiB"
    assert human_bytes(1023.7 * 2**10) == "1 MiB"  # would round to "1024 KiB": the next unit reads better
    assert human_bytes(2**70) == "1 ZiB"
    assert human_bytes(2**80) == "1 YiB"
    assert human_bytes(3 * 2**79) == "1.5 YiB"
    # Past the largest binary unit, bytes in powers of ten.
    assert human_bytes(2**100) == "1.27e+30 B"
    assert human_bytes(np.int64(5 * 2**40 + 7)) == "5 TiB"


def test_numpy_numbers_and_0d_tensors_are_estimates():
    assert validate_estimate(np.int64(3 * 2**30 + 7)) == 3 * 2**30 + 7
    assert validate_estimate(np.float32(2500.5)) == 2500
    assert validate_estimate(np.array(513)) == 513
    assert validate_estimate(torch.tensor(2**40 + 3)) == 2**40 + 3
    assert type(validate_estimate(torch.tensor(1031.0))) is int
    assert evaluate_estimate(lambda s: np.prod([s["B"], s["S"]]) * 4, {"B": 3, "S": 1021}) == 3 * 1021 * 4
    assert parse_memory_marker((np.uint32(77),), {}, has_shape=False).estimate == 77
    accepted = r"give an int or float \(numpy numbers and 0-d integer or float torch tensors also work\)"
    for bad, kind in [
        (np.bool_(True), "bool"),
        (torch.tensor(True), "Tensor"),
        (torch.tensor([1, 2]), "Tensor"),
        (np.array([5]), "ndarray"),
        (2j, "complex"),
    ]:
        with pytest.raises(TypeError, match=rf"must be a number of bytes; got .* \({kind}\); {accepted}"):
            validate_estimate(bad)
    with pytest.raises(ValueError, match="finite number of bytes >= 0; got -3"):
        validate_estimate(np.int16(-3))


def test_device_errors_name_where_the_device_came_from():
    with pytest.raises(ValueError, match=r"memory marker: device= is 'tpu'; memory checks know the devices 'cpu' and"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match=r"memory marker: the shape's `device` is 'mps'; memory checks know"):
        resolve_device(None, {"device": "mps"})
    with pytest.raises(ValueError, match=r"memory marker: the test's `device` parameter is 'xla'; memory checks"):
        resolve_device(None, None, {"device": "xla"})


@pytest.mark.parametrize("device", ["cudafoo", "cuda:-1", "cuda:abc", "cuda:", "cuda:1.5", "cuda:²", "CUDA", -1,
                                    True, 1.0])
def test_a_device_that_only_starts_like_cuda_is_refused(device):
    # These passed a startswith("cuda") check and reached torch.cuda.mem_get_info, or named no device at all.
    with pytest.raises(ValueError, match=rf"memory marker: device= is {re.escape(repr(device))}; memory checks know "
                                         r"the devices 'cpu' and 'cuda' or 'cuda:N' with N an integer >= 0"):
        parse_memory_marker((1024,), {"device": device}, has_shape=False)
    with pytest.raises(ValueError, match=rf"the shape's `device` is {re.escape(repr(device))}"):
        resolve_device(None, {"device": device})


def test_cuda_devices_by_name_torch_device_or_index():
    index = int(np.random.default_rng().integers(0, 16))
    assert resolve_device("cuda") == "cuda"
    assert resolve_device(f"cuda:{index}") == f"cuda:{index}"
    assert resolve_device(torch.device("cuda", index)) == f"cuda:{index}"
    assert resolve_device(torch.device("cuda")) == "cuda"
    assert resolve_device(index) == f"cuda:{index}"  # an int is a CUDA index, as torch.device(index) reads it
    assert resolve_device(None, None, {"device": np.int64(index)}) == f"cuda:{index}"
    assert parse_memory_marker((10,), {"device": index}, has_shape=False).device == index


def test_numpy_estimates_in_a_test_file(pytester):
    pytester.makepyfile(
        """
        import numpy as np, pytest

        @pytest.mark.memory(np.int64(2**61 + 3), device="cpu")
        def test_huge():
            raise AssertionError("must not run")

        @pytest.mark.memory(np.int64(1031), device="cpu")
        def test_small():
            pass

        @pytest.mark.shape(dict(B=3, S=1021))
        @pytest.mark.memory(lambda s: np.prod([s.B, s.S], dtype=np.int64) * 4, device="cpu")
        def test_by_shape(shape):
            pass
        """
    )
    result = pytester.runpytest("-ra")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *.py:3: needs 2 EiB, * free on cpu"])


def test_estimates_must_be_finite_non_negative_numbers():
    assert validate_estimate(3.9) == 3
    assert evaluate_estimate(lambda shape: shape["n"] * 4, {"n": 10}) == 40
    for bad, error, message in [
        (-1, ValueError, "finite number of bytes >= 0; got -1"),
        (math.nan, ValueError, "got nan"),
        ("1GB", TypeError, "must be a number of bytes; got '1GB' \\(str\\)"),
        (True, TypeError, "got True"),
    ]:
        with pytest.raises(error, match=message):
            validate_estimate(bad)
    with pytest.raises(ValueError, match=r"memory estimate .*<lambda>\(shape\) must be a finite number"):
        evaluate_estimate(lambda shape: -5, {})


def test_marker_arguments_are_checked():
    assert parse_memory_marker((10,), {"device": "cpu"}, has_shape=False).device == "cpu"
    with pytest.raises(TypeError, match="receives the shape, but the test has no @pytest.mark.shape"):
        parse_memory_marker((lambda s: 1,), {}, has_shape=False)
    with pytest.raises(TypeError, match="takes one estimate"):
        parse_memory_marker((), {}, has_shape=False)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['bytes'\]"):
        parse_memory_marker((1,), {"bytes": 1}, has_shape=False)
    with pytest.raises(ValueError, match="devices 'cpu' and 'cuda"):
        parse_memory_marker((1,), {"device": "tpu"}, has_shape=False)


def test_device_rule():
    default = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None) == default
    assert resolve_device("cpu", {"device": "cuda"}) == "cpu"
    assert resolve_device(None, {"device": "cuda:1"}) == "cuda:1"
    assert resolve_device(None, None, {"device": torch.device("cpu")}) == "cpu"


def test_free_host_memory_and_shortfall_message():
    free = free_memory("cpu")
    assert free is not None and free > 0
    assert memory_shortfall(1024, "cpu") is None
    reason = memory_shortfall(2**60, "cpu")
    assert reason.startswith("needs 1 EiB, ") and reason.endswith(" free on cpu")


def test_out_of_memory_recognition():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"))
    # What torch 2.x raises when host memory runs out (torch.empty(2**50, dtype=torch.uint8)): no "out of memory".
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
        )
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_forget_frames_releases_tensors_held_by_a_traceback():
    import weakref

    class Holder:
        pass

    def fail():
        held = Holder()
        ref.append(weakref.ref(held))
        raise MemoryError("out of memory")

    ref = []
    try:
        fail()
    except MemoryError as exc:
        caught = exc
    assert ref[0]() is not None  # the traceback keeps the frame's locals alive
    forget_frames(caught)
    assert ref[0]() is None


def test_forget_frames_works_after_pytest_has_read_the_frames_locals():
    # pytest reads f_locals (for __tracebackhide__) while building a report; on Python 3.11/3.12 that snapshot
    # outlived frame.clear() and kept the tensors alive.
    import weakref

    class Holder:
        pass

    def fail():
        held = Holder()
        refs.append(weakref.ref(held))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    refs = []
    try:
        fail()
    except torch.OutOfMemoryError as exc:
        caught = exc
    tb = caught.__traceback__
    while tb is not None:
        tb.tb_frame.f_locals
        tb = tb.tb_next
    forget_frames(caught)
    assert refs[0]() is None


def test_memory_marker_skips_with_readable_numbers_and_runs_small_cases(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.memory(2**60, device="cpu")
        def test_huge():
            raise AssertionError("must not run")

        @pytest.mark.memory(1024)
        def test_small():
            pass

        @pytest.mark.shape(dict(B=32, S=100_000, H=16), dict(B=1, S=64, H=1))
        @pytest.mark.memory(lambda s: s.B * s.H * s.S**2 * 4, device="cpu")
        def test_by_shape(shape):
            assert shape.S == 64

        @pytest.mark.shape(dict(n=1))
        @pytest.mark.memory(lambda s: "lots")
        def test_bad_callable(shape):
            pass
        """
    )
    result = pytester.runpytest("-ra")
    result.assert_outcomes(passed=2, skipped=2, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] test_memory_marker_skips*.py:3: needs 1 EiB, * free on cpu",
            "SKIPPED [[]1[]] test_memory_marker_skips*.py:11: needs 18.6 TiB, *iB free on cpu",
            "*memory estimate *<lambda>(shape) must be a number of bytes; got 'lots' (str)*",
        ]
    )


def test_bad_memory_marker_is_a_collection_error(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.memory(-3)
        def test_negative():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*::test_negative: memory estimate must be a finite number of bytes >= 0; got -3"])


def test_stacked_memory_markers_each_count(pytester):
    # Only the closest marker was read: a module's estimate more than any host holds was dropped under a test's
    # own small one, and of two markers on one function the other was never even checked.
    rng = np.random.default_rng()
    huge, huger = (int(k) * 2**60 for k in rng.integers(2, 1000, size=2))
    small = int(rng.integers(1, 4096))
    pytester.makepyfile(
        test_module_marker=f"""
        import pytest

        pytestmark = pytest.mark.memory({huge}, device="cpu")

        @pytest.mark.memory({small}, device="cpu")
        def test_small_own_marker():
            raise AssertionError("must not run")
        """,
        test_function_markers=f"""
        import pytest

        @pytest.mark.memory({huger}, device="cpu")
        @pytest.mark.memory({small}, device="cpu")
        def test_two_markers_one_too_big():
            raise AssertionError("must not run")

        class TestFits:
            pytestmark = pytest.mark.memory({small})

            @pytest.mark.memory({small}, device="cpu")
            def test_every_marker_fits(self):
                pass
        """,
        test_bad_stacked=f"""
        import pytest

        @pytest.mark.memory(-{small})
        @pytest.mark.memory({small})
        def test_bad_marker_under_a_good_one():
            pass
        """,
    )
    result = pytester.runpytest("-ra", "--continue-on-collection-errors")
    result.assert_outcomes(passed=1, skipped=2, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            f"SKIPPED [[]1[]] test_module_marker.py:5: needs {human_bytes(huge)}, * free on cpu",
            f"SKIPPED [[]1[]] test_function_markers.py:3: needs {human_bytes(huger)}, * free on cpu",
            f"*::test_bad_marker_under_a_good_one: memory estimate must be a finite number of bytes >= 0; "
            f"got -{small}",
        ]
    )


OOM_TESTS = """
import gc, weakref
import pytest, torch

refs = []

class Block:
    pass

def test_runs_out():
    block = Block()
    refs.append(weakref.ref(block))
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

def test_runtime_error_form():
    raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 bytes; out of memory")

def test_memory_was_released():
    assert refs and refs[0]() is None

def test_other_errors_still_fail():
    raise RuntimeError("index out of range")
"""


def test_out_of_memory_becomes_a_skip_and_memory_is_released(pytester):
    pytester.makepyfile(OOM_TESTS)
    result = pytester.runpytest("-ra", "-p", "no:randomly")
    result.assert_outcomes(skipped=2, passed=1, failed=1)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] test_out_of_memory_becomes*.py:9: out of memory: CUDA out of memory. Tried to allocate 20.00 GiB",
            "SKIPPED [[]1[]] *: out of memory: DefaultCPUAllocator*",
            "FAILED *test_other_errors_still_fail*",
        ]
    )


def test_out_of_memory_fails_with_kernel_oom_fail(pytester):
    pytester.makepyfile(OOM_TESTS)
    result = pytester.runpytest("--kernel-oom=fail", "-p", "no:randomly")
    result.assert_outcomes(failed=3, passed=1)
    result.stdout.fnmatch_lines(["*OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"])


def test_kernel_oom_ini_setting(pytester):
    pytester.makeini("[pytest]\nkernel_oom = fail\n")
    pytester.makepyfile(OOM_TESTS)
    pytester.runpytest("-p", "no:randomly").assert_outcomes(failed=3, passed=1)
    pytester.makeini("[pytest]\nkernel_oom = sometimes\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*kernel_oom must be one of skip, fail; got 'sometimes'*"])


def test_skipif_reason_comes_before_the_memory_check(pytester):
    # A test skipped for a more basic reason says that reason, not that its memory does not fit.
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.skipif(True, reason="needs a CUDA GPU")
        @pytest.mark.memory(10**18)
        def test_huge():
            pass

        @pytest.mark.memory(10**18)
        def test_huge_without_skipif():
            pass
        """
    )
    result = pytester.runpytest("-rs", "-v")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*needs a CUDA GPU*"])
    assert result.stdout.str().count("PiB") == 1


def test_xfail_expecting_out_of_memory_stays_xfailed(pytester):
    # pytest's own expectation wins: an OOM the test is marked to raise is an xfail, not an OOM skip.
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.xfail(raises=torch.OutOfMemoryError, strict=True, reason="17 GiB buffer on a small card")
        def test_expected_oom():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 17.00 GiB")

        @pytest.mark.xfail(reason="any failure")
        def test_plain_xfail_oom():
            raise MemoryError("out of memory")

        @pytest.mark.xfail(raises=ValueError, reason="expects a ValueError")
        def test_unexpected_oom():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        """
    )
    result = pytester.runpytest("-ra")
    # The OOM that the xfail did not expect is still the environment's fault: an OOM skip.
    result.assert_outcomes(xfailed=2, skipped=1)
    result.stdout.fnmatch_lines_random(
        [
            "XFAIL *::test_expected_oom - 17 GiB buffer on a small card",
            "XFAIL *::test_plain_xfail_oom - any failure",
            "SKIPPED [[]1[]] *: out of memory: CUDA out of memory. Tried to allocate 3.00 GiB",
        ]
    )


def test_out_of_memory_caught_by_pytest_raises_is_the_tests_business(pytester):
    pytester.makepyfile(
        """
        import pytest, torch

        def test_checks_its_own_oom():
            with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 5.00 GiB"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.00 GiB")

        def test_expects_oom_but_none_comes():
            with pytest.raises(torch.OutOfMemoryError):
                pass
        """
    )
    result = pytester.runpytest("-ra")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*Failed: DID NOT RAISE*OutOfMemoryError*", "FAILED *::test_expects_oom_but_none_comes*"]
    )


FIXTURE_OOM_TESTS = """
import pytest, torch

@pytest.fixture
def buffers():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")

@pytest.fixture(scope="module")
def weights():
    raise MemoryError("out of memory: 11 GiB of weights")

def test_function_fixture(buffers):
    raise AssertionError("must not run")

def test_module_fixture_first(weights):
    raise AssertionError("must not run")

def test_module_fixture_again(weights):
    raise AssertionError("must not run")
"""


def test_out_of_memory_in_a_fixture_is_handled_like_one_in_the_test(pytester):
    pytester.makepyfile(FIXTURE_OOM_TESTS)
    result = pytester.runpytest("-ra", "-p", "no:randomly")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] *.py:11: out of memory: CUDA out of memory. Tried to allocate 7.00 GiB",
            "SKIPPED [[]1[]] *.py:14: out of memory: out of memory: 11 GiB of weights",
            "SKIPPED [[]1[]] *.py:17: out of memory: out of memory: 11 GiB of weights",
        ]
    )
    result = pytester.runpytest("--kernel-oom=fail", "-p", "no:randomly")
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(["*OutOfMemoryError: CUDA out of memory. Tried to allocate 7.00 GiB"])


def test_memory_shortfall_skips_before_any_fixture_runs(pytester):
    # Fixtures may allocate what the estimate says does not fit; the skip must come first.
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture(scope="module")
        def module_buffers():
            raise AssertionError("module fixture ran")

        @pytest.fixture
        def buffers():
            raise AssertionError("function fixture ran")

        @pytest.mark.memory(3 * 2**70, device="cpu")
        def test_too_big(module_buffers, buffers):
            raise AssertionError("must not run")

        @pytest.mark.shape(dict(S=10**9 + 7))
        @pytest.mark.intractable(lambda s: s.S > 10**6, reason="too long")
        def test_intractable(shape, buffers):
            raise AssertionError("must not run")
        """
    )
    result = pytester.runpytest("-ra")
    result.assert_outcomes(skipped=2)
    assert "fixture ran" not in result.stdout.str()
