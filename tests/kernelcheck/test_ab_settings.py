"""The A/B options resolved once, each with where its value came from: command line, ini file or default."""
from __future__ import annotations

import pytest

from pytest_kernelcheck.ab_settings import (
    COMMAND_LINE,
    DEFAULT,
    INI,
    INI_DEFAULTS,
    resolve,
)

SOURCES_TEST = """
from pytest_kernelcheck.ab_settings import ABSettings


def test_sources(request):
    settings = ABSettings.from_config(request.config)
    assert (settings.budget["alpha"], settings.source_of("alpha")) == (0.01, "ini")
    assert (settings.budget["margin"], settings.source_of("margin")) == (0.05, "command line")
    assert (settings.budget["max_time"], settings.source_of("max_time")) == (2.0, "default")
    assert (settings.history_count, settings.source_of("history")) == (3, "ini")
    assert (settings.enabled, settings.source_of("")) == (True, "command line")
    assert (settings.save_name, settings.source_of("save")) == (None, "default")
"""


def test_each_option_says_where_its_value_came_from(pytester):
    pytester.makeini("[pytest]\nkernel_ab_alpha = 0.01\nkernel_ab_history = 3\n")
    pytester.makepyfile(test_sources=SOURCES_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "--kernel-ab", "--kernel-ab-margin", "0.05")
    result.assert_outcomes(passed=1)


class _Config:
    """The two lookups resolve makes, answered from dicts."""

    def __init__(self, options: dict, ini: dict) -> None:
        self.options, self.ini = options, ini

    def getoption(self, name: str):
        return self.options.get(name)

    def getini(self, name: str):
        return self.ini[name]


@pytest.mark.parametrize(
    "options, ini, expected",
    [
        ({"kernel_ab_throttle": "fail"}, {"kernel_ab_throttle": "discard"}, ("fail", COMMAND_LINE)),
        ({}, {"kernel_ab_throttle": "discard"}, ("discard", INI)),
        ({}, {"kernel_ab_throttle": INI_DEFAULTS["throttle"]}, (INI_DEFAULTS["throttle"], DEFAULT)),
    ],
)
def test_the_command_line_wins_over_the_ini_file_which_wins_over_the_default(options, ini, expected):
    resolved = resolve(_Config(options, ini), "throttle")
    assert (resolved.value, resolved.source) == expected


def test_an_option_without_an_ini_key_is_the_default_unless_given():
    assert resolve(_Config({}, {}), "save").source == DEFAULT
    given = resolve(_Config({"kernel_ab_save": "nightly"}, {}), "save")
    assert (given.value, given.source) == ("nightly", COMMAND_LINE)
