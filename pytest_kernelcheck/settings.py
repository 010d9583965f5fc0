"""Every option of the plugin resolved once per run: each value from the command line, else the ini file, else its
default, checked once, with where it came from. pytest-benchmark's session object is the model: the hooks in
:mod:`.plugin` and :mod:`.plugin_ab` read this object and never an option.

In a conftest or a test::

    >>> settings = settings_of(request.config)  # doctest: +SKIP
    >>> settings.oom.value, settings.source_of("kernel_oom"), settings.source_of("kernel_ab_alpha")  # doctest: +SKIP
    ('skip', 'default', 'ini')
    >>> settings.lines()  # doctest: +SKIP
    ['kernel_ab_alpha = 0.01 (ini)', 'kernel_oom = fail (command line)']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from .ab_settings import COMMAND_LINE, DEFAULT, INI, ABSettings, Resolved

OOM_CHOICES = ("skip", "fail")
_SETTINGS = pytest.StashKey["KernelcheckSettings"]()


@dataclass(frozen=True)
class KernelcheckSettings:
    """The run's settings: the correctness options (out-of-memory handling, the device memory cap, the GPUs xdist
    workers are spread over) and every A/B option (:class:`ABSettings`), each as a value and its source."""

    oom: Resolved  # "skip" or "fail" (--kernel-oom / kernel_oom)
    device_memory: Resolved  # bytes, or None for no cap (--kernel-device-memory / kernel_device_memory)
    gpus: Resolved  # the text given; "" for the default (--kernel-gpus / kernel_gpus)
    gpu_spec: Any  # speed.gpus.GpuSpec parsed from it ("all" for the default)
    ab: ABSettings

    @property
    def gpus_given(self) -> bool:
        """Whether --kernel-gpus or kernel_gpus named GPUs (the default spreads only over more than one)."""
        return self.gpus.source != DEFAULT

    def sources(self) -> dict[str, str]:
        """Where each option's value came from, by ini key (``kernel_oom``, ``kernel_ab_alpha``, ``kernel_ab``)."""
        found = {"kernel_oom": self.oom.source, "kernel_device_memory": self.device_memory.source,
                 "kernel_gpus": self.gpus.source}
        found.update({("kernel_ab_" + name if name else "kernel_ab"): source
                      for name, source in self.ab.sources.items()})
        return found

    def source_of(self, key: str) -> str:
        """``"command line"``, ``"ini"`` or ``"default"`` for the option whose ini key (or dest) is ``key``."""
        return self.sources().get(key, DEFAULT)

    def lines(self) -> list[str]:
        """One line per option not left at its default, ``key = value (source)``, sorted by key; what ``pytest -v``
        shows in the header."""
        values = {"kernel_oom": self.oom.value, "kernel_device_memory": self.device_memory.value,
                  "kernel_gpus": self.gpus.value}
        found = []
        for key, source in sorted(self.sources().items()):
            if source == DEFAULT:
                continue
            value = values[key] if key in values else self._ab_value(key)
            found.append(f"{key} = {value} ({source})")
        return found

    def _ab_value(self, key: str) -> Any:
        name = key.removeprefix("kernel_ab").removeprefix("_")
        direct = {"": self.ab.enabled, "report": self.ab.report_path, "compare": self.ab.compare_spec,
                  "storage": self.ab.storage_root, "history": self.ab.history_count, "save": self.ab.save_name,
                  "autosave": self.ab.saving, "compare_fail": ", ".join(r.expression for r in self.ab.rules),
                  "ceilings": "on" if self.ab.ceilings else "off", "cpu_threads": self.ab.cpu_threads}
        if name in direct:
            return direct[name]
        return self.ab.budget.get(name, "(set)")

    @classmethod
    def from_config(cls, config: pytest.Config) -> "KernelcheckSettings":
        """Resolve and check every option; a bad value is a ``pytest.UsageError`` naming the option, its ini key and
        what is accepted."""
        from .check.device_memory import parse_size
        from .speed import gpus

        oom = _resolved(config, "kernel_oom", "skip")
        if oom.value not in OOM_CHOICES:
            raise pytest.UsageError(f"kernel_oom must be one of {', '.join(OOM_CHOICES)}; got {oom.value!r}")
        raw_cap = _resolved(config, "kernel_device_memory", "")
        try:
            cap = parse_size(raw_cap.value) if raw_cap.value else None
        except ValueError as exc:
            raise pytest.UsageError(f"--kernel-device-memory / kernel_device_memory: {exc}") from None
        # An option given empty (--kernel-gpus "$GPUS", the variable unset) is parsed, and refused, rather than read
        # as not given; an empty ini value is the default.
        gpu_text = _resolved(config, gpus.INI, "", empty_given=True)
        try:
            spec = gpus.parse_spec(gpu_text.value if gpu_text.source == COMMAND_LINE else (gpu_text.value or "all"))
        except gpus.GpuSpecError as exc:
            raise pytest.UsageError(str(exc)) from None
        return cls(oom=oom, device_memory=Resolved(cap, raw_cap.source), gpus=gpu_text, gpu_spec=spec,
                   ab=ABSettings.from_config(config))


def _resolved(config: pytest.Config, key: str, default: str, *, empty_given: bool = False) -> Resolved:
    """``key``'s option (dest ``key``) if given, else its ini value (stripped), else ``default``. An option given
    empty counts as given only with ``empty_given`` (then its check refuses it); otherwise the ini value stands."""
    given = config.getoption(key, None)
    if given is not None and (given != "" or empty_given):
        return Resolved(given, COMMAND_LINE)
    value = str(config.getini(key)).strip()
    return Resolved(value, INI) if value and value != default else Resolved(value or default, DEFAULT)


def settings_of(config: pytest.Config) -> KernelcheckSettings:
    """This run's settings, resolved at the first call (whichever hook asks first) and kept on the config."""
    if _SETTINGS not in config.stash:
        config.stash[_SETTINGS] = KernelcheckSettings.from_config(config)
    return config.stash[_SETTINGS]
