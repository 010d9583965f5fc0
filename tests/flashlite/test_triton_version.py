"""The tested Triton range and the warning, once per process, under a Triton outside it."""
import subprocess
import sys
import warnings

import pytest

from flashlite import _triton_version
from flashlite._triton_version import UntestedTritonWarning, release, untested_message, warn_if_untested


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(_triton_version, "_warned", False)


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.9.0", "3.9.0+git4f3e2d1"])
def test_tested_releases_pass_silently(version, fresh):
    assert untested_message(version) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested(version)


@pytest.mark.parametrize("version", ["3.5.1", "3.10.0", "4.0.0", "2.3.0", "nightly", ""])
def test_an_untested_release_warns_naming_it_and_the_tested_range(version, fresh):
    with pytest.warns(UntestedTritonWarning) as caught:
        warn_if_untested(version)
    message = str(caught[0].message)
    assert f"not {version}:" in message and "Triton 3.6 to 3.9" in message and "'triton>=3.6,<3.10'" in message


def test_the_warning_comes_once_per_process(fresh):
    with pytest.warns(UntestedTritonWarning):
        warn_if_untested("3.10.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested("3.10.0")
        warn_if_untested("3.5.0")


def test_release_reads_major_and_minor():
    assert release("3.10.2") == (3, 10) and release(" 3.6.0rc1") == (3, 6) and release("x3.6") is None


def test_the_range_is_the_one_pyproject_pins():
    import pathlib
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (low, high) = _triton_version.TESTED_TRITON
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("triton")]
    assert pins and pins[0].split(";")[0].strip() == f"triton>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


_IMPORT_UNDER = r'''
import warnings, triton
triton.__version__ = "{version}"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import flashlite
    import flashlite.kernels.attention_fwd, flashlite.kernels.attention_bwd, flashlite.kernels.layer_norm
print(sum(w.category.__name__ == "UntestedTritonWarning" for w in caught))
'''


@pytest.mark.parametrize("version, warnings_seen", [("3.10.0", 1), ("3.9.0", 0)])
def test_importing_the_kernels_warns_once_under_an_untested_triton(version, warnings_seen):
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", _IMPORT_UNDER.format(version=version)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(warnings_seen)
