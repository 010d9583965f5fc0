"""Options, markers, help text, strict markers and the package surface of the plugin."""
import os
import subprocess
import sys

import pytest

import pytest_kernelcheck

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_help_shows_the_kernelcheck_group_and_oom_option(pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "*kernelcheck*:",
            "*--kernel-oom={skip,fail}*",
            "*what an out-of-memory error raised by a test becomes*",
        ]
    )
    result.stdout.fnmatch_lines(["*kernel_oom (string):*out-of-memory errors in tests*"])


def test_markers_are_registered_with_help(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines_random(
        [
            "@pytest.mark.shape(*cases, **axes): parametrize over named sizes.*",
            "@pytest.mark.tolerance(policy=None, **fields): override the tolerance*",
            "@pytest.mark.memory(estimate, device=None): bytes the test needs*",
            "@pytest.mark.intractable(when, reason=None): do not run this case.*",
        ]
    )


def test_strict_markers_accepts_our_markers(pytester):
    pytester.makepyfile(
        """
        import pytest, torch
        from pytest_kernelcheck import assert_close

        @pytest.mark.shape(dict(n=4), dtype=[torch.float32])
        @pytest.mark.tolerance(atol=1e-3)
        @pytest.mark.memory(lambda s: s.n * 4)
        @pytest.mark.intractable(lambda s: s.n > 10**9)
        def test_everything(shape):
            x = torch.randn(shape.n, dtype=torch.float64)
            assert_close(x.to(shape.dtype), x)
        """
    )
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1)


def test_package_exports_and_lazy_torch_import():
    for name in pytest_kernelcheck.__all__:
        assert getattr(pytest_kernelcheck, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        pytest_kernelcheck.nothing
    # Loading the plugin module (what `pytest --help` does) must not import torch.
    code = (
        "import sys, pytest_kernelcheck, pytest_kernelcheck.plugin, pytest_kernelcheck.check.shapes, "
        "pytest_kernelcheck.check.memory; assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert 'flashlite' not in sys.modules"
    )
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    completed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr


def test_package_never_imports_flashlite():
    package = os.path.join(REPO_ROOT, "pytest_kernelcheck")
    for name in os.listdir(package):
        if name.endswith(".py"):
            with open(os.path.join(package, name), encoding="utf-8") as source:
                text = source.read()
            assert "import flashlite" not in text and "from flashlite" not in text, name


@pytest.mark.parametrize(("count", "skipped_reason"), [
    (0, "*device 'cuda': CUDA is not available on this machine*"),
    (1, "*device 'cuda:1': this machine has 1 CUDA device (cuda:0)*"),
])
def test_shape_cases_on_a_missing_cuda_device_skip_naming_it(pytester, count, skipped_reason):
    # torch's CUDA queries are faked in the run's conftest, so the outcome is the same on a GPU machine.
    pytester.makeconftest(
        f"""
import torch

def pytest_configure(config):
    config._kc_saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available = lambda: {count} > 0
    torch.cuda.device_count = lambda: {count}

def pytest_unconfigure(config):
    torch.cuda.is_available, torch.cuda.device_count = config._kc_saved
"""
    )
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.shape(dict(n=4), device=["cpu", "cuda" if torch.cuda.device_count() == 0 else "cuda:1"])
def test_zeros(shape):
    assert torch.zeros(shape.n, device="cpu").sum() == 0
    if shape.device != "cpu":
        raise AssertionError("a case for a missing device ran")
"""
    )
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([skipped_reason])
