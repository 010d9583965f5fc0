"""The whole A/B report as one typed record: its rows, totals and environment, read from and written to the
report's JSON with every field checked."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from .fields import DamagedReport, NotAReport, is_number
from .measured import CeilingRecord
from .records import (
    SCHEMA,
    SCHEMA_VERSION,
    ComparisonRecord,
    MeasurementRecord,
    TournamentRecord,
)


@dataclass(frozen=True)
class ReportSummary:
    """The totals of a report: comparisons per verdict, the geometric-mean speedup, how many survive
    Benjamini-Hochberg, and (compared with an earlier report) the names that regressed.

    >>> ReportSummary(comparisons=1, win=1, regressions=()).to_json()["regressions"]
    []
    """

    comparisons: int = 0
    win: int = 0
    loss: int = 0
    tie: int = 0
    inconclusive: int = 0
    error: int = 0  # comparisons that raised
    geomean_speedup: float | None = None
    bh_alpha: float = 0.05
    bh_win: int = 0
    bh_loss: int = 0
    throttled: int = 0  # comparisons that ran while the SM clock dropped
    tournaments: int = 0
    measurements: int = 0
    regressions: tuple[str, ...] | None = None  # None: not compared with an earlier report
    modes_disagree: int = 0  # comparisons whose measurement modes reached different verdicts

    def to_json(self) -> dict[str, Any]:
        data = {
            "comparisons": self.comparisons, "win": self.win, "loss": self.loss, "tie": self.tie,
            "inconclusive": self.inconclusive, "error": self.error, "geomean_speedup": self.geomean_speedup,
            "bh_alpha": self.bh_alpha, "bh_win": self.bh_win, "bh_loss": self.bh_loss, "throttled": self.throttled,
            "tournaments": self.tournaments, "measurements": self.measurements,
        }
        if self.regressions is not None:
            data["regressions"] = list(self.regressions)
        if self.modes_disagree:  # only runs with such rows: every other report keeps its layout
            data["modes_disagree"] = self.modes_disagree
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ReportSummary":
        defaults = cls()
        counts = {f.name: data.get(f.name, getattr(defaults, f.name)) for f in dataclasses.fields(cls)}
        regressions = data.get("regressions")
        counts["regressions"] = tuple(regressions) if regressions is not None else None
        return cls(**counts)


@dataclass(frozen=True)
class GpuInfo:
    """The GPUs of the run, when torch was used with CUDA: names, CUDA, driver (or why it is unknown) and cuDNN.

    >>> GpuInfo().to_json()
    {'available': False}
    """

    available: bool = False
    devices: tuple[str, ...] = ()
    cuda: str | None = None
    driver: str | None = None
    cudnn: str | None = None

    def to_json(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False}
        return {"available": True, "devices": list(self.devices), "cuda": self.cuda, "driver": self.driver,
                "cudnn": self.cudnn}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "GpuInfo":
        return cls(available=bool(data.get("available", False)), devices=tuple(data.get("devices") or ()),
                   cuda=data.get("cuda"), driver=data.get("driver"), cudnn=data.get("cudnn"))


@dataclass(frozen=True)
class RunEnvironment:
    """Where the numbers came from: host, CPU model, Python and package versions, GPU, date and git commit.

    ``machine_info`` and ``commit_info`` are pytest-benchmark's dicts, kept as it writes them; when they could not
    be had, ``machine_info_error`` says why.

    >>> RunEnvironment.from_json({"hostname": "h", "commit_info": {"id": "abc123"}}).commit_id
    'abc123'
    """

    date: str | None = None
    hostname: str | None = None
    python: str | None = None
    packages: Mapping[str, str | None] = field(default_factory=dict)
    machine_info: Mapping[str, Any] | None = None
    commit_info: Mapping[str, Any] | None = None
    machine_info_error: str | None = None
    gpu: GpuInfo = GpuInfo()
    cpu_model: str | None = None
    ceilings_enabled: bool | None = None  # None: the report says nothing about ceilings (no throughput given)
    ceilings: tuple[CeilingRecord, ...] = ()  # measured in this session, one per device and dtype

    @property
    def commit_id(self) -> str | None:
        return (self.commit_info or {}).get("id")  # pytest-benchmark's own mapping, not one of these records

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"date": self.date, "hostname": self.hostname, "python": self.python,
                                "packages": dict(self.packages)}
        for name in ("machine_info", "commit_info", "machine_info_error"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        data["gpu"] = self.gpu.to_json()
        if self.cpu_model is not None:
            data["cpu_model"] = self.cpu_model
        if self.ceilings_enabled is not None:
            data["ceilings"] = {"enabled": self.ceilings_enabled,
                                "measured": [ceiling.to_json() for ceiling in self.ceilings]}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RunEnvironment":
        return cls(date=data.get("date"), hostname=data.get("hostname"), python=data.get("python"),
                   packages=data.get("packages") or {}, machine_info=data.get("machine_info"),
                   commit_info=data.get("commit_info"), machine_info_error=data.get("machine_info_error"),
                   gpu=GpuInfo.from_json(data.get("gpu") or {}), cpu_model=data.get("cpu_model"),
                   ceilings_enabled=(data.get("ceilings") or {}).get("enabled"),
                   ceilings=tuple(CeilingRecord.from_json(c)
                                  for c in (data.get("ceilings") or {}).get("measured") or ()))


@dataclass(frozen=True)
class ABReport:
    """A whole A/B report: settings, environment, totals, comparison rows (BH columns filled in) and tournaments.

    ``environment`` stays the mapping the run wrote (empty when no report file was asked for); read it through
    :class:`RunEnvironment`.

    >>> ABReport.from_json({"schema": SCHEMA, "comparisons": [{"kind": "comparison", "name": "a",
    ...                     "verdict": "tie"}]}).comparisons[0].verdict
    'tie'
    >>> ABReport.from_json({"schema": "other"})
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.fields.NotAReport: expected schema 'pytest-kernelcheck/ab-report' with 'comparisons'
    >>> ABReport.from_json({"schema": SCHEMA, "version": 99, "comparisons": []})
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.fields.DamagedReport: field 'version': 99 is refused; accepted: 1 (the layout this \
pytest-kernelcheck reads)
    """

    created: str
    settings: Mapping[str, Any]
    summary: ReportSummary
    comparisons: tuple[ComparisonRecord, ...]
    tournaments: tuple[TournamentRecord, ...]
    environment: Mapping[str, Any] = field(default_factory=dict)
    version: int = SCHEMA_VERSION
    measurements: tuple[MeasurementRecord, ...] = ()
    # False in the report a run rewrites while it goes (report.ProgressWriter): what it had finished when it was
    # last written, so a run killed before its end leaves it so marked. Written to JSON only when False.
    finished: bool = True
    # How the machine of the compared earlier run differs from this run's ("GPU NVIDIA H100 then, none now"; see
    # storage.machine_differences); empty when they match or nothing was compared. Written to JSON only when set.
    machine_differences: tuple[str, ...] = ()
    # The compared earlier run's rows that no row of this run matched (renamed, removed, deselected, skipped):
    # listed so that the gate says what it could not check (see .unmatched). Written to JSON when compared.
    vanished: tuple[ComparisonRecord, ...] = ()

    @property
    def compared_with_last_run(self) -> bool:
        return self.summary.regressions is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "version": self.version, "created": self.created, "settings": dict(self.settings),
            "environment": dict(self.environment), "summary": self.summary.to_json(),
            "comparisons": [row.to_json(with_last_run=self.compared_with_last_run) for row in self.comparisons],
            "tournaments": [row.to_json() for row in self.tournaments],
            "measurements": [row.to_json() for row in self.measurements],
            **({} if self.finished else {"finished": False}),
            **({"machine_differences": list(self.machine_differences)} if self.machine_differences else {}),
            **({"vanished": [row.to_json() for row in self.vanished]} if self.compared_with_last_run else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> "ABReport":
        """Read a report dict; raises :class:`NotAReport` unless it has our schema and a list of comparisons, and
        :class:`DamagedReport` naming the field (and the row: ``comparisons[0] ('fused')``) when a field holds what
        no run writes, or the report is of a layout version this one does not read."""
        is_report = isinstance(data, Mapping) and data.get("schema") == SCHEMA
        if not is_report or not isinstance(data.get("comparisons"), list):
            raise NotAReport(f"expected schema {SCHEMA!r} with 'comparisons'")
        version = data.get("version", SCHEMA_VERSION)
        # Only the layout this code writes is read: a newer one may mean other things by the same keys.
        if not is_number(version) or version != SCHEMA_VERSION:
            raise DamagedReport(f"field 'version': {version!r} is refused; accepted: {SCHEMA_VERSION} (the layout "
                                f"this pytest-kernelcheck reads)")
        return cls(
            created=data.get("created", ""), settings=data.get("settings") or {},
            summary=ReportSummary.from_json(data.get("summary") or {}),
            comparisons=_rows_from_json(ComparisonRecord, data, "comparisons"),
            tournaments=_rows_from_json(TournamentRecord, data, "tournaments"),
            environment=data.get("environment") or {}, version=SCHEMA_VERSION,
            measurements=_rows_from_json(MeasurementRecord, data, "measurements"),
            finished=data.get("finished", True) is not False,
            machine_differences=tuple(data.get("machine_differences") or ()),
            vanished=_rows_from_json(ComparisonRecord, data, "vanished"),
        )


_Record = TypeVar("_Record", ComparisonRecord, TournamentRecord, MeasurementRecord)


def _rows_from_json(kind: type[_Record], data: Mapping[str, Any], key: str) -> tuple[_Record, ...]:
    """The typed rows of ``data[key]``; a damaged one is named by its place and name in the report.

    >>> _rows_from_json(ComparisonRecord, {"comparisons": [{"name": "fused", "verdict": "win", "ci": [1.1]}]},
    ...                 "comparisons")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.fields.DamagedReport: comparisons[0] ('fused'): field 'ci': [1.1] is refused; accepted: \
[low, high] with low <= high, each a number 0 or more or null (unbounded)
    """
    rows = []
    for index, row in enumerate(data.get(key) or ()):
        if not isinstance(row, Mapping):
            raise DamagedReport(f"{key}[{index}]: {row!r} is refused; accepted: a JSON object (one row)")
        try:
            rows.append(kind.from_json(row))
        except DamagedReport as exc:
            raise DamagedReport(f"{key}[{index}] ({row.get('name')!r}): {exc}") from None
    return tuple(rows)
