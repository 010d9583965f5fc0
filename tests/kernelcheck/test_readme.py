"""The README's plugin example works as written: its first test, run with its own command, shows what ``describe()``
prints; its hints name commands that work (``--strict-markers`` catches a misspelled marker, while every marker of the
plugin is registered; the plot extra exists). The gate flow, run many times, is ``tools/readme_flow_check.sh``."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIRST_TEST = README.split("## A first test", 1)[1]


def _first_test_file() -> str:
    return re.search(r"```python\n(.*?)```", FIRST_TEST, re.S).group(1)


def _first_command() -> list[str]:
    """The arguments of the README's first command (``.venv/bin/python -m pytest test_first.py ...``)."""
    command = re.search(r"run `(\.venv/bin/python -m pytest test_first\.py[^`]*)`", FIRST_TEST).group(1)
    return shlex.split(command)[3:]  # after "python -m pytest"


def test_the_readme_first_test_shows_describe_with_the_readme_command(pytester):
    pytester.makepyfile(test_first=_first_test_file())
    args = _first_command()
    assert args[0] == "test_first.py" and "--kernel-ab" in args and "--kernel-ab-cpu-threads" in args
    result = pytester.runpytest(*args[1:], "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    # describe()'s line, printed by the test, reaches the terminal with the README's own options.
    result.stdout.fnmatch_lines(["verdict *: paired speedup *x, *% CI [[]*[]], p=* (adjusted for * looks; raw *), *"])


def test_the_readme_gate_flow_pins_one_thread_and_gates_on_loss():
    block = next(b for b in re.findall(r"```bash\n(.*?)```", FIRST_TEST, re.S) if "--kernel-ab-save" in b)
    save, gate = [line for line in block.splitlines() if line.strip()]
    assert "--kernel-ab-cpu-threads 1" in save and "--kernel-ab-cpu-threads 1" in gate
    assert "--kernel-ab-compare-fail loss" in gate and gate.rstrip().endswith("--kernel-ab-compare")
    assert (ROOT / "tools" / "readme_flow_check.sh").stat().st_mode & 0o111  # executable, as the README runs it


PLUGIN_MARKERS = """
import pytest
import torch
from pytest_kernelcheck import assert_close

@pytest.mark.shape(dict(n=5))
@pytest.mark.tolerance(atol=1e-3, rtol=1e-3)
@pytest.mark.memory(1024)
@pytest.mark.intractable(False)
def test_every_marker(shape):
    x = torch.randn(shape.n, dtype=torch.float64)
    assert_close(x, x.clone())
"""


def test_every_plugin_marker_is_registered_so_strict_markers_accepts_them(pytester):
    pytester.makepyfile(test_markers=PLUGIN_MARKERS)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_strict_markers_turns_a_misspelled_marker_into_an_error(pytester):
    pytester.makepyfile(test_typo=PLUGIN_MARKERS.replace("mark.tolerance(", "mark.tolerence("))
    lenient = pytester.runpytest("-p", "no:cacheprovider")
    lenient.assert_outcomes(passed=1)  # what the README warns of: the marker is ignored
    strict = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    strict.stdout.fnmatch_lines(["*'tolerence' not found in `markers` configuration option*"])
    assert strict.ret != 0
    assert "--strict-markers" in README


def test_the_plot_hint_names_an_installable_package_and_an_extra_that_exists():
    from pytest_kernelcheck.results.plots import PLOT_MISSING_NOTE

    if sys.version_info >= (3, 11):
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert any(requirement.startswith("matplotlib") for requirement in extras["plot"])
    assert 'pip install -e ".[plot]"' in PLOT_MISSING_NOTE and "pip install matplotlib" in PLOT_MISSING_NOTE
    assert "pytest-kernelcheck[plot]" not in PLOT_MISSING_NOTE + README


@pytest.mark.parametrize("doc", ["README.md", "docs/kernelcheck.md"])
def test_the_docs_name_no_extra_of_a_package_that_is_not_on_the_index(doc):
    assert "pip install pytest-kernelcheck" not in (ROOT / doc).read_text()


def test_every_marker_the_plugin_reads_is_registered(pytester):
    # Read from the source, so a marker added later (a measurement mode, say) is checked without a change here.
    import pytest_kernelcheck

    package = Path(pytest_kernelcheck.__file__).parent
    read = {name for path in package.rglob("*.py")
            for name in re.findall(r"(?:iter_markers|get_closest_marker)\(\s*(?:name=)?[\"'](\w+)[\"']",
                                   path.read_text())}
    assert {"shape", "tolerance", "memory", "intractable"} <= read
    registered = pytester.runpytest("--markers", "-p", "no:cacheprovider").stdout.str()
    missing = sorted(name for name in read if f"@pytest.mark.{name}" not in registered)
    assert not missing, f"markers read but not registered (--strict-markers would refuse them): {missing}"
