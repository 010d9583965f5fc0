"""The A/B options resolved once: each value from the command line, else the ini file, else its default, with
where it came from, checked once; a bad value is refused naming its option and ini key and what is accepted.

In a conftest or test, ``ABSettings.from_config(config)`` gives them all::

    >>> settings = ABSettings.from_config(request.config)  # doctest: +SKIP
    >>> settings.budget["alpha"], settings.source_of("alpha")  # doctest: +SKIP
    (0.01, 'ini')
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from . import option_rules, option_values

# name: (type, default, help); each has a --kernel-ab-NAME option and a kernel_ab_NAME ini key.
NUMBER_SETTINGS = {
    "alpha": (float, 0.05, "false win/loss rate per comparison, over all its looks (default 0.05)"),
    "margin": (float, 0.02, "equivalence margin: a speedup interval inside [1/(1+m), 1+m] is a tie (default 0.02)"),
    "max_time": (float, 2.0, "seconds of sampling per comparison after warm-up (default 2.0)"),
}

# Each ini key's default, as pytest_addoption declares it (kernel_ab_NAME, or kernel_ab for "enabled").
INI_DEFAULTS: dict[str, Any] = {
    "": False,
    **{name: str(default) for name, (_, default, _) in NUMBER_SETTINGS.items()},
    "hold_gpu": False,
    "throttle": "flag",
    "calls_per_sample": "auto",
    "report": "",
    "compare": "",
    "autosave": False,
    "storage": "",
    "history": "5",
    "compare_fail": [],
    "ceilings": "on",
    "cpu_threads": "",
    "modes": "throughput",
}

# The options that name something: an empty value is refused rather than read as "not given".
NAMING_OPTIONS = {
    "report": "a report path (ab.json)", "trace": "a folder for the traces", "storage": "a folder of saved runs",
    "compare": "a saved run (number or name) or a report's path", "cpu_threads": "a count >= 1",
}

COMMAND_LINE, INI, DEFAULT = "command line", "ini", "default"


@dataclass(frozen=True)
class Resolved:
    """One option's value and where it came from: ``"command line"``, ``"ini"`` or ``"default"``."""

    value: Any
    source: str


def key(name: str) -> str:
    """The option's dest and ini key: ``kernel_ab_NAME``, and ``kernel_ab`` for the switch itself (name "")."""
    return f"kernel_ab_{name}" if name else "kernel_ab"


def option(name: str) -> str:
    """How a message names a setting: its option and its ini key."""
    return f"--kernel-ab-{name.replace('_', '-')} / kernel_ab_{name}"


def resolve(config: pytest.Config, name: str) -> Resolved:
    """``name``'s value from the command line, else from the ini file (its default when the file does not set it).

    An ini value equal to the default reads as the default: either way the run gets the same setting.
    """
    given = config.getoption(key(name))
    if given is not None:
        return Resolved(given, COMMAND_LINE)
    if name not in INI_DEFAULTS:  # an option with no ini key (--kernel-ab-save, -profile, -trace)
        return Resolved(None, DEFAULT)
    value = config.getini(key(name))
    return Resolved(value, DEFAULT if value == INI_DEFAULTS[name] else INI)


