"""Which command-line options need another: one table, checked once when pytest configures.

An option whose work only happens with another one (``--kernel-ab-report`` writes a report only when A/B
comparisons run) would otherwise be taken and do nothing, and a CI script that forgot ``--kernel-ab`` would pass
without a word. Each row of :data:`DEPENDENCIES` names an option, what it needs, and what the run does when that is
missing: ``error`` (pytest stops with a usage error, exit status 4) where nothing the option asks for would happen,
``warning`` where the run still does what it is asked but the option has no effect in this kind of run.

Only options given on the command line are checked. An ini setting is a project default that also serves runs that
turn the feature off, so an ini value alone never stops a run; it does count as the option's requirement (``kernel_ab
= true`` satisfies ``--kernel-ab``).

>>> state = OptionState(given=frozenset({"--kernel-ab-report"}), ab=False, profiling=False, distributing=False,
...                     saving=False, comparing=False, reporting=True, history=5)
>>> [finding.message for finding in findings(state)]  # doctest: +NORMALIZE_WHITESPACE
['--kernel-ab-report needs --kernel-ab (or kernel_ab = true in the ini file): without it no A/B comparison runs,
  so no report is written']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

AB = "--kernel-ab (or kernel_ab = true in the ini file)"
PROFILE = "--kernel-ab-profile / --kernel-ab-trace"


@dataclass(frozen=True)
class OptionState:
    """What the run was asked for, after the ini file: the options given on the command line and each feature."""

    given: frozenset[str]  # command-line options given, by flag ("--kernel-ab-report")
    ab: bool  # A/B tests run: --kernel-ab, kernel_ab = true, or profile mode
    profiling: bool  # --kernel-ab-profile or --kernel-ab-trace: nothing timed, no report
    distributing: bool  # pytest-xdist workers run the tests (-n N with N >= 1)
    saving: bool  # --kernel-ab-save or --kernel-ab-autosave / kernel_ab_autosave
    comparing: bool  # --kernel-ab-compare or kernel_ab_compare
    reporting: bool  # --kernel-ab-report or kernel_ab_report
    history: int  # --kernel-ab-history / kernel_ab_history


@dataclass(frozen=True)
class Dependency:
    """One option that needs another: ``holds`` says whether the run has what it needs."""

    option: str
    needs: str  # the other option(s), as the message names them
    holds: Callable[[OptionState], bool]
    otherwise: str  # what the option would (not) do without it
    severity: Literal["error", "warning"] = "error"


@dataclass(frozen=True)
class Finding:
    severity: Literal["error", "warning"]
    message: str


def _needs_ab(option: str, otherwise: str) -> Dependency:
    return Dependency(option, AB, lambda state: state.ab, otherwise)


def _not_in_profile(option: str, otherwise: str, severity: Literal["error", "warning"] = "warning") -> Dependency:
    return Dependency(option, f"a timed run (not {PROFILE})", lambda state: not state.profiling, otherwise, severity)


DEPENDENCIES: tuple[Dependency, ...] = (
    _needs_ab("--kernel-ab-alpha", "without it no A/B comparison runs, so the setting is never used"),
    _needs_ab("--kernel-ab-margin", "without it no A/B comparison runs, so the setting is never used"),
    _needs_ab("--kernel-ab-max-time", "without it no A/B comparison runs, so the setting is never used"),
    _needs_ab("--kernel-ab-hold-gpu", "without it no A/B comparison runs, so the setting is never used"),
    _needs_ab("--kernel-ab-throttle", "without it no A/B comparison runs, so the setting is never used"),
    _needs_ab("--kernel-ab-calls-per-sample", "without it no A/B comparison runs, so the setting is never used"),
    _needs_ab("--kernel-ab-report", "without it no A/B comparison runs, so no report is written"),
    _needs_ab("--kernel-ab-compare", "without it no A/B comparison runs, so nothing is compared"),
    _needs_ab("--kernel-ab-save", "without it no A/B comparison runs, so no run is saved"),
    _needs_ab("--kernel-ab-autosave", "without it no A/B comparison runs, so no run is saved"),
    _needs_ab("--kernel-ab-storage", "without it no A/B comparison runs, so no saved run is read or written"),
    _needs_ab("--kernel-ab-history", "without it no A/B comparison runs, so no history is shown"),
    _needs_ab("--kernel-ab-compare-fail", "without it no A/B comparison runs, so the gate judges nothing and passes"),
    _needs_ab("--kernel-ab-ceilings", "without it no A/B comparison runs, so no ceiling is measured"),
    _needs_ab("--kernel-ab-cpu-threads", "without it no A/B comparison runs, so the thread count is never set"),
    _needs_ab("--kernel-ab-modes", "without it no A/B comparison runs, so no mode is measured"),
    Dependency("--kernel-ab-storage", "--kernel-ab-save, --kernel-ab-autosave, --kernel-ab-compare or "
               "--kernel-ab-report (whose markdown shows the history)",
               lambda state: state.saving or state.comparing or (state.reporting and state.history > 0),
               "the folder of saved runs is neither written nor read"),
    Dependency("--kernel-ab-history", "--kernel-ab-report (the history is a table of the markdown report)",
               lambda state: state.reporting, "no history is shown"),
    # Profile mode runs each callable once and times nothing: no report, comparison, gate or saved run.
    _not_in_profile("--kernel-ab-report", "profile mode times nothing and writes no report"),
    _not_in_profile("--kernel-ab-compare", "profile mode times nothing, so nothing is compared"),
    _not_in_profile("--kernel-ab-compare-fail", "profile mode times nothing, so the gate would judge nothing and "
                    "pass", severity="error"),
    _not_in_profile("--kernel-ab-save", "profile mode times nothing, so no run is saved"),
    _not_in_profile("--kernel-ab-autosave", "profile mode times nothing, so no run is saved"),
    _not_in_profile("--kernel-ab-history", "profile mode writes no report, so no history is shown"),
    _not_in_profile("--kernel-ab-cpu-threads", "profile mode runs the callables with the threads torch has"),
    _not_in_profile("--kernel-ab-ceilings", "profile mode measures no ceiling"),
    Dependency("--kernel-gpus", "pytest-xdist workers (-n N, N >= 1)", lambda state: state.distributing,
               "without workers the tests run in this one process, on the GPUs it sees", severity="warning"),
)

# Options that need nothing else. Together with DEPENDENCIES this lists every option the plugin registers
# (a test keeps the two in step with pytest --help).
INDEPENDENT = ("--kernel-oom", "--kernel-device-memory", "--kernel-ab", "--kernel-ab-profile", "--kernel-ab-trace")


def findings(state: OptionState) -> list[Finding]:
    """What is wrong with the options given, in table order."""
    return [Finding(rule.severity, f"{rule.option} needs {rule.needs}: {rule.otherwise}")
            for rule in DEPENDENCIES if rule.option in state.given and not rule.holds(state)]


def given_options(config: Any, flags_by_dest: dict[str, str]) -> frozenset[str]:
    """The flags among ``flags_by_dest`` (dest -> flag) whose value came from the command line (not None)."""
    return frozenset(flag for dest, flag in flags_by_dest.items() if config.getoption(dest, None) is not None)


def flags_by_dest() -> dict[str, str]:
    """The config dest of each option in the table: the flag without its dashes, ``-`` as ``_``."""
    flags = {rule.option for rule in DEPENDENCIES} | set(INDEPENDENT)
    return {flag.lstrip("-").replace("-", "_"): flag for flag in flags}


def check(config: Any, *, ab: bool, profiling: bool, saving: bool, comparing: bool, reporting: bool,
          history: int) -> None:
    """Stop the run with a usage error naming every option that needs what is missing, or warn (see the table).

    Done by the process that runs the session; pytest-xdist workers get the same options and are not checked again.
    """
    import pytest

    if hasattr(config, "workerinput"):
        return
    state = OptionState(given=given_options(config, flags_by_dest()), ab=ab, profiling=profiling,
                        distributing=getattr(config.option, "dist", "no") != "no", saving=saving,
                        comparing=comparing, reporting=reporting, history=history)
    found = findings(state)
    errors = [finding.message for finding in found if finding.severity == "error"]
    if errors:
        raise pytest.UsageError("kernelcheck options: " + "; ".join(errors))
    for finding in found:
        config.issue_config_time_warning(pytest.PytestConfigWarning(f"kernelcheck options: {finding.message}"),
                                         stacklevel=2)
