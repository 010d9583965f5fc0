"""Options that need another: every row of option_rules' table is run end to end, and the table covers every option
the plugin registers."""
from __future__ import annotations

import pytest

from pytest_kernelcheck import option_rules
from pytest_kernelcheck.results.report import build_report, write_json

pytest_plugins = ["pytester"]

# A value each option accepts, so that the only thing wrong with a run is the missing requirement.
VALUES = {
    "--kernel-ab-alpha": ["0.01"], "--kernel-ab-margin": ["0.05"], "--kernel-ab-max-time": ["0.3"],
    "--kernel-ab-hold-gpu": [], "--kernel-ab-throttle": ["discard"], "--kernel-ab-calls-per-sample": ["3"],
    "--kernel-ab-report": ["out/ab.json"], "--kernel-ab-compare": ["earlier.json"], "--kernel-ab-save": ["base"],
    "--kernel-ab-autosave": [], "--kernel-ab-storage": ["runs"], "--kernel-ab-history": ["3"],
    "--kernel-ab-compare-fail": ["loss"], "--kernel-ab-ceilings": ["off"], "--kernel-ab-cpu-threads": ["2"],
    "--kernel-gpus": ["all"], "--kernel-ab-modes": ["latency"],
}


def _arguments(rule: option_rules.Dependency) -> list[str]:
    """A command line that gives ``rule.option`` and lacks what it needs, and nothing else wrong."""
    given = [rule.option, *VALUES[rule.option]]
    if rule.needs == option_rules.AB:
        return given
    if rule.needs.startswith("a timed run"):
        extra = ["--kernel-ab-report", "out/ab.json"] if rule.option == "--kernel-ab-history" else []
        return ["--kernel-ab-profile", *extra, *given]
    if rule.option == "--kernel-gpus":
        return given
    return ["--kernel-ab", *given]


@pytest.mark.parametrize("rule", option_rules.DEPENDENCIES, ids=lambda rule: f"{rule.option} needs {rule.needs}")
def test_each_option_without_what_it_needs_is_refused_or_warned_naming_both(pytester, rule):
    pytester.makepyfile("def test_plain():\n    assert 1 + 1 == 2\n")
    write_json(build_report([], settings={}), pytester.path / "earlier.json")
    result = pytester.runpytest("-p", "no:cacheprovider", *_arguments(rule))
    message = f"{rule.option} needs {rule.needs}: {rule.otherwise}"
    if rule.severity == "error":
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert message in result.stderr.str(), result.stderr.str()
        assert "passed" not in result.stdout.str()
    else:
        result.assert_outcomes(passed=1)
        assert result.ret == pytest.ExitCode.OK
        assert f"PytestConfigWarning: kernelcheck options: {message}" in " ".join(result.stdout.str().split())


@pytest.mark.parametrize("arguments", [
    ["--kernel-ab", "--kernel-ab-report", "out/ab.json", "--kernel-ab-history", "3", "--kernel-ab-storage", "runs"],
    ["--kernel-ab-alpha", "0.01"],  # with kernel_ab = true in the ini file
    ["--kernel-ab-trace", "traces"],
])
def test_options_given_what_they_need_run_without_a_word(pytester, arguments):
    pytester.makeini("[pytest]\nkernel_ab = true\n" if "--kernel-ab" not in arguments else "[pytest]\n")
    pytester.makepyfile("def test_plain():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "error::pytest.PytestConfigWarning", *arguments)
    result.assert_outcomes(passed=1)
    assert "kernelcheck options" not in result.stdout.str() + result.stderr.str()


def test_an_ini_setting_alone_never_stops_a_run(pytester):
    # The ini file serves runs with A/B comparisons off too: its keys are defaults, not requests.
    pytester.makeini("[pytest]\nkernel_ab_report = out/ab.json\nkernel_ab_history = 3\nkernel_ab_cpu_threads = 1\n")
    pytester.makepyfile("def test_plain():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "error::pytest.PytestConfigWarning")
    result.assert_outcomes(passed=1)


def test_the_table_names_every_option_the_plugin_registers(pytester):
    config = pytester.parseconfig()
    registered = {name for option in config._parser.getgroup("kernelcheck").options for name in option.names()}
    tabled = {rule.option for rule in option_rules.DEPENDENCIES} | set(option_rules.INDEPENDENT)
    assert registered == tabled
    assert set(VALUES) == {rule.option for rule in option_rules.DEPENDENCIES}