@dataclass(frozen=True)
class ABSettings:
    """Every A/B option of a run, resolved and checked once (:meth:`from_config`); ``sources`` says where each
    value came from, by option name ("" for --kernel-ab itself)."""

    enabled: bool
    budget: dict[str, Any]  # the report's settings: alpha, margin, max_time, hold_gpu, and throttle and
    # calls_per_sample where they are not the default
    profile: Any  # profiling.ProfileMode, or None for a timed run
    ceilings: bool
    report_path: str | None
    compare_spec: str | None
    storage_root: Path
    history_count: int
    save_name: str | None
    saving: bool
    rules: tuple[Any, ...]  # gate.Rule
    cpu_threads: int | None
    sources: dict[str, str] = field(default_factory=dict)
    modes: tuple[str, ...] = ("throughput",)  # --kernel-ab-modes: each comparison's modes unless it names its own

    def source_of(self, name: str) -> str:
        """Where the option ``name`` came from: "command line", "ini" or "default"."""
        return self.sources.get(name, DEFAULT)

    @classmethod
    def from_config(cls, config: pytest.Config) -> "ABSettings":
        """Resolve and check every A/B option; ``pytest.UsageError`` names the option of a bad value."""
        from .results import gate, storage

        resolved: dict[str, Resolved] = {}

        def value(name: str) -> Any:
            if name not in resolved:
                resolved[name] = resolve(config, name)
            return resolved[name].value

        _refuse_empty_options(config)
        budget: dict[str, Any] = {}
        for name in NUMBER_SETTINGS:
            budget[name] = _usage(option_values.parse_decimal, value(name), option(name))
        budget["hold_gpu"] = bool(value("hold_gpu"))
        throttle = value("throttle")
        if throttle not in ("flag", "discard", "fail"):
            raise pytest.UsageError(f"--kernel-ab-throttle / kernel_ab_throttle: one of flag, discard, fail; "
                                    f"got {throttle!r}")
        if throttle != "flag":  # the default leaves the report's settings as they were before the option
            budget["throttle"] = throttle
        calls = str(value("calls_per_sample")).strip()
        if calls != "auto":  # as throttle: the default leaves the report's settings as they were
            count = option_values.count_text(calls)  # 0 is left to the budget, which says why it is refused
            if count is None or count > option_values.MAX_COUNT:
                raise pytest.UsageError(f"{option('calls_per_sample')}: 'auto' or a whole number of calls, got "
                                        f"{option_values.shown(calls)}; accepted: 'auto', or a whole number from 1 "
                                        f"to {option_values.MAX_COUNT}, in ASCII digits")
            budget["calls_per_sample"] = count
        try:
            budget_from(budget)
        except ValueError as exc:
            # The budget names its field ("budget alpha must be ..."): say which option set it.
            options = [option(name) for name in budget if f"budget {name} " in str(exc)]
            raise pytest.UsageError(f"kernel A/B settings: {exc}" + (f" ({options[0]})" if options else "")) from None
        enabled = bool(value(""))
        profile = _profile_mode(config)
        if profile is not None:
            enabled = True
        ceilings = value("ceilings")
        if ceilings not in ("on", "off"):
            raise pytest.UsageError(f"--kernel-ab-ceilings / kernel_ab_ceilings: 'on' or 'off', got {ceilings!r}")
        storage_option = value("storage")
        storage_root = Path(storage_option) if resolved["storage"].source == COMMAND_LINE else (
            config.rootpath / (storage_option or storage.DEFAULT_FOLDER))
        history_count = _usage(option_values.parse_count, value("history"), option("history"), minimum=0,
                               problem="not a count >= 0")
        save_name = value("save")
        # None: not given; an empty name is given, and refused by check_name rather than taken for "not saving".
        saving = save_name is not None or bool(value("autosave"))
        report_path, compare_spec = value("report") or None, value("compare") or None
        option_rules.check(config, ab=enabled, profiling=profile is not None, saving=saving,
                           comparing=compare_spec is not None, reporting=report_path is not None, history=history_count)
        try:
            rules = tuple(gate.parse_rules(value("compare_fail")))
        except gate.GateError as exc:
            raise pytest.UsageError(f"kernel A/B: {exc}") from None
        raw_threads = value("cpu_threads")
        cpu_threads = _usage(option_values.parse_count, raw_threads, option("cpu_threads"), minimum=1,
                             problem="not a count >= 1") if raw_threads not in (None, "") else None
        modes = _modes(value("modes"))
        return cls(enabled=enabled, budget=budget, profile=profile, ceilings=ceilings == "on", modes=modes,
                   report_path=report_path, compare_spec=compare_spec, storage_root=storage_root,
                   history_count=history_count, save_name=save_name, saving=saving, rules=rules,
                   cpu_threads=cpu_threads, sources={name: r.source for name, r in resolved.items()})


def budget_from(settings: dict[str, Any]) -> Any:
    """The session's default budget from the report's settings (``Budget.replace`` checks every field)."""
    from .speed.budget import Budget

    return Budget().replace(**settings)


def _modes(text: Any) -> tuple[str, ...]:
    """--kernel-ab-modes as a tuple of mode names; ``pytest.UsageError`` naming the option otherwise."""
    from .speed import modes

    try:
        return modes.parse_modes(str(text), option("modes"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _usage(parse: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return parse(*args, **kwargs)
    except option_values.OptionValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _refuse_empty_options(config: pytest.Config) -> None:
    for name, accepted in NAMING_OPTIONS.items():
        value = config.getoption(key(name))
        if value is not None and not str(value).strip():
            raise pytest.UsageError(f"--kernel-ab-{name.replace('_', '-')}: the value is empty; give {accepted}, "
                                    f"or leave the option out")


def _profile_mode(config: pytest.Config) -> Any:
    """--kernel-ab-profile / --kernel-ab-trace as a profiling.ProfileMode; None for a timed run."""
    if not (config.getoption("kernel_ab_profile") or config.getoption("kernel_ab_trace")):
        return None
    from .speed import profiling

    try:
        return profiling.ProfileMode.from_options(True, config.getoption("kernel_ab_trace"))
    except OSError as exc:
        raise pytest.UsageError(f"--kernel-ab-trace: cannot create the trace folder: {exc}") from None
