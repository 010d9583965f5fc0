"""--kernel-device-memory: sizes, the fraction each CUDA device gets, the memory marker against the cap, the header,
and out-of-memory skips that name the cap."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from pytest_kernelcheck.check import memory
from pytest_kernelcheck.check.device_memory import DeviceFraction, apply_cap, header_line, parse_size
from pytest_kernelcheck.check.memory import memory_shortfall, oom_skip_reason

pytest_plugins = ["pytester"]

GiB = 2**30


@pytest.mark.parametrize("text, size", [
    ("4GiB", 4 * GiB), ("512MiB", 512 * 2**20), ("4GB", 4 * 10**9), ("4294967296", 2**32), ("1.5 GiB", 3 * GiB // 2),
    ("64kib", 64 * 1024), ("2TB", 2 * 10**12), (" 7 B ", 7), (".5GiB", GiB // 2),
])
def test_sizes_in_binary_and_decimal_units_and_plain_bytes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "4 gigs", "-1GiB", "4GiB8", "0", "0.1", "4e9", "4 G"])
def test_a_bad_size_names_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"not a size.*plain bytes \(4294967296\).*4GiB.*4GB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1.5", "1.9", "0.5", "0.1KiB", "1.0000001KB"])
def test_a_fraction_of_a_byte_is_refused_not_truncated(text):
    # int() truncation made "1.5" a cap of 1 byte, under which every test skips for want of memory.
    with pytest.raises(ValueError, match=rf"not a size in whole bytes: '{re.escape(text)}' does not come to a whole "
                                         r"number of bytes; give plain bytes \(4294967296\)"):
        parse_size(text)


def test_fractions_that_come_to_whole_bytes_are_exact():
    assert parse_size("1.0") == 1
    assert parse_size("0.25KiB") == 256
    assert parse_size("1.001KB") == 1001  # float arithmetic gives 1000.9999999999999
    assert parse_size("2.75TiB") == 11 * 2**38


def test_each_visible_device_gets_the_fraction_of_its_own_total(monkeypatch):
    totals = {0: 140 * GiB, 1: 80 * GiB, 2: 2 * GiB}  # the last is smaller than the cap: it keeps all of itself
    applied: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(totals))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=totals[index]))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: applied.append((fraction, device)))
    fractions = apply_cap(4 * GiB)
    assert applied == [(4 / 140, 0), (4 / 80, 1), (1.0, 2)]
    assert fractions == [DeviceFraction(0, 140 * GiB, 4 / 140), DeviceFraction(1, 80 * GiB, 0.05),
                         DeviceFraction(2, 2 * GiB, 1.0)]
    assert header_line(4 * GiB, fractions) == (
        "kernelcheck: device memory capped at 4 GiB per CUDA device "
        "(cuda:0 0.0286 of 140 GiB, cuda:1 0.05 of 80 GiB, cuda:2 1 of 2 GiB)"
    )


def test_without_cuda_nothing_is_set(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a: pytest.fail("set without CUDA"))
    assert apply_cap(GiB) == []


def test_the_marker_compares_with_the_smaller_of_the_cap_and_free_memory(monkeypatch):
    free = {"cuda:0": 100 * GiB, "cpu": 100 * GiB}
    monkeypatch.setattr(memory, "free_memory", lambda device: free[device])
    monkeypatch.setattr(memory, "_cuda_available", lambda: True)
    assert memory_shortfall(5 * GiB, "cuda:0", cap=4 * GiB) == (
        "needs 5 GiB, more than the device memory cap of 4 GiB (--kernel-device-memory) on cuda:0"
    )
    assert memory_shortfall(3 * GiB, "cuda:0", cap=4 * GiB) is None
    assert memory_shortfall(5 * GiB, "cuda:0") is None  # no cap: free memory alone
    assert memory_shortfall(5 * GiB, "cpu", cap=4 * GiB) is None  # host memory on a CUDA machine is not capped
    free["cuda:0"] = 2 * GiB  # less free than the cap: free memory decides, and the reason says the cap is not it
    assert memory_shortfall(3 * GiB, "cuda:0", cap=4 * GiB) == (
        "needs 3 GiB, 2 GiB free on cuda:0 (under the device memory cap of 4 GiB)"
    )
    monkeypatch.setattr(memory, "_cuda_available", lambda: False)  # no CUDA: host estimates meet the cap
    assert "device memory cap of 4 GiB" in memory_shortfall(5 * GiB, "cpu", cap=4 * GiB)


def test_an_out_of_memory_skip_names_the_cap():
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB\nmore")
    assert oom_skip_reason(error, cap=4 * GiB) == (
        "out of memory: CUDA out of memory. Tried to allocate 6.00 GiB "
        "(device memory capped at 4 GiB by --kernel-device-memory)"
    )
    assert oom_skip_reason(error) == "out of memory: CUDA out of memory. Tried to allocate 6.00 GiB"


CAPPED_TESTS = """
import pytest

@pytest.mark.memory(5 * 2**30)
def test_too_big_for_the_cap():
    pass

@pytest.mark.memory(2**20)
def test_fits():
    pass

def test_runs_out():
    raise MemoryError("out of memory")
"""


@pytest.fixture
def recorded_cap(monkeypatch):
    """The plugin's apply_cap replaced: an in-process pytester run must not cap this process's real GPU."""
    caps: list[int] = []

    def fake(cap):
        caps.append(cap)
        return [DeviceFraction(0, 140 * GiB, cap / (140 * GiB))]

    monkeypatch.setattr("pytest_kernelcheck.plugin.apply_cap", fake)
    return caps


def test_the_header_states_the_cap_and_tests_past_it_skip_naming_it(pytester, recorded_cap):
    pytester.makepyfile(CAPPED_TESTS)
    result = pytester.runpytest("--kernel-device-memory", "4GiB", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=2)
    assert recorded_cap == [4 * GiB]
    result.stdout.fnmatch_lines([
        "kernelcheck: device memory capped at 4 GiB per CUDA device (cuda:0 0.0286 of 140 GiB)",
        "*.py:3: needs 5 GiB, more than the device memory cap of 4 GiB (--kernel-device-memory)*",
        "*out of memory: out of memory (device memory capped at 4 GiB by --kernel-device-memory)",
    ])


def test_the_ini_key_sets_the_cap_and_without_one_nothing_is_said(pytester, recorded_cap):
    pytester.makepyfile(CAPPED_TESTS)
    pytester.makeini("[pytest]\nkernel_device_memory = 512MiB\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "fits")
    result.stdout.fnmatch_lines(["kernelcheck: device memory capped at 512 MiB per CUDA device*"])
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "fits")
    assert "device memory capped" not in result.stdout.str()
    assert recorded_cap == [512 * 2**20]


@pytest.mark.parametrize("size, words", [
    ("4 gigs", "not a size: '4 gigs'; give plain bytes (4294967296) or a number and a unit"),
    ("1.5", "not a size in whole bytes: '1.5' does not come to a whole number of bytes"),  # was a 1-byte cap
])
def test_a_bad_size_is_a_usage_error_naming_the_option(pytester, recorded_cap, size, words):
    pytester.makepyfile(CAPPED_TESTS)
    result = pytester.runpytest("--kernel-device-memory", size, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--kernel-device-memory / kernel_device_memory: {words}*"])
    assert recorded_cap == []

