"""One settings object resolves every option of the plugin once and says where each value came from; both halves
of the wiring (correctness and A/B) read it, and ``pytest -v`` shows what was set and where."""
from __future__ import annotations

SOURCES = """
from pytest_kernelcheck.plugin_ab import _SESSION
from pytest_kernelcheck.settings import settings_of


def test_sources(request):
    settings = settings_of(request.config)
    assert settings is settings_of(request.config)  # resolved once, kept on the config
    assert (settings.oom.value, settings.source_of("kernel_oom")) == ("fail", "ini")
    assert (settings.device_memory.value, settings.source_of("kernel_device_memory")) == (4 * 2**30, "command line")
    assert settings.source_of("kernel_gpus") == "default" and not settings.gpus_given
    assert (settings.ab.budget["alpha"], settings.source_of("kernel_ab_alpha")) == (0.01, "ini")
    assert (settings.ab.budget["max_time"], settings.source_of("kernel_ab_max_time")) == (0.5, "command line")
    assert settings.source_of("kernel_ab_margin") == "default"
    assert request.config.stash[_SESSION].options is settings.ab  # the A/B session was started from the same object
"""


def test_one_settings_object_says_where_every_value_came_from(pytester):
    pytester.makeini("[pytest]\nkernel_oom = fail\nkernel_ab_alpha = 0.01\n")
    pytester.makepyfile(test_sources=SOURCES)
    result = pytester.runpytest("-p", "no:cacheprovider", "--kernel-ab", "--kernel-ab-max-time", "0.5",
                                "--kernel-device-memory", "4GiB", "-v")
    result.assert_outcomes(passed=1)
    # -v: the header lists every option not left at its default, with its source, sorted by ini key.
    result.stdout.fnmatch_lines([
        "kernelcheck setting: kernel_ab = True (command line)",
        "kernelcheck setting: kernel_ab_alpha = 0.01 (ini)",
        "kernelcheck setting: kernel_ab_max_time = 0.5 (command line)",
        "kernelcheck setting: kernel_device_memory = 4294967296 (command line)",
        "kernelcheck setting: kernel_oom = fail (ini)",
    ])


def test_without_verbose_the_header_lists_no_settings(pytester):
    pytester.makeini("[pytest]\nkernel_oom = fail\n")
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "kernelcheck setting" not in result.stdout.str()


def test_a_bad_value_is_refused_once_naming_its_option(pytester):
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--kernel-device-memory", "lots")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--kernel-device-memory / kernel_device_memory: *lots*"])
    assert result.stderr.str().count("kernel_device_memory:") == 1
